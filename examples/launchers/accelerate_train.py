"""The same training loop with Hugging Face Accelerate, the way its users write it.

Accelerator() reads what `accelerate launch` put in the environment; prepare()
wraps the model in DDP, shards the DataLoader and moves everything to this
process's device; accelerator.backward() replaces loss.backward().

    # one machine, 2 processes on GPUs:
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision no --dynamo_backend no examples/launchers/accelerate_train.py

    # the same on a machine without GPUs: `--multi_gpu` is what starts N
    # processes (through torchrun), and ACCELERATE_USE_CPU=1 is what makes each
    # of them join one gloo group; without it every process trains alone.
    # (`--cpu --num_processes 2` starts ONE process unless given an mpirun hostfile.)
    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
        --mixed_precision no --dynamo_backend no examples/launchers/accelerate_train.py

    # two machines: --num_processes is the TOTAL over all machines
    accelerate launch --multi_gpu --num_machines 2 --num_processes 4 --machine_rank 0 \
        --main_process_ip 10.0.0.1 --main_process_port 29500 examples/launchers/accelerate_train.py

    corral run --launcher accelerate examples/launchers/accelerate_train.py
"""

import argparse
import os

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    args = parser.parse_args()

    accelerator = Accelerator()
    set_seed(0)
    # Guard against a silent trap: N processes started, each training alone (see the docstring).
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1 and accelerator.num_processes == 1:
        raise SystemExit(
            f"accelerate_train.py: error: {launched} processes were started but each runs alone\n"
            "HINT: on a machine without GPUs, set ACCELERATE_USE_CPU=1 for `accelerate launch`"
        )

    # Synthetic regression: the same data everywhere; prepare() shards the loader.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.01 * torch.randn(4096, 1, generator=g)
    loader = DataLoader(TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loss_fn = nn.MSELoss()

    accelerator.print(
        f"{accelerator.num_processes} process(es), {accelerator.distributed_type}, "
        f"device {accelerator.device}"
    )
    first = None
    for epoch in range(args.epochs):
        model.train()
        for xb, yb in loader:  # already on accelerator.device
            optimizer.zero_grad()
            loss = loss_fn(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            if first is None:
                first = accelerator.reduce(loss.detach(), reduction="mean").item()
        accelerator.print(f"epoch {epoch} | loss {loss.item():.4f}")

    final = accelerator.reduce(loss.detach(), reduction="mean").item()
    accelerator.print(f"first loss {first:.4f} | final loss {final:.4f}")
    # Drop the prepared (DDP-wrapped) objects before the process group goes: they hold
    # it, and its gloo threads would otherwise die with the interpreter (an abort).
    model, optimizer, loader = accelerator.free_memory(model, optimizer, loader)
    accelerator.end_training()  # also destroys the process group


if __name__ == "__main__":
    main()
