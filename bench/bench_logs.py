#!/usr/bin/env python3
"""`corral logs` of a large rank log: lines a second, this code vs another checkout's, and `cat`.

    .venv/bin/python bench/bench_logs.py                      # 300,000 lines, this machine as the cluster
    .venv/bin/python bench/bench_logs.py --lines 1000000 --old /tmp/old-checkout/src

A detached job (this machine as the default cluster, one rank) prints
``--lines`` lines of a training log's width and ends; then ``corral logs RUN
--rank 0`` prints them all into /dev/null, timed, ``--repeat`` times,
alternating with the same command run from ``--old`` (a ``src`` directory
of another checkout, on PYTHONPATH: before and after in one run) and with
`cat` of the same file (the anchor: reading and writing the bytes, no
protocol).  Printed: median seconds and lines/s of each, and the ratios.
Runs under a private temporary HOME and working directory, removed after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPAM = """
import sys
w = sys.stdout.write
for i in range({n}):
    w(f"step {{i}} loss 0.{{i % 9973:04d}} lr 3e-4 tokens/s 123456.7 grad_norm 1.234\\n")
"""


def corral(env: dict, cwd: Path, *args: str, src: Path | None = None, out=subprocess.PIPE) -> subprocess.CompletedProcess:
    e = dict(env)
    if src is not None:
        e["PYTHONPATH"] = str(src)
    return subprocess.run([sys.executable, "-m", "corral", *args], cwd=cwd, env=e, stdout=out,
                          stderr=subprocess.PIPE, text=True, timeout=900, check=False)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lines", type=int, default=300_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--old", type=Path, default=None, help="another checkout's src/ to compare with")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="corral-bench-logs-") as tmp:
        root = Path(tmp)
        home, work = root / "home", root / "work"
        home.mkdir()
        work.mkdir()
        env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO / "src")}
        (work / "spam.py").write_text(textwrap.dedent(SPAM.format(n=args.lines)))
        res = corral(env, work, "run", "--detach", "-n", "1", "spam.py", out=subprocess.DEVNULL)
        if res.returncode != 0:
            print(res.stderr[-2000:], file=sys.stderr)
            return 1
        found = re.search(r"run (\S+) (?:is running, detached|ended before this command returned)", res.stderr)
        if not found:
            print(res.stderr[-2000:], file=sys.stderr)
            return 1
        run = found.group(1)
        for _ in range(600):  # until it has ended
            ps = json.loads(corral(env, work, "ps", "--json").stdout or "{}")
            if not any(j.get("run_id") == run for j in ps.get("jobs", [])):
                break
            time.sleep(0.5)
        log = next((home / ".local/state/corral/detached" / run / run).glob("*/rank0.log"))
        n = sum(1 for _ in log.open("rb"))
        print(f"run {run}: rank 0's log has {n} lines, {log.stat().st_size / 1e6:.1f} MB")
        sides = {"corral logs (this checkout)": lambda: corral(env, work, "logs", run, "--rank", "0",
                                                                 out=subprocess.DEVNULL),
                 "cat": lambda: subprocess.run(["cat", str(log)], stdout=subprocess.DEVNULL, check=True)}
        if args.old is not None:
            sides["corral logs (--old)"] = lambda: corral(env, work, "logs", run, "--rank", "0",
                                                            src=args.old, out=subprocess.DEVNULL)
        times: dict[str, list[float]] = {k: [] for k in sides}
        for _ in range(args.repeat):
            for name, fn in sides.items():
                times[name].append(timed(fn))
        med = {k: statistics.median(v) for k, v in times.items()}
        for name, t in med.items():
            print(f"{name:30s} {t:7.2f} s  {n / t:12,.0f} lines/s  (runs: {', '.join(f'{x:.2f}' for x in times[name])})")
        new = med["corral logs (this checkout)"]
        if "corral logs (--old)" in med:
            print(f"this checkout / --old: {new / med['corral logs (--old)']:.2f}x the time")
        print(f"this checkout / cat: {new / med['cat']:.1f}x the time")
    return 0


if __name__ == "__main__":
    sys.exit(main())
