#!/usr/bin/env python3
"""corral sync vs what people do by hand, on a rate-limited sandbox.

    sudo .venv/bin/python bench/bench_sync.py      # 4 nodes, 200mbit, 256 MiB, 5,000 files
    sudo .venv/bin/python bench/bench_sync.py --size-mib 64 --files 1000 --keep
    sudo .venv/bin/python bench/bench_sync.py --nodes 64 --size-mib 64 --files 100   # issue 23's row

1. One large file from node1 to the other three nodes, launched *from node1*
   (its uplink is the bottleneck a star hits):
   - anchor: one rsync over one link (node1 -> node2): the floor;
   - anchor: three rsyncs in parallel from node1 (what people do by hand);
   - corral sync (node-to-node chain after `corral ssh setup`).
   Goal: corral <= 1.3x the single-link time.
2. Re-sync of an unchanged 5,000-file project from the head to 4 nodes
   (wall time of the whole `corral sync` command).  Goal: under 2 s.

Prints each time and the ratios; run as root (the sandbox needs it).  One run
each: the sandbox's links are shaped, so the numbers are stable to ~5%.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from corral.sandbox import Sandbox

REPO = Path(__file__).resolve().parents[1]
CORRAL = str(Path(sys.executable).with_name("corral"))


def sh(sb: Sandbox, node: str, script: str, timeout: float = 900) -> float:
    """Run ``script`` in ``node``; its wall time in seconds (raises on failure)."""
    t0 = time.monotonic()
    proc = sb.exec(node, ["bash", "-c", script], timeout=timeout)
    took = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(
            f"{node}: `{script}` failed ({proc.returncode}):\n"
            f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        )
    return took


def clean(sb: Sandbox, nodes: list[str]) -> None:
    for n in nodes:
        sh(sb, n, "rm -rf /srv/bench/big.bin /srv/bench/.big.bin.* ; mkdir -p /srv/bench; sync")


def large_file(sb: Sandbox, size_mib: int) -> dict[str, float]:
    first, others = sb.nodes[0], sb.nodes[1:]
    bench = sb.node_dir(first) / "srv" / "bench"
    bench.mkdir(parents=True, exist_ok=True)
    with open(bench / "big.bin", "wb") as fh:
        fh.writelines(os.urandom(1 << 20) for _ in range(size_mib))
    hosts = "".join(
        f'\n[[hosts]]\nname = "{n}"\naddress = "{a}"\n'
        for n, a in sb.addresses.items()
        if n != first
    )
    (bench / "others.toml").write_text(
        f'[cluster]\npython = "{sys.executable}"\nuser = "root"\n{hosts}'
    )
    rsync = "rsync -a --whole-file /srv/bench/big.bin {n}:/srv/bench/"
    out: dict[str, float] = {}
    clean(sb, others)
    out["one link (rsync node1 -> node2)"] = sh(sb, first, rsync.format(n=others[0]))
    clean(sb, others)
    parallel = " & ".join(rsync.format(n=n) for n in others) + " & wait"
    out[f"parallel rsync node1 -> {len(others)} nodes"] = sh(sb, first, parallel)
    clean(sb, others)
    out[f"corral sync node1 -> {len(others)} nodes"] = sh(
        sb, first, f"cd /srv/bench && {CORRAL} sync big.bin -c others.toml"
    )
    check = sh(sb, first, f"cd /srv/bench && {CORRAL} sync big.bin -c others.toml --check")
    assert check >= 0
    return out


def many_files(sb: Sandbox, count: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        root = Path(tmp) / "proj"
        for i in range(count):
            p = root / f"pkg{i // 100:03d}" / f"mod{i % 100:03d}.py"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(f"# file {i}\nVALUE = {i}\n" + "x = 1\n" * (i % 50))
        subprocess.run(["git", "init", "-q", "."], cwd=root, check=True)
        subprocess.run(["git", "add", "-A"], cwd=root, check=True)
        cmd = [CORRAL, "sync", "-c", str(sb.cluster_file)]
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
        first = time.monotonic() - t0
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=root, check=True, capture_output=True)
        again = time.monotonic() - t0
    return {
        f"first sync of {count} files to {len(sb.nodes)} nodes": first,
        f"re-sync of the unchanged {count} files": again,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--rate", default="200mbit")
    ap.add_argument("--size-mib", type=int, default=256)
    ap.add_argument("--files", type=int, default=5000)
    ap.add_argument("--keep", action="store_true", help="leave the sandbox up")
    ap.add_argument("--mesh", action="store_true",
                    help="give the nodes node-to-node logins directly (corral.sandbox.mesh, as a shared "
                         "home does) instead of `corral ssh setup`, whose all-to-all check is N*N logins; "
                         "the default from 16 nodes on")
    args = ap.parse_args()
    sb = Sandbox(name="bench-sync", prefix="bsync")
    sb.up(args.nodes, with_keys=True, rate=args.rate)
    try:
        if args.mesh or args.nodes >= 16:
            from corral.sandbox.mesh import mesh

            mesh(sb)
        else:
            subprocess.run(
                [CORRAL, "ssh", "setup", "-c", str(sb.cluster_file)], check=True, capture_output=True
            )
        big = large_file(sb, args.size_mib)
        small = many_files(sb, args.files)
    finally:
        if not args.keep:
            sb.down()
    print(
        f"sandbox: {args.nodes} nodes, links {args.rate}; "
        f"{args.size_mib} MiB file launched from node1"
    )
    for name, took in {**big, **small}.items():
        print(f"  {name:<45} {took:7.2f} s")
    one, par, cor = big.values()
    print(f"corral / one link        = {cor / one:.2f}x   (goal <= 1.30x)")
    print(f"corral / parallel rsync  = {cor / par:.2f}x")
    resync = list(small.values())[1]
    print(f"unchanged re-sync        = {resync:.2f} s   (goal < 2 s)")


if __name__ == "__main__":
    main()
