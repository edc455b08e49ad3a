#!/usr/bin/env python3
"""Time from a hang starting to corral naming the culprit, vs the default timeouts.

    .venv/bin/python bench/bench_hang.py                          # 4 ranks on this machine
    .venv/bin/python bench/bench_hang.py --hang-timeout 60 -n 8
    .venv/bin/python bench/bench_hang.py -c corral.toml           # a cluster (the sandbox: 4 x 2 ranks)

The workload is a training loop of all-reduces in which one rank (the last)
skips the all-reduce of one step and then waits in the final barrier: the
other ranks hang in their last all-reduce.  Every rank prints a timestamp
after each step, so the hang starts at the last timestamp printed.  corral
runs it with ``--hang-timeout``; the culprit is named when corral's output
first has the flight recorder's line for that rank.

Printed: the hang's start, when the culprit was named, the difference (the
silence corral waits for, ``--hang-timeout``, plus collecting every rank's
stack, flight recorder dump and node health), and the same hang left to
torch itself: a collective times out after the process group's timeout,
10 min for NCCL (``default_pg_nccl_timeout``) and 30 min for gloo
(``default_pg_timeout``), and the error names the waiting ranks' timeout,
not the rank that skipped (those two are torch's documented defaults, not
measured here: measuring them takes 10 and 30 minutes).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CORRAL = [sys.executable, "-m", "corral"]
NCCL_TIMEOUT_S = 600.0
GLOO_TIMEOUT_S = 1800.0

SCRIPT = """
import os, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
skip, steps = world - 1, {steps}
for step in range(steps):
    if not (rank == skip and step == steps - 5):
        dist.all_reduce(torch.ones(1000))
    print("step", step, "t=%.3f" % time.time(), flush=True)
dist.barrier()
"""

_T = re.compile(r"t=(\d+\.\d+)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-c", "--cluster", help="cluster file (default: this machine)")
    ap.add_argument("-n", "--nproc-per-node", type=int, default=4, help="ranks per node on this machine")
    ap.add_argument("--hang-timeout", type=float, default=30.0)
    ap.add_argument("--steps", type=int, default=45)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-hang-", dir=os.getcwd() if args.cluster else None) as tmp:
        work = Path(tmp)
        (work / "hang.py").write_text(SCRIPT.format(steps=args.steps))
        argv = CORRAL + ["run", "--hang-timeout", str(args.hang_timeout)]
        argv += ["-c", args.cluster] if args.cluster else ["-n", str(args.nproc_per_node)]
        proc = subprocess.Popen(argv + ["hang.py"], cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)
        last_step, named, culprit_line = None, None, None
        assert proc.stdout is not None
        for line in proc.stdout:
            m = _T.search(line)
            if m:
                last_step = max(last_step or 0.0, float(m.group(1)))
            if named is None and "flight recorder:" not in line and re.search(r"rank \d+ \(.*\) (entered|never)", line):
                named, culprit_line = time.time(), line.strip()
        code = proc.wait()
    if last_step is None or named is None:
        print(f"corral exited {code} without naming a culprit (hang start seen: {last_step is not None})")
        return 1
    took = named - last_step
    print(f"hang started      : last step printed at {time.strftime('%H:%M:%S', time.localtime(last_step))}")
    print(f"culprit named     : {culprit_line}")
    print(f"time to culprit   : {took:.1f} s with --hang-timeout {args.hang_timeout:g} "
          f"(collection: {took - args.hang_timeout:.1f} s)")
    print(f"torch alone       : NCCL watchdog {NCCL_TIMEOUT_S:.0f} s -> {NCCL_TIMEOUT_S / took:.0f}x later; "
          f"gloo timeout {GLOO_TIMEOUT_S:.0f} s -> {GLOO_TIMEOUT_S / took:.0f}x later; neither names the culprit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
