#!/usr/bin/env python3
"""Telemetry overhead: a training loop's steps/s with the node's sampler on vs off.

    .venv/bin/python bench/bench_telemetry.py                  # 8 rounds of 2 x 5 s
    .venv/bin/python bench/bench_telemetry.py --rounds 12 --phase 10

One training loop (a small MLP on the CPU with torch, forward + backward +
SGD step; a pure-Python loop where torch is missing) runs for the whole
benchmark as a "rank" process.  The agent's real sampler
(``corral.agent.telemetry.Telemetry``: its /proc reads, network counters,
and an nvidia-smi query loop where there is one) is switched on and off in
alternating phases of the *same run*, in an order that alternates too
(on-off, off-on, ...), so drifts of a shared machine fall on both sides.
It prints steps/s per phase, the ratio of the medians (goal: >= 0.99x),
and the sampler's own CPU time per sample.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from corral.agent.telemetry import Telemetry  # noqa: E402

LOOP = r"""
import sys, time
path = sys.argv[1]
try:
    import torch
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256)
    def step():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
except ImportError:
    def step():
        sum(i * i for i in range(20000))
n = 0
with open(path, "w") as out:
    while True:
        step()
        n += 1
        if n % 20 == 0:
            out.write("%d %.6f\n" % (n, time.monotonic()))
            out.flush()
"""


class Quiet:
    """The agent's channel, kept in memory (the sampler's events are counted)."""

    broken = False

    def __init__(self) -> None:
        self.sent = 0

    def send(self, **event) -> None:
        self.sent += 1


def steps_between(path: Path, t0: float, t1: float) -> float:
    """Steps per second of the loop between two monotonic times (its own log)."""
    marks = []
    for line in path.read_text().splitlines():
        try:
            n, t = line.split()
            marks.append((int(n), float(t)))
        except ValueError:
            continue
    inside = [m for m in marks if t0 <= m[1] <= t1]
    if len(inside) < 2:
        return 0.0
    (n0, a), (n1, b) = inside[0], inside[-1]
    return (n1 - n0) / (b - a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--phase", type=float, default=5.0, help="seconds per phase")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "steps"
        loop = subprocess.Popen([sys.executable, "-c", LOOP, str(log)])
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and (not log.exists() or len(log.read_text().splitlines()) < 5):
                time.sleep(0.5)  # imports (torch) and warm-up
            time.sleep(1.0)
            on, off, costs = [], [], []
            for i in range(args.rounds):
                for enabled in ((True, False) if i % 2 == 0 else (False, True)):
                    tm = None
                    if enabled:
                        tm = Telemetry(Quiet())
                        tm.pids = lambda: {0: loop.pid}
                        tm.sample()
                    t0 = time.monotonic()
                    cpu0 = time.process_time()
                    samples = 0
                    while time.monotonic() - t0 < args.phase:
                        time.sleep(1.0)
                        if tm is not None:
                            tm.sample()
                            samples += 1
                    t1 = time.monotonic()
                    if tm is not None:
                        costs.append((time.process_time() - cpu0) / max(samples, 1))
                        tm.stop()
                    rate = steps_between(log, t0, t1)
                    (on if enabled else off).append(rate)
                    print(f"round {i + 1}: telemetry {'on ' if enabled else 'off'}  {rate:8.1f} steps/s", flush=True)
        finally:
            loop.kill()
            loop.wait()
    ratio = statistics.median(on) / statistics.median(off)
    print(f"\nsteps/s, median: on {statistics.median(on):.1f}, off {statistics.median(off):.1f}: "
          f"{ratio:.3f}x (goal >= 0.99x)")
    print(f"sampler CPU per sample (1 a second): {statistics.median(costs) * 1000:.2f} ms "
          f"= {statistics.median(costs) * 100:.2f}% of one core; cpus here: {os.cpu_count()}")


if __name__ == "__main__":
    main()
