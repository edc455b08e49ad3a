"""corral doctor's smoke test: one checked all-reduce across every rank.

Run by torchrun (through `corral doctor`), never imported by corral.  Each
rank contributes rank+1; every rank must then hold world*(world+1)/2.  Rank 0
prints one line that the head reads:

    CORRAL_SMOKE {"backend": "gloo", "world_size": 8, "seconds": 0.4, "hosts": [...]}

Environment: CORRAL_SMOKE_BACKEND (gloo|nccl, default: nccl when CUDA is
available), CORRAL_SMOKE_TIMEOUT (seconds for init and the collective).
"""

import datetime
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    backend = os.environ.get("CORRAL_SMOKE_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    timeout = datetime.timedelta(seconds=float(os.environ.get("CORRAL_SMOKE_TIMEOUT", "60")))
    started = time.time()
    dist.init_process_group(backend, timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    value = torch.full((1 << 16,), float(rank + 1), device=device)
    dist.all_reduce(value)
    expected = world * (world + 1) / 2
    got = value.cpu()
    if not bool((got == expected).all()):
        print(f"all-reduce returned {got[0].item()} on rank {rank}, expected {expected}",
              file=sys.stderr, flush=True)
        return 1
    # Which host each rank ran on, so the head can tell ranks from nodes.
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    dist.barrier()
    if rank == 0:
        print("CORRAL_SMOKE " + json.dumps({
            "backend": backend, "world_size": world, "seconds": round(time.time() - started, 3),
            "hosts": hosts, "torch": torch.__version__,
        }), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
