#!/usr/bin/env python3
"""Launch and partition: corral vs DeepSpeed's pdsh runner vs pdsh + torchrun.

    sudo .venv/bin/python bench/bench_launch.py                # 4 nodes x 2 ranks, one run each
    sudo .venv/bin/python bench/bench_launch.py --repeat 3 --skip-partition

Same script, same 4-node sandbox (real sshd per node, gloo), launched from
the head:

1. **Launch**: seconds from the command to every rank in user code (the
   first line of the script), and to the command's clean exit.
   - corral:    ``corral run -c <sandbox>/corral.toml probe.py`` (preloaded
     ranks, the default), and the same with ``--fresh-ranks`` (every rank a
     new interpreter, as plain torchrun starts them)
   - DeepSpeed: ``deepspeed --hostfile <sandbox>/hostfile --launcher pdsh``
     (its pdsh runner, the way DeepSpeed users launch multi-node)
   - pdsh + torchrun: ``pdsh -R ssh -w <nodes> torchrun --rdzv-backend c10d ...``
   Goal: corral <= 0.6x DeepSpeed's time to a clean exit.
2. **Partition**: one node's link goes down while every rank loops on
   all-reduce; seconds until the launcher exits.  Goal: corral tears the job
   down and names the node within 15 s (DeepSpeed's runner is given 150 s).

The anchors get the sandbox's ssh settings through PDSH_SSH_ARGS_APPEND
(``-F <sandbox>/ssh_config``); DeepSpeed's own ``ssh`` pre-check is skipped
(``--no_ssh_check``) and its master address given, since those calls cannot
be pointed at another ssh_config.  Run as root (the sandbox needs it).
"""

from __future__ import annotations

import argparse
import compileall
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
BIN = Path(sys.executable).parent
PROBE = REPO / "bench" / "workloads" / "launch_probe.py"
LOOP = REPO / "bench" / "workloads" / "allreduce_loop.py"


def anchors_env(sb: Sandbox) -> dict[str, str]:
    env = dict(os.environ)
    env["PDSH_SSH_ARGS_APPEND"] = f"-F {sb.ssh_config}"
    env["PATH"] = f"{BIN}:{env['PATH']}"
    return env


def commands(sb: Sandbox, script: Path, out: Path, port: int) -> dict[str, list[str]]:
    first = sb.nodes[0]
    nodes = ",".join(sb.nodes)
    torchrun = (f"cd {REPO} && {sys.executable} -m torch.distributed.run --nnodes {len(sb.nodes)} "
                f"--nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint {first}:{port} "
                f"--rdzv-id bench{port} {script} {out}")
    return {
        "corral": [str(BIN / "corral"), "run", "-c", str(sb.cluster_file), str(script), str(out)],
        "corral-fresh": [str(BIN / "corral"), "run", "-c", str(sb.cluster_file), "--fresh-ranks",
                         str(script), str(out)],
        "deepspeed": [str(BIN / "deepspeed"), "--hostfile", str(sb.hostfile), "--launcher", "pdsh",
                      "--no_ssh_check", "--master_addr", sb.addresses[first], "--master_port", str(port),
                      str(script), str(out)],
        "pdsh+torchrun": ["pdsh", "-R", "ssh", "-f", "64", "-w", nodes, torchrun],
    }


def user_code_times(out: Path) -> list[float]:
    return [float(p.read_text()) for p in out.glob("user-*") if p.read_text().strip()]


def launch_once(sb: Sandbox, name: str, port: int, log_dir: Path) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"{name.replace('+', '-')}-", dir=REPO / "scratch"))
    argv = commands(sb, PROBE, out, port)[name]
    log = log_dir / f"{name}-{port}.log"
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.run(argv, cwd=REPO, env=anchors_env(sb), stdout=fh, stderr=subprocess.STDOUT,
                              timeout=600)
    t_exit = time.time() - t0
    ranks = user_code_times(out)
    shutil.rmtree(out, ignore_errors=True)
    return {"name": name, "ok": proc.returncode == 0 and len(ranks) == 2 * len(sb.nodes),
            "rc": proc.returncode, "ranks": len(ranks),
            "user": (max(ranks) - t0) if ranks else None, "exit": t_exit, "log": str(log)}


def partition_once(sb: Sandbox, name: str, port: int, log_dir: Path, cap: float) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"part-{name}-", dir=REPO / "scratch"))
    argv = commands(sb, LOOP, out, port)[name]
    log = log_dir / f"partition-{name}-{port}.log"
    victim = sb.nodes[2]
    with open(log, "w") as fh:
        proc = subprocess.Popen(argv, cwd=REPO, env=anchors_env(sb), stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
        deadline = time.time() + 300
        while len(user_code_times(out)) < 2 * len(sb.nodes):
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit(f"{name}: ranks never all started (see {log})")
            time.sleep(0.2)
        time.sleep(2)  # every rank is inside the all-reduce loop
        sb.partition(victim)
        t0 = time.time()
        try:
            proc.wait(timeout=cap)
            took: float | None = time.time() - t0
        except subprocess.TimeoutExpired:
            took = None
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    sb.heal(victim)
    _scrub(sb)
    shutil.rmtree(out, ignore_errors=True)
    named = f"{victim} was lost" in log.read_text()  # corral's wording; anchors name nothing
    return {"name": name, "took": took, "rc": proc.returncode, "named": named, "log": str(log)}


def _scrub(sb: Sandbox) -> None:
    """Remove what an anchor left behind on the nodes (bench hygiene only)."""
    for n in sb.nodes:
        sb.exec(n, ["sh", "-c", "pkill -KILL -f 'deepspeed.launcher|torch.distributed.run|bench/workloads' || true"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--skip-partition", action="store_true")
    ap.add_argument("--partition-cap", type=float, default=150.0)
    ap.add_argument("--keep", action="store_true", help="leave the sandbox up")
    args = ap.parse_args()
    (REPO / "scratch").mkdir(exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench-launch-"))
    # Time corral as installed: `pip install` byte-compiles it.  A checkout run
    # with PYTHONDONTWRITEBYTECODE=1 (containers, CI images) would otherwise
    # recompile every module changed since its .pyc on every timed start.
    compileall.compile_dir(Path(corral_pkg.__file__).parent, quiet=1)
    sb = Sandbox(name="bench", prefix="bn")
    sb.up(args.nodes, with_keys=True, slots=2)
    try:
        port = 29611
        results: dict[str, list[dict]] = {"corral": [], "corral-fresh": [], "deepspeed": [], "pdsh+torchrun": []}
        for _ in range(args.repeat):
            for name in results:
                port += 1
                r = launch_once(sb, name, port, log_dir)
                _scrub(sb)
                results[name].append(r)
                print(f"  {name:14s} rc={r['rc']} ranks={r['ranks']} user={_f(r['user'])} exit={r['exit']:.1f}s")
        print(f"\nLaunch, {args.nodes} nodes x 2 ranks (median of {args.repeat}; logs in {log_dir}):")
        print(f"  {'launcher':14s} {'to user code':>13s} {'to clean exit':>14s}  ok")
        med = {}
        for name, rs in results.items():
            good = [r for r in rs if r["ok"]]
            med[name] = statistics.median([r["exit"] for r in good]) if good else None
            user = statistics.median([r["user"] for r in good]) if good else None
            print(f"  {name:14s} {_f(user):>13s} {_f(med[name]):>14s}  {len(good)}/{len(rs)}")
        if med["corral"] and med["deepspeed"]:
            ratio = med["corral"] / med["deepspeed"]
            print(f"  ratio corral / deepspeed = {ratio:.2f}  (goal <= 0.60: {'met' if ratio <= 0.6 else 'MISSED'})")
        if med["corral-fresh"] and med["deepspeed"]:
            print(f"  ratio corral --fresh-ranks / deepspeed = {med['corral-fresh'] / med['deepspeed']:.2f}")
        if not args.skip_partition:
            print(f"\nPartition of {sb.nodes[2]} during all-reduce (cap {args.partition_cap:.0f}s):")
            for name in ("corral", "deepspeed"):
                port += 1
                r = partition_once(sb, name, port, log_dir, args.partition_cap)
                took = f"{r['took']:.1f}s" if r["took"] is not None else f"> {args.partition_cap:.0f}s (still hung)"
                print(f"  {name:14s} exited after {took}, rc={r['rc']}, lost node named: {r['named']}")
    finally:
        if not args.keep:
            sb.down()


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


if __name__ == "__main__":
    main()
