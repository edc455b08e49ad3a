#!/usr/bin/env python3
"""Output at scale: every rank printing at once must not slow the ranks, nor bury the head's console.

    sudo .venv/bin/python bench/bench_flood.py                      # 32 nodes x 8 ranks
    sudo .venv/bin/python bench/bench_flood.py --nodes 8 --ranks 4 --seconds 10

On one sandbox (real sshd per node, every node on this machine's cores),
the same rank script runs twice for each launcher, in one run:

- **quiet**: every rank sleeps 50 ms per step, and prints one line each
  second (its tick: the wall-clock time it printed it);
- **flood**: the same, and every rank also prints ``--lines`` lines of 100
  characters per step, each flushed (a training loop logging every
  micro-batch, or a debug print left in).

Each rank measures how long its prints held it per step (its write calls:
what back-pressure from a slow reader would show as), and the bench
measures how late the ticks reached the head's console (the lag a user
watching the run would see).  The anchor is ``pdsh -R ssh`` starting the
same ranks on every node (``python flood.py &`` x ranks), whose output goes
through ssh pipes to pdsh, as with DeepSpeed's pdsh runner or a hand-made
``pdsh torchrun``.

corral runs ``--launcher command`` with the same shell loop, so both sides
start the same processes; its ranks' output goes through files that each
node's agent tails.  ``--base SRC`` runs corral a second time from another
checkout's ``src`` (``git worktree add /tmp/base BASE``; the nodes get that
agent too), for a before/after in one run.  Results go to docs/benchmarks.md
by hand.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from corral.sandbox import Sandbox

BIN = Path(sys.executable).parent
CORRAL = str(BIN / "corral")

RANK_SCRIPT = r'''
import json, os, sys, time
rank = os.environ["FLOOD_RANK"]
lines, seconds, start = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
text = "x" * 100
while time.time() < start:
    time.sleep(0.005)
held, step, next_tick = [], 0, start
while time.time() < start + seconds:
    t = time.perf_counter()
    for i in range(lines):
        sys.stdout.write(f"r{rank} s{step} {i} {text}\n")  # one write per line, as a logger does
        sys.stdout.flush()
    now = time.time()
    if now >= next_tick:
        sys.stdout.write(f"TICK {now:.3f}\n")
        sys.stdout.flush()
        next_tick += 1.0
    held.append(time.perf_counter() - t)
    step += 1
    time.sleep(0.05)
held.sort()
sys.stdout.write("RESULT " + json.dumps({"rank": rank, "steps": step, "p50": held[len(held) // 2],
                                        "p99": held[int(len(held) * 0.99)], "max": held[-1]}) + "\n")
sys.stdout.flush()
'''


def node_loop(python: str, work: Path, ranks: int, lines: int, seconds: float, start: float) -> str:
    """The shell command a node runs: ``ranks`` copies of the rank script, waited for."""
    return (f"cd {work} && for i in $(seq 0 {ranks - 1}); do FLOOD_RANK=$(hostname)-$i {python} -u flood.py "
            f"{lines} {seconds} {start} & done; wait")


def watch(argv: list[str], cwd: Path, seconds: float, env: dict | None = None) -> dict:
    """Run ``argv``, reading its stdout as it comes: the ticks' lag, the results, lines seen."""
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", env=env)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    lags, results, seen = [], [], 0
    t0 = time.monotonic()
    for line in proc.stdout:
        seen += 1
        m = re.search(r"TICK (\d+\.\d+)", line)
        if m:
            lags.append(time.time() - float(m.group(1)))
        else:
            m = re.search(r"RESULT (\{[^}]*\})", line)  # (a line may still share a pipe's write with another)
            if m:
                results.append(json.loads(m.group(1)))
    proc.wait()
    total = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{argv[:4]} failed (rc={proc.returncode}):\n{''.join(err)[-2000:]}")
    return {"lags": lags, "results": results, "lines": seen, "wall": total, "stderr": "".join(err)}


def summary(name: str, got: dict, expect: int) -> dict:
    res = got["results"]
    lags = sorted(got["lags"]) or [float("nan")]
    out = {
        "ranks_reported": len(res),
        "held_p50_ms": 1000 * statistics.median(r["p50"] for r in res) if res else float("nan"),
        "held_p99_ms": 1000 * statistics.median(r["p99"] for r in res) if res else float("nan"),
        "held_max_ms": 1000 * max(r["max"] for r in res) if res else float("nan"),
        "steps_median": statistics.median(r["steps"] for r in res) if res else 0,
        "tick_lag_median_s": statistics.median(lags),
        "tick_lag_max_s": lags[-1],
        "lines_on_console": got["lines"],
        "wall_s": got["wall"],
    }
    print(f"    {name}: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                    for k, v in out.items()) + ("" if len(res) == expect else
                                                                 f"  (expected {expect} results)"), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--ranks", type=int, default=8, help="ranks per node")
    ap.add_argument("--lines", type=int, default=20, help="lines per step per rank when flooding")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--start-after", type=float, default=20.0,
                    help="seconds between a command's start and the ranks' common start (covers the launch)")
    ap.add_argument("--keep", action="store_true", help="leave the sandbox up")
    ap.add_argument("--base", metavar="SRC", help="also run corral from this src directory (before/after)")
    ap.add_argument("--modes", default="quiet,flood", help="which of quiet,flood to run")
    args = ap.parse_args()
    if not shutil.which("pdsh"):
        raise SystemExit("pdsh is not installed (apt-get install pdsh): it is the anchor")
    work = Path(tempfile.mkdtemp(prefix="flood-", dir="/tmp"))
    (work / "flood.py").write_text(RANK_SCRIPT)
    sb = Sandbox(name="flood", prefix="fl")
    sb.up(args.nodes, with_keys=True, share=[str(work)])  # the same path on every node, as NFS would
    os.environ["PDSH_SSH_ARGS_APPEND"] = f"-F {sb.ssh_config}"
    hosts = ",".join(sb.nodes[:args.nodes])
    expect = args.nodes * args.ranks
    py = sys.executable
    table = {}
    try:
        print(f"{args.nodes} nodes x {args.ranks} ranks, {args.seconds:.0f} s; flood = {args.lines} lines "
              f"of 100 characters per rank per 50 ms step ({expect * args.lines * 20:,} lines/s in all)",
              flush=True)
        sides = ("pdsh", "base", "corral") if args.base else ("pdsh", "corral")
        modes = [m for m in (("quiet", 0), ("flood", args.lines)) if m[0] in args.modes.split(",")]
        for mode, lines in modes:
            for side in sides:
                start = time.time() + args.start_after
                loop = node_loop(py, work, args.ranks, lines, args.seconds, start)
                if side == "pdsh":
                    argv = ["pdsh", "-R", "ssh", "-f", str(args.nodes), "-w", hosts, loop]
                else:
                    argv = [CORRAL, "run", "-c", str(sb.cluster_file), "--ranks", "all", "--launcher", "command",
                            "sh", "-c", loop]
                env = dict(os.environ, PYTHONPATH=args.base) if side == "base" else None
                table[(mode, side)] = summary(f"{mode:5} {side:6}", watch(argv, work, args.seconds, env), expect)
        print("\n| | side | held p99 / max (ms) | tick lag max (s) | steps per rank (median) |")
        print("| --- | --- | --- | --- | --- |")
        for mode, _ in modes:
            for side in sides:
                t = table[(mode, side)]
                print(f"| {mode} | {side} | {t['held_p99_ms']:.2f} / {t['held_max_ms']:.1f} | "
                      f"{t['tick_lag_max_s']:.2f} | {t['steps_median']:g} |")
        shutil.rmtree(work, ignore_errors=True)
    finally:
        if not args.keep:
            sb.down()


if __name__ == "__main__":
    main()
