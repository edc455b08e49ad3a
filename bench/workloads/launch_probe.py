"""Benchmark workload: note when this rank reached user code, then a barrier.

Usage (any launcher): launch_probe.py OUT_DIR [--local_rank=N]
"""
import os
import sys
import time

_out = next(a for a in sys.argv[1:] if not a.startswith("--"))
_rank = os.environ.get("RANK", "x")
with open(os.path.join(_out, f"user-{_rank}"), "w") as f:
    f.write(repr(time.time()))

import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
