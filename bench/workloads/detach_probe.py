"""Benchmark workload: note when this rank reached user code, meet the others, stay a moment.

Usage: detach_probe.py OUT_DIR [SECONDS]  (a detached run returns while it stays)
"""
import os
import sys
import time

_out = sys.argv[1]
with open(os.path.join(_out, f"user-{os.environ.get('RANK', 'x')}"), "w") as f:
    f.write(repr(time.time()))

import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 3.0)
dist.barrier()
dist.destroy_process_group()
