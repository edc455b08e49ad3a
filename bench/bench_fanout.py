#!/usr/bin/env python3
"""Fan-out: `corral exec hostname` vs `pdsh -R ssh` on a 32-node sandbox.

    sudo .venv/bin/python bench/bench_fanout.py               # 32 nodes, 5 rounds
    sudo .venv/bin/python bench/bench_fanout.py --nodes 16 --rounds 3

Each round measures, on the same nodes:

- pdsh:          ``pdsh -R ssh -f 64 -w <all> hostname`` (ssh settings via
                 PDSH_SSH_ARGS_APPEND=-F <sandbox>/ssh_config);
- corral cold:   ``corral exec -c <sandbox>/corral.toml -- hostname`` with no
                 ssh master connection alive (a fresh XDG_RUNTIME_DIR, where
                 corral keeps its control sockets);
- corral warm:   the same command again, riding on the multiplexed
                 connections the cold run left (ControlPersist).

The whole command is timed (corral's Python start-up included).  Goals:
cold <= 1.0x pdsh, warm <= 0.3x pdsh (medians).  Run as root.

``--floor`` also times, cold, ``bench/workloads/exec_floor.py``: corral's own
ssh argv for every host started at once by the least Python possible (no
click, asyncio or rich), with corral's remote cleanup wrapper and without
it: how far corral's start-up is from that floor, and what the wrapper costs.
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import corral as corral_pkg
from corral.sandbox import Sandbox

BIN = Path(sys.executable).parent


def timed(argv: list[str], env: dict[str, str], expect: int) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    took = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or len(lines) < expect:
        raise SystemExit(f"{argv[0]} failed (rc={proc.returncode}):\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="leave the sandbox up")
    ap.add_argument("--floor", action="store_true", help="also time exec_floor.py (see above)")
    args = ap.parse_args()
    # Time corral as installed: `pip install` byte-compiles it.  A checkout run
    # with PYTHONDONTWRITEBYTECODE=1 (containers, CI images) would otherwise
    # recompile every module changed since its .pyc on every timed start.
    compileall.compile_dir(Path(corral_pkg.__file__).parent, quiet=1)
    sb = Sandbox(name="fanout", prefix="fo")
    sb.up(args.nodes, with_keys=True)
    try:
        pdsh_env = dict(os.environ, PDSH_SSH_ARGS_APPEND=f"-F {sb.ssh_config}")
        pdsh = ["pdsh", "-R", "ssh", "-f", "64", "-w", ",".join(sb.nodes), "hostname"]
        corral = [str(BIN / "corral"), "exec", "-c", str(sb.cluster_file), "--", "hostname"]
        floor = Path(__file__).parent / "workloads" / "exec_floor.py"
        floors = {mode: [sys.executable, str(floor), str(sb.cluster_file), mode] for mode in ("wrap", "plain")}
        floor_times: dict[str, list[float]] = {"wrap": [], "plain": []}
        # Warm the page cache and sshd once, so round 1 is not special.
        timed(pdsh, pdsh_env, args.nodes)
        rows = []
        for i in range(args.rounds):
            t_pdsh = timed(pdsh, pdsh_env, args.nodes)
            # A fresh, short runtime directory: corral keeps its ssh control
            # sockets there, so no master connection exists yet (cold) ...
            runtime = Path(tempfile.mkdtemp(prefix="fo", dir="/tmp"))
            corral_env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))
            try:
                t_cold = timed(corral, corral_env, args.nodes)
                # ... and the second run rides on the masters the first one left.
                t_warm = timed(corral, corral_env, args.nodes)
            finally:
                _kill_masters(runtime)
                shutil.rmtree(runtime, ignore_errors=True)
            rows.append((t_pdsh, t_cold, t_warm))
            extra = ""
            if args.floor:
                for mode, argv in floors.items():
                    runtime = Path(tempfile.mkdtemp(prefix="fo", dir="/tmp"))
                    try:
                        floor_times[mode].append(timed(argv, dict(os.environ, XDG_RUNTIME_DIR=str(runtime)),
                                                       args.nodes))
                    finally:
                        _kill_masters(runtime)
                        shutil.rmtree(runtime, ignore_errors=True)
                    extra += f"  floor-{mode} {floor_times[mode][-1]:.2f}s"
            print(f"  round {i + 1}: pdsh {t_pdsh:.2f}s  corral cold {t_cold:.2f}s  corral warm {t_warm:.2f}s{extra}")
        p, c, w = (statistics.median(col) for col in zip(*rows))
        print(f"\nFan-out to {args.nodes} nodes, `hostname` (median of {args.rounds} rounds):")
        print(f"  pdsh -R ssh   {p:.2f}s")
        print(f"  corral cold   {c:.2f}s   ratio {c / p:.2f}  (goal <= 1.00: {'met' if c / p <= 1.0 else 'MISSED'})")
        print(f"  corral warm   {w:.2f}s   ratio {w / p:.2f}  (goal <= 0.30: {'met' if w / p <= 0.3 else 'MISSED'})")
        for mode, times in floor_times.items():
            if times:
                f = statistics.median(times)
                what = "with corral's wrapper" if mode == "wrap" else "without the wrapper"
                print(f"  floor, {what:21s} {f:.2f}s   ratio {f / p:.2f}  (cold)")
    finally:
        if not args.keep:
            sb.down()


def _kill_masters(runtime: Path) -> None:
    """Stop the ssh master processes whose sockets live under ``runtime``."""
    out = subprocess.run(["pgrep", "-f", f"{runtime}/corral/ssh"], capture_output=True, text=True).stdout
    for pid in out.split():
        try:
            os.kill(int(pid), 15)
        except OSError:
            pass
    time.sleep(0.2)


if __name__ == "__main__":
    main()
