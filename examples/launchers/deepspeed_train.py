"""The same training loop with DeepSpeed ZeRO stage 2, the way its users write it.

deepspeed.initialize() builds the engine from ds_config_zero2.json (next to
this file): it wraps the model, creates the optimizer and shards optimizer
state and gradients over the ranks (ZeRO-2); model_engine.backward() and
model_engine.step() replace loss.backward() and optimizer.step().

DeepSpeed's launcher passes --local_rank=N to each process; torchrun sets
LOCAL_RANK instead.  Both work.  On a machine without GPUs DeepSpeed picks its
CPU accelerator and the gloo backend by itself; the config asks for torch's
own Adam ("torch_adam": true), so no compiled DeepSpeed op (FusedAdam,
CPUAdam) is needed and DS_BUILD_OPS=0 installs work.

    # one machine, 2 processes (the `deepspeed` runner; --num_gpus also sets CPU processes):
    deepspeed --num_gpus 2 examples/launchers/deepspeed_train.py \
        --deepspeed --deepspeed_config examples/launchers/ds_config_zero2.json

    # what `deepspeed` runs on each node (world_info: base64 of {"host": [local ranks]}):
    python -m deepspeed.launcher.launch --world_info=$(echo -n '{"localhost": [0, 1]}' | base64) \
        --node_rank=0 --master_addr=127.0.0.1 --master_port=29500 \
        examples/launchers/deepspeed_train.py \
        --deepspeed --deepspeed_config examples/launchers/ds_config_zero2.json

    # or plain torchrun:
    torchrun --nproc-per-node 2 examples/launchers/deepspeed_train.py \
        --deepspeed --deepspeed_config examples/launchers/ds_config_zero2.json

    corral run --launcher deepspeed examples/launchers/deepspeed_train.py \
        --deepspeed --deepspeed_config examples/launchers/ds_config_zero2.json
"""

import argparse
import gc
import os

import deepspeed
import torch
from torch import nn
from torch.utils.data import TensorDataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=5)
    # Set by DeepSpeed's launcher (--local_rank=N); torchrun sets LOCAL_RANK instead.
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", "-1"))
    )
    parser = deepspeed.add_config_arguments(parser)  # --deepspeed, --deepspeed_config
    args = parser.parse_args()

    deepspeed.init_distributed()  # nccl with GPUs; gloo on the CPU accelerator

    # Synthetic regression: the same data on every rank; DeepSpeed's loader shards it.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.01 * torch.randn(4096, 1, generator=g)
    dataset = TensorDataset(x, y)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    model_engine, _, loader, _ = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=dataset
    )
    loss_fn = nn.MSELoss()
    rank = torch.distributed.get_rank()

    first = None
    for epoch in range(args.epochs):
        for xb, yb in loader:
            xb, yb = xb.to(model_engine.device), yb.to(model_engine.device)
            loss = loss_fn(model_engine(xb), yb)
            model_engine.backward(loss)
            model_engine.step()
            if first is None:
                first = average(loss)
        if rank == 0:
            print(f"epoch {epoch} | loss {loss.item():.4f}", flush=True)

    final = average(loss)
    if rank == 0:
        print(f"first loss {first:.4f} | final loss {final:.4f}", flush=True)
    # The engine holds the process group: release it first, so the group's threads
    # are joined now rather than torn down with the interpreter.
    del model_engine
    gc.collect()
    torch.distributed.destroy_process_group()


def average(loss: torch.Tensor) -> float:
    """The loss averaged over all ranks (SUM then divide: gloo has no AVG)."""
    t = loss.detach().clone()
    torch.distributed.all_reduce(t)
    return t.item() / torch.distributed.get_world_size()


if __name__ == "__main__":
    main()
