import os, time, sys
import torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 1000):
    print("step", i, "rank", r, flush=True)
    time.sleep(0.5)
dist.destroy_process_group()
