"""corral bench's all-reduce timing, after nccl-tests' all_reduce_perf.

Run by torchrun (through `corral bench`), never imported by corral.  For each
size, `warmup` untimed all-reduces, then `iters` timed ones on float32
tensors; the time per operation is the slowest rank's (a collective ends
when its last rank does).  Rank 0 prints one line per size for the head:

    CORRAL_BENCH {"size": 1048576, "count": 262144, "type": "float", "seconds": 0.0021}

and the head computes algbw and busbw (corral.doctor.bench).  Arguments: sizes in
bytes, then --warmup N --iters N.  CORRAL_BENCH_BACKEND picks gloo or nccl.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("sizes", type=int, nargs="+")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    backend = os.environ.get("CORRAL_BENCH_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend)
    rank = dist.get_rank()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for size in args.sizes:
        count = max(1, size // 4)
        data = torch.zeros(count, dtype=torch.float32, device=device)
        for _ in range(args.warmup):
            dist.all_reduce(data)
        sync()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            dist.all_reduce(data)
        sync()
        per_op = torch.tensor([(time.perf_counter() - start) / args.iters], dtype=torch.float64,
                              device=device)
        dist.all_reduce(per_op, op=dist.ReduceOp.MAX)
        if rank == 0:
            print("CORRAL_BENCH " + json.dumps({
                "size": count * 4, "count": count, "type": "float", "redop": "sum",
                "seconds": float(per_op.item()), "backend": backend,
                "world_size": dist.get_world_size(),
            }), flush=True)
        del data
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
