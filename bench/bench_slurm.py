#!/usr/bin/env python3
"""Inside a Slurm allocation: corral run (srun transport) vs srun + torchrun.

    sudo .venv/bin/python bench/bench_slurm.py                 # 4 nodes x 2 ranks, one run each
    sudo .venv/bin/python bench/bench_slurm.py --repeat 3 --skip-failure

Same script, same 4-node Slurm sandbox (`corral sandbox up 4 --slurm`: real
slurmctld and one slurmd per node, no ssh keys), inside one allocation
(`salloc -N4`, this script runs itself inside it):

1. **Launch**: seconds from the command to every rank in user code (the
   first line of the script), and to the command's clean exit.
   - corral:  ``corral run -n 2 probe.py`` (one srun step per node, preloaded ranks)
   - anchor:  ``srun --ntasks-per-node=1 --overlap torchrun --nnodes 4
     --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint FIRST:PORT probe.py``,
     the pattern people write by hand in batch scripts.
   Goal: corral <= 1.0x the anchor's time to a clean exit.
2. **Node failure**: one node is stopped (every process on it killed, slurmd
   too) while every rank loops on all-reduce; seconds until the command
   exits, and whether the node is named.  The anchor is given 150 s.

Run as root (the sandbox needs it).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
PROBE = REPO / "bench" / "workloads" / "launch_probe.py"
LOOP = REPO / "bench" / "workloads" / "allreduce_loop.py"
NPROC = 2


def commands(script: Path, out: Path, port: int) -> dict[str, list[str]]:
    nodes = os.environ["SLURM_JOB_NODELIST"]
    first = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                           check=True).stdout.split()[0]
    n = len(subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True, text=True,
                           check=True).stdout.split())
    return {
        "corral": [str(BIN / "corral"), "run", "-n", str(NPROC), str(script), str(out)],
        "srun+torchrun": ["srun", f"--nodes={n}", "--ntasks-per-node=1", "--overlap", "--kill-on-bad-exit=1",
                          sys.executable, "-m", "torch.distributed.run", "--nnodes", str(n),
                          "--nproc-per-node", str(NPROC), "--rdzv-backend", "c10d",
                          "--rdzv-endpoint", f"{first}:{port}", "--rdzv-id", f"bench{port}",
                          str(script), str(out)],
    }


def user_code_times(out: Path) -> list[float]:
    return [float(p.read_text()) for p in out.glob("user-*") if p.read_text().strip()]


def launch_once(name: str, port: int, log_dir: Path, ranks: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"sl-{name.replace('+', '-')}-", dir=REPO / "scratch"))
    argv = commands(PROBE, out, port)[name]
    log = log_dir / f"{name}-{port}.log"
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.run(argv, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=600)
    t_exit = time.time() - t0
    got = user_code_times(out)
    shutil.rmtree(out, ignore_errors=True)
    return {"name": name, "ok": proc.returncode == 0 and len(got) == ranks, "rc": proc.returncode,
            "ranks": len(got), "user": (max(got) - t0) if got else None, "exit": t_exit, "log": str(log)}


def failure_once(name: str, port: int, log_dir: Path, cap: float, ranks: int, victim: str,
                 sandbox: str) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"sl-fail-{name.replace('+', '-')}-", dir=REPO / "scratch"))
    argv = commands(LOOP, out, port)[name]
    log = log_dir / f"failure-{name}-{port}.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.time() + 300
        while len(user_code_times(out)) < ranks:
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"{name}: ranks never all started (see {log})")
            time.sleep(0.2)
        time.sleep(2)  # every rank is inside the all-reduce loop
        subprocess.run([str(BIN / "corral"), "sandbox", "stop", "--name", sandbox, victim], check=True,
                       capture_output=True)
        t0 = time.time()
        try:
            proc.wait(timeout=cap)
            took: float | None = time.time() - t0
        except subprocess.TimeoutExpired:
            took = None
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    shutil.rmtree(out, ignore_errors=True)
    named = f"{victim} was lost" in log.read_text()
    return {"name": name, "took": took, "rc": proc.returncode, "named": named, "log": str(log)}


def inside(args: argparse.Namespace) -> None:
    """Runs inside `salloc`: every measurement shares the one allocation."""
    log_dir = Path(tempfile.mkdtemp(prefix="bench-slurm-"))
    ranks = args.nodes * NPROC
    port = 29711
    results: dict[str, list[dict]] = {"corral": [], "srun+torchrun": []}
    for _ in range(args.repeat):
        for name in results:
            port += 1
            r = launch_once(name, port, log_dir, ranks)
            results[name].append(r)
            print(f"  {name:14s} rc={r['rc']} ranks={r['ranks']} user={_f(r['user'])} exit={r['exit']:.1f}s",
                  flush=True)
    print(f"\nLaunch inside one allocation, {args.nodes} nodes x {NPROC} ranks "
          f"(median of {args.repeat}; logs in {log_dir}):")
    print(f"  {'launcher':14s} {'to user code':>13s} {'to clean exit':>14s}  ok")
    med = {}
    for name, rs in results.items():
        good = [r for r in rs if r["ok"]]
        med[name] = statistics.median([r["exit"] for r in good]) if good else None
        user = statistics.median([r["user"] for r in good]) if good else None
        print(f"  {name:14s} {_f(user):>13s} {_f(med[name]):>14s}  {len(good)}/{len(rs)}")
    if med["corral"] and med["srun+torchrun"]:
        ratio = med["corral"] / med["srun+torchrun"]
        print(f"  ratio corral / srun+torchrun = {ratio:.2f}  (goal <= 1.00: {'met' if ratio <= 1.0 else 'MISSED'})")
    print(flush=True)


def failures(args: argparse.Namespace, sandbox: str, victim: str) -> None:
    """One allocation per launcher: a stopped node ends (or hangs) the job."""
    for name in ("corral", "srun+torchrun"):
        cmd = ["salloc", f"-N{args.nodes}", sys.executable, __file__, "--inside-failure", name,
               "--sandbox", sandbox, "--victim", victim, "--nodes", str(args.nodes),
               "--failure-cap", str(args.failure_cap)]
        subprocess.run(cmd, env=os.environ, timeout=args.failure_cap + 300)
        subprocess.run([str(BIN / "corral"), "sandbox", "up", "--name", sandbox], check=True,
                       capture_output=True)  # boots the node and resumes it in Slurm


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--skip-failure", action="store_true")
    ap.add_argument("--failure-cap", type=float, default=150.0)
    ap.add_argument("--keep", action="store_true", help="leave the sandbox up")
    ap.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--inside-failure", help=argparse.SUPPRESS)
    ap.add_argument("--sandbox", help=argparse.SUPPRESS)
    ap.add_argument("--victim", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.inside:
        inside(args)
        return
    if args.inside_failure:
        log_dir = Path(tempfile.mkdtemp(prefix="bench-slurm-fail-"))
        r = failure_once(args.inside_failure, 29811 + len(args.inside_failure), log_dir, args.failure_cap,
                         args.nodes * NPROC, args.victim, args.sandbox)
        took = f"{r['took']:.1f}s" if r["took"] is not None else f"> {args.failure_cap:.0f}s (still hung)"
        print(f"  node failure, {r['name']:14s} exited after {took}, rc={r['rc']}, "
              f"lost node named: {r['named']} (log {r['log']})", flush=True)
        return
    from corral.sandbox import Sandbox

    (REPO / "scratch").mkdir(exist_ok=True)
    sb = Sandbox(name="benchsl", prefix="bs")
    sb.up(args.nodes, slurm=True)
    env = dict(os.environ, SLURM_CONF=str(sb.state_dir / "slurm" / "slurm.conf"),
               PATH=f"{BIN}:{os.environ['PATH']}")
    os.environ.update(env)
    try:
        subprocess.run(["salloc", f"-N{args.nodes}", sys.executable, __file__, "--inside",
                        "--nodes", str(args.nodes), "--repeat", str(args.repeat)], env=env, check=True)
        if not args.skip_failure:
            print(f"Node failure: {sb.nodes[2]} stopped during all-reduce (cap {args.failure_cap:.0f}s):")
            failures(args, sb.name, sb.nodes[2])
    finally:
        if not args.keep:
            sb.down()


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


if __name__ == "__main__":
    main()
