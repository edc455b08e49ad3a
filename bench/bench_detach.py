#!/usr/bin/env python3
"""Detach overhead: time to every rank in user code, `corral run --detach` vs attached.

    sudo .venv/bin/python bench/bench_detach.py              # 4 nodes x 2 ranks, 3 runs each
    sudo .venv/bin/python bench/bench_detach.py --repeat 5

Same probe script (bench/workloads/detach_probe.py: each rank writes the
time it reached user code, then meets the others), same 4-node sandbox
(real sshd per node, gloo), alternating attached and detached runs:

- attached: ``corral run -c <sandbox>/corral.toml probe.py``
- detached: ``corral run -c <sandbox>/corral.toml --detach probe.py``: the
  supervisor starts on node 1 and reaches the other nodes with node 1's own
  ssh key (the sandbox's key, put in node 1's ~/.ssh here, as `corral ssh
  setup` would), and the command returns once every rank is in user code.

Every run starts without an ssh connection of this machine's left from the
one before (ControlPersist would otherwise save the attended runs their
handshakes, which the supervisor always makes). Measured: seconds from the command's start to the last rank's "in user code"
time stamp (the same for both), and, detached, to the command's return.
The first detached run also unpacks corral's package on node 1 (cold); it
is reported apart and left out of the medians.  Goal: detached / attached
<= 1.1.  Run as root (the sandbox needs it).
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import corral as corral_pkg
from corral.sandbox import Sandbox

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "bench" / "workloads" / "detach_probe.py"
CORRAL = [sys.executable, "-m", "corral"]


def node_ssh(sb: Sandbox) -> None:
    """Node 1 reaches the others with its own key and known_hosts."""
    first = sb.nodes[0]
    sb.exec(first, ["sh", "-c", ("mkdir -p -m 700 /root/.ssh && cat > /root/.ssh/id_ed25519 && "
                                 "chmod 600 /root/.ssh/id_ed25519")], input=sb.identity_file.read_text(), check=True)
    sb.exec(first, ["sh", "-c", "cat > /root/.ssh/known_hosts"], input=sb.known_hosts.read_text(), check=True)


def close_masters(runtime: Path) -> None:
    """No ssh connection of this machine's outlives a run: each run connects
    afresh, as a user's first command would (the supervisor on node 1 never
    keeps one)."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if cmd.startswith(b"ssh: ") and str(runtime).encode() in cmd:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGTERM)


def once(sb: Sandbox, detach: bool, runs: Path, runtime: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix="detach-", dir=REPO / "scratch"))
    argv = CORRAL + ["run", "-c", str(sb.cluster_file), "--runs-dir", str(runs),
                     *(["--detach"] if detach else []), str(PROBE), str(out), "3"]
    close_masters(runtime)
    time.sleep(0.5)
    t0 = time.time()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
                          env=dict(os.environ, XDG_RUNTIME_DIR=str(runtime)))
    returned = time.time() - t0
    want = 2 * len(sb.nodes)
    deadline = time.time() + 60
    while len(list(out.glob("user-*"))) < want and time.time() < deadline:
        time.sleep(0.1)
    stamps = [float(p.read_text()) for p in out.glob("user-*") if p.read_text().strip()]
    if detach:  # let it end before the next run
        time.sleep(4)
    shutil.rmtree(out, ignore_errors=True)
    ok = proc.returncode == 0 and len(stamps) == want
    if not ok:
        print(proc.stderr[-2000:], file=sys.stderr)
    return {"ok": ok, "user": max(stamps) - t0 if stamps else None, "returned": returned}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    (REPO / "scratch").mkdir(exist_ok=True)
    compileall.compile_dir(Path(corral_pkg.__file__).parent, quiet=1)  # corral as installed
    runs = Path(tempfile.mkdtemp(prefix="bench-detach-"))
    runtime = Path(tempfile.mkdtemp(prefix="bench-detach-rt-"))  # this benchmark's ssh sockets only
    jobs = Path("/root/.local/state/corral/detached")  # node 1's, shared with this machine by the sandbox
    before = set(jobs.glob("*"))
    sb = Sandbox(name="benchdt", prefix="bd")
    sb.up(args.nodes, with_keys=True, slots=2)
    try:
        node_ssh(sb)
        cold = once(sb, True, runs, runtime)
        print(f"  detached (cold: package unpacked on {sb.nodes[0]}): user code {cold['user']:.1f}s, "
              f"returned {cold['returned']:.1f}s")
        res: dict[str, list[dict]] = {"attached": [], "detached": []}
        for _ in range(args.repeat):
            for name, rs in res.items():
                r = once(sb, name == "detached", runs, runtime)
                rs.append(r)
                print(f"  {name:9s} ok={r['ok']} user code {r['user']:.1f}s, command returned {r['returned']:.1f}s")
        med = {n: statistics.median([r["user"] for r in rs if r["ok"]]) for n, rs in res.items()}
        ret = statistics.median([r["returned"] for r in res["detached"] if r["ok"]])
        print(f"\nTo every rank in user code, {args.nodes} nodes x 2 ranks (median of {args.repeat}):")
        print(f"  attached {med['attached']:.2f}s   detached {med['detached']:.2f}s "
              f"(`corral run --detach` returned after {ret:.2f}s)")
        ratio = med["detached"] / med["attached"]
        print(f"  ratio detached / attached = {ratio:.2f}  (goal <= 1.10: {'met' if ratio <= 1.1 else 'MISSED'})")
    finally:
        sb.down()
        close_masters(runtime)
        shutil.rmtree(runs, ignore_errors=True)
        shutil.rmtree(runtime, ignore_errors=True)
        for d in set(jobs.glob("*")) - before:
            shutil.rmtree(d, ignore_errors=True)  # this benchmark's jobs' directories


if __name__ == "__main__":
    main()
