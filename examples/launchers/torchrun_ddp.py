"""Plain PyTorch DDP, the way torchrun's users write it.

torchrun starts one copy of this script per process and tells each one who it
is through the environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT); init_process_group("env://") reads them.

    torchrun --nproc-per-node 2 examples/launchers/torchrun_ddp.py
    # two nodes (run on each, with --node-rank 0 and 1):
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 \
        --master-addr 10.0.0.1 --master-port 29500 examples/launchers/torchrun_ddp.py
    corral run examples/launchers/torchrun_ddp.py
"""

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def average(loss: torch.Tensor) -> float:
    """The loss averaged over all ranks (SUM then divide: gloo has no AVG)."""
    t = loss.detach().clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.item() / dist.get_world_size()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    args = parser.parse_args()

    # LOCAL_RANK picks this process's GPU on its node; RANK is its place among all nodes.
    local_rank = int(os.environ["LOCAL_RANK"])
    rank = int(os.environ["RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method="env://")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", init_method="env://")

    # Synthetic regression: the same data on every rank; the sampler splits it.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.01 * torch.randn(4096, 1, generator=g)
    dataset = TensorDataset(x, y)
    sampler = DistributedSampler(dataset)  # num_replicas/rank come from the process group
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = nn.MSELoss()

    first = None
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # reshuffle differently every epoch
        for xb, yb in loader:
            xb, yb = xb.to(device), yb.to(device)
            loss = loss_fn(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if first is None:
                first = average(loss)
        if rank == 0:
            print(f"epoch {epoch} | loss {loss.item():.4f}", flush=True)

    final = average(loss)
    if rank == 0:
        print(f"first loss {first:.4f} | final loss {final:.4f}", flush=True)
    # Let go of the DDP model first: it holds the process group, whose gloo threads
    # would otherwise live until interpreter exit and can abort it there
    # ("terminate called without an active exception").
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
