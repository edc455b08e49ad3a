"""Benchmark workload: train in steps, checkpoint every step, resume after a restart.

Usage: resume_loop.py STEPS (under ``corral run --checkpoint-dir DIR``)

Rank 0 prints, with this machine's clock: ``user <t>`` when an attempt's
first rank is in user code, ``step <n> <t>`` after each step (an all-reduce
across every rank), having written the step number to
``$CORRAL_CHECKPOINT_DIR/step``; a restart starts from ``$CORRAL_RESUME_DIR``.
"""
import os
import sys
import time

_t_user = time.time()
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

steps = int(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
if rank == 0:
    print("user", os.environ["CORRAL_ATTEMPT"], repr(_t_user), flush=True)
ckpt = os.path.join(os.environ["CORRAL_CHECKPOINT_DIR"], "step")
resume = os.environ.get("CORRAL_RESUME_DIR")
start = int(open(os.path.join(resume, "step")).read()) if resume else 0
for step in range(start, steps):
    t = torch.ones(1024)
    dist.all_reduce(t)
    if rank == 0:
        with open(ckpt + ".tmp", "w") as f:
            f.write(str(step + 1))
        os.replace(ckpt + ".tmp", ckpt)
        print("step", step + 1, os.environ["CORRAL_ATTEMPT"], dist.get_world_size(), repr(time.time()), flush=True)
    time.sleep(0.1)
dist.destroy_process_group()
