#!/usr/bin/env python3
"""Recovery: from a node stopped to training resumed on the nodes left.

    sudo .venv/bin/python bench/bench_recovery.py                 # 4 nodes x 2 ranks, --min-nodes 3
    sudo .venv/bin/python bench/bench_recovery.py --spare --repeat 3
    sudo .venv/bin/python bench/bench_recovery.py --rejoin-timeout 10

A 4-node sandbox (real sshd per node, gloo) runs
``corral run --max-restarts 1 --min-nodes 3 --checkpoint-dir DIR
bench/workloads/resume_loop.py``: every step an all-reduce, rank 0
checkpointing the step to a directory every node sees.  Once the job is
training, node 3 is stopped (``corral sandbox stop``: every process on it,
its sshd too).  With ``--spare`` the cluster file lists 3 nodes and the 4th
as ``spare = true``, and the spare takes node 2's place instead.

Seconds from the stop to (breakdown, from corral's and the script's lines,
timed on this machine's clock):

- **detect**: corral names the node lost;
- **teardown**: every other node's ranks stopped, the attempt recorded;
- **decide**: the lost node was given ``--rejoin-timeout`` to answer again
  (reconnect attempts to its agent), then corral says which nodes the restart
  runs on (shown with the rejoin wait taken out, too);
- **relaunch**: connect, preflight and rendezvous check on the new node set,
  up to the first rank of the new attempt in user code;
- **first step**: the new process group formed, the checkpoint read, and
  the first all-reduce of the resumed training done.

Run as root (the sandbox needs it).
"""

from __future__ import annotations

import argparse
import compileall
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import corral as corral_pkg
from corral.sandbox import Sandbox

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LOOP = REPO / "bench" / "workloads" / "resume_loop.py"
STEPS = 400  # long enough to outlast the restart; the run is stopped once it resumed


def once(sb: Sandbox, *, spare: bool, rejoin: float, log_dir: Path, n: int) -> dict:
    ckpt = Path(tempfile.mkdtemp(prefix="ckpt-", dir=REPO / "scratch"))
    cluster = sb.cluster_file
    victim = sb.nodes[2]
    if spare:
        last = sb.nodes[-1]
        block = f'name = "{last}"\naddress = "{sb.addresses[last]}"\n'
        cluster = log_dir / "spare.toml"
        cluster.write_text(sb.cluster_file.read_text().replace(block, block + "spare = true\n"))
        victim = sb.nodes[1]
    argv = [str(BIN / "corral"), "run", "-c", str(cluster), "--max-restarts", "1", "--min-nodes", "3",
            "--rejoin-timeout", str(rejoin), "--checkpoint-dir", str(ckpt), str(LOOP), str(STEPS)]
    lines: list[tuple[float, str]] = []
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    threading.Thread(target=lambda: [lines.append((time.time(), ln)) for ln in proc.stdout], daemon=True).start()

    def first(pattern: str, after: float = 0.0, timeout: float = 300) -> tuple[float, re.Match]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for t, ln in list(lines):
                m = re.search(pattern, ln)
                if m and t >= after:
                    return t, m
            if proc.poll() is not None and not any(re.search(pattern, ln) for _, ln in lines):
                break
            time.sleep(0.02)
        raise SystemExit(f"no line matching {pattern!r} (log: {log_dir}/run-{n}.log)")

    try:
        first(r"step 20 1 ")
        t0 = time.time()
        sb.stop(victim)
        t_detect, _ = first(rf"{victim} was lost", t0)
        t_down, _ = first(r"restarting the job \(restart", t0)
        t_decide, _ = first(r"restarting on \d+ node\(s\)", t0)
        _, m = first(r"user 2 ([\d.]+)", t0)
        t_user = float(m.group(1))
        _, m = first(r"step \d+ 2 (\d+) ([\d.]+)", t0)
        t_step, world = float(m.group(2)), int(m.group(1))
    finally:
        proc.kill()
        proc.wait()
        (log_dir / f"run-{n}.log").write_text("".join(ln for _, ln in lines))
        sb.up()
        shutil.rmtree(ckpt, ignore_errors=True)
    return {"detect": t_detect - t0, "teardown": t_down - t_detect, "decide": t_decide - t_down, "relaunch": t_user - t_decide,
            "first step": t_step - t_user, "total": t_step - t0, "world": world}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--rejoin-timeout", type=float, default=5.0)
    ap.add_argument("--spare", action="store_true", help="the 4th node is a spare that replaces node 2")
    ap.add_argument("--keep", action="store_true", help="leave the sandbox up")
    args = ap.parse_args()
    (REPO / "scratch").mkdir(exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-recovery-"))
    compileall.compile_dir(Path(corral_pkg.__file__).parent, quiet=1)  # time corral as installed
    sb = Sandbox(name="benchrec", prefix="br")
    sb.up(4, with_keys=True, slots=2)
    try:
        runs = []
        for n in range(args.repeat):
            r = once(sb, spare=args.spare, rejoin=args.rejoin_timeout, log_dir=log_dir, n=n)
            runs.append(r)
            print("  " + "  ".join(f"{k}={v:.1f}s" if k != "world" else f"world={v}" for k, v in r.items()))
    finally:
        if not args.keep:
            sb.down()
    how = "a spare replaces node 2" if args.spare else "node 3 left out (--min-nodes 3)"
    print(f"\nRecovery, 4 nodes x 2 ranks, {how}, --rejoin-timeout {args.rejoin_timeout:g} "
          f"(median of {args.repeat}; logs in {log_dir}):")
    for key in ("detect", "teardown", "decide", "relaunch", "first step", "total"):
        med = statistics.median(r[key] for r in runs)
        extra = f"  ({med - args.rejoin_timeout:.1f} s without the rejoin wait)" if key in ("decide", "total") else ""
        print(f"  {key:11s} {med:6.1f} s{extra}")
    print(f"  training resumed on {runs[-1]['world']} ranks")


if __name__ == "__main__":
    main()
