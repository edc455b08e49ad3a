"""Benchmark workload: every rank loops on a small all-reduce (for partition tests).

Usage (any launcher): allreduce_loop.py OUT_DIR [--local_rank=N]
"""
import os
import sys
import time

import torch
import torch.distributed as dist

_out = next(a for a in sys.argv[1:] if not a.startswith("--"))
dist.init_process_group("gloo")
with open(os.path.join(_out, f"user-{dist.get_rank()}"), "w") as f:
    f.write(repr(time.time()))
for _ in range(1_000_000):
    t = torch.ones(1024)
    dist.all_reduce(t)
    time.sleep(0.05)
