#!/usr/bin/env python3
"""corral diagnose vs ``grep -E`` with the same patterns, on a large realistic log.

    .venv/bin/python bench/bench_diagnose.py                 # generates ~200 MB in /var/tmp
    .venv/bin/python bench/bench_diagnose.py --size 2G       # the goal: >= 50 MB/s on 2 GB
    .venv/bin/python bench/bench_diagnose.py --log run.log   # a log you have

The generated log is what a multi-node run's combined output looks like: many
ranks' interleaved training lines under launcher prefixes (``[r3] ``,
``node1: ``, ``[node2/r5] ``, ``[rank3]:``), tqdm bars, periodic benign
warnings and NCCL INFO chatter, and one real failure at the very end (an NCCL
watchdog timeout and the traceback it causes), so the whole file must be read.

Two timings, one run:

- ``corral diagnose --json LOG`` (the whole command, start-up included);
- ``grep -E -c -f PATTERNS LOG``: every strong/weak/requires/excludes regex
  of the rules exported into one ERE file, the anchor (what a hand-rolled
  "grep the log for known errors" costs).  Python-only syntax is translated
  where ERE has an equivalent (``\\d``, ``\\s``, ``\\w``, ``(?:``, lazy
  quantifiers, named groups) and a pattern ERE cannot express (lookarounds,
  inline flags) is left out and counted.

Prints MB/s for both and the ratio; the generated log is deleted afterwards
unless --keep.  Peak memory (max RSS) of corral is printed too: it must stay
flat whatever the log size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORRAL = str(Path(sys.executable).with_name("corral"))

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

_WARNINGS = (
    "/usr/lib/python3/dist-packages/torch/utils/data/dataloader.py:557: UserWarning: This DataLoader "
    "will create 8 worker processes in total. Our suggested max number of worker in current system is 4",
    "UserWarning: TypedStorage is deprecated. It will be removed in the future and UntypedStorage will "
    "be the only storage class.",
    "NCCL INFO Channel 00/02 :    0   1   2   3   4   5   6   7",
    "NCCL INFO comm 0x55d5c8a0 rank 3 nranks 16 cudaDev 3 busId 4f000 - Init COMPLETE",
    "[W reducer.cpp:1346] Warning: find_unused_parameters=True was specified in DDP constructor, but "
    "did not find any unused parameters in the forward pass.",
    "FutureWarning: `torch.cuda.amp.autocast(args...)` is deprecated. Please use "
    "`torch.amp.autocast('cuda', args...)` instead.",
)

_FAILURE = """\
[rank5]:[E1127 16:02:11.339620 1287 ProcessGroupNCCL.cpp:616] [Rank 5] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=48213, OpType=ALLREDUCE, NumelIn=1048576, NumelOut=1048576, Timeout(ms)=600000) ran for 600021 milliseconds before timing out.
[rank5]:[E1127 16:02:11.342210 1287 ProcessGroupNCCL.cpp:1785] [PG 0 (default_pg) Rank 5] Exception (either an error before or during the watchdog timeout) thrown from the watchdog.
[rank5]: Traceback (most recent call last):
[rank5]:   File "/home/user/train.py", line 88, in <module>
[rank5]:     loss.backward()
[rank5]: torch.distributed.DistBackendError: [Rank 5] Watchdog caught collective operation timeout
"""


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?)i?B?", text.strip(), re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"--size {text!r}: give a size such as 200M or 2G")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def _line(rng: random.Random, step: int, ranks: int, nodes: int) -> str:
    rank = rng.randrange(ranks)
    node = rank * nodes // ranks + 1
    prefix = rng.choice((f"[r{rank}] ", f"node{node}: ", f"[node{node}/r{rank}] ",
                         f"node{node}: [rank{rank}]: "))
    kind = rng.random()
    if kind < 0.002:
        return prefix + rng.choice(_WARNINGS)
    if kind < 0.15:
        pct = step % 100
        return (prefix + f"Epoch 3:  {pct}%|{'#' * (pct // 10):<10}| {step % 5000}/5000 "
                f"[12:{step % 60:02d}<08:11,  {rng.uniform(4, 6):.2f}it/s, loss={rng.uniform(1, 3):.3f}]")
    if kind < 0.30:
        return prefix + (f"{{'loss': {rng.uniform(1, 3):.4f}, 'grad_norm': {rng.uniform(0.1, 2):.4f}, "
                         f"'learning_rate': 2e-05, 'epoch': {step / 10000:.2f}}}")
    return (prefix + f"step {step} | loss {rng.uniform(1, 3):.4f} | lr 3.0e-04 | "
            f"{rng.uniform(100, 140):.1f} samples/s | mem 41.2G")


def generate(path: Path, size: int, *, ranks: int = 64, nodes: int = 8, seed: int = 1) -> None:
    """Write a ``size``-byte realistic multi-rank log ending with one failure."""
    rng = random.Random(seed)
    written, step = 0, 0
    with open(path, "w", encoding="utf-8") as out:
        while written < size:
            block = []
            for _ in range(2000):
                step += 1
                block.append(_line(rng, step, ranks, nodes))
            text = "\n".join(block) + "\n"
            out.write(text)
            written += len(text)
        out.write(_FAILURE)


# ------------------------------------------------------------------ grep -E export

_PY_ONLY = re.compile(r"\(\?[=!<]|\(\?[aiLmsux]|\(\?>|\\[AZbB]")


def to_ere(rx: str) -> str | None:
    """A Python regex as POSIX ERE (GNU grep), or None where ERE has no equivalent."""
    if _PY_ONLY.search(rx):
        return None
    out = rx
    out = re.sub(r"\(\?P<\w+>", "(", out)
    out = out.replace("(?:", "(")
    out = re.sub(r"([*+?}])\?", r"\1", out)  # lazy -> greedy: same lines match
    for py, ere in ((r"\d", "[0-9]"), (r"\D", "[^0-9]"), (r"\s", "[[:space:]]"), (r"\S", "[^[:space:]]"),
                    (r"\w", "[[:alnum:]_]"), (r"\W", "[^[:alnum:]_]")):
        out = out.replace(py, ere)
    # classes such as [\d.] became [[0-9].]: flatten them
    out = re.sub(r"\[\[0-9\]", "[0-9", out)
    out = re.sub(r"\[\[\[:space:\]\]", "[[:space:]", out)
    out = re.sub(r"\[\[\[:alnum:\]_\]", "[[:alnum:]_", out)
    return out


def export_patterns(dest: Path) -> tuple[int, int]:
    """Write every rule regex that ERE can express to ``dest``: (written, left out)."""
    sys.path.insert(0, str(REPO / "src"))
    from corral.diagnose import load_rules

    written, skipped = [], 0
    for rule in load_rules():
        for rx in [p.regex.pattern for p in rule.patterns] + [r.pattern for r in (*rule.requires, *rule.excludes)]:
            ere = to_ere(rx)
            if ere is None or subprocess.run(["grep", "-E", "-q", "-e", ere, "/dev/null"],
                                             capture_output=True).returncode == 2:
                skipped += 1
                continue
            written.append(ere)
    dest.write_text("\n".join(written) + "\n", encoding="utf-8")
    return len(written), skipped


def timed(cmd: list[str]) -> tuple[float, float, float, subprocess.CompletedProcess]:
    """Wall seconds, CPU seconds (user + system, its children included), max RSS (MiB), result.

    CPU time is the number to compare on a shared machine: wall time also
    counts the time the command waited for a core.
    """
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LC_ALL": "C.UTF-8"})
    took = time.monotonic() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return took, cpu, after.ru_maxrss / 1024, proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", type=parse_size, default=parse_size("200M"),
                    help="size of the generated log (200M, 2G); default 200M")
    ap.add_argument("--log", type=Path, help="diagnose this log instead of generating one")
    ap.add_argument("--dir", type=Path, default=Path("/var/tmp"), help="where the log is generated")
    ap.add_argument("--keep", action="store_true", help="keep the generated log")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="corral-bench-diagnose-", dir=args.dir))
    try:
        log = args.log
        if log is None:
            log = work / "train.log"
            t0 = time.monotonic()
            generate(log, args.size)
            print(f"generated {log} in {time.monotonic() - t0:.0f} s")
        size = log.stat().st_size
        mb = size / 1e6
        pats = work / "patterns.ere"
        n, skipped = export_patterns(pats)
        print(f"log: {mb:.0f} MB; grep -E patterns: {n} exported, {skipped} not expressible in ERE")

        subprocess.run(["cat", str(log)], stdout=subprocess.DEVNULL, check=True)  # warm the page cache
        g_s, g_cpu, _, g = timed(["grep", "-E", "-c", "-f", str(pats), str(log)])
        if g.returncode not in (0, 1):
            raise SystemExit(f"grep failed: {g.stderr}")
        c_s, c_cpu, c_rss, c = timed([CORRAL, "diagnose", "--json", str(log)])
        if c.returncode not in (0, 1):
            raise SystemExit(f"corral diagnose failed ({c.returncode}): {c.stderr[-2000:]}")
        found = [d["rule_id"] for d in json.loads(c.stdout)["diagnoses"]]
        print(f"grep -E -c -f:    wall {g_s:7.2f} s {mb / g_s:7.1f} MB/s   cpu {g_cpu:7.2f} s "
              f"{mb / g_cpu:7.1f} MB/s  ({g.stdout.strip()} matching lines)")
        print(f"corral diagnose:  wall {c_s:7.2f} s {mb / c_s:7.1f} MB/s   cpu {c_cpu:7.2f} s "
              f"{mb / c_cpu:7.1f} MB/s  max RSS {c_rss:.0f} MiB  (found: {', '.join(found[:3]) or 'nothing'})")
        print(f"ratio corral/grep: wall {c_s / g_s:.2f}x, cpu {c_cpu / g_cpu:.2f}x "
              f"(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)")
        return 0
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
