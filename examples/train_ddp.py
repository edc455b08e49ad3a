"""
A small model trained with DistributedDataParallel, written to be read top to
bottom.  It is the script `make demo` runs, and a template for your own: the
only distributed pieces are the ones every DDP script needs (process group,
DistributedSampler + set_epoch, DDP wrapper, rank-0-only output and
checkpoints), and nothing in it knows about corral.

The task: a fixed random "teacher" network labels random points in 8
dimensions with one of 8 classes; an MLP "student" learns to copy it.  The
data is generated from the seed on every rank (no downloads), and the loss
falls from ~2.08 (ln 8, a uniform guess) within seconds on a laptop CPU.

Run it:

    # one process, no launcher (CPU, or the first GPU):
    python examples/train_ddp.py

    # one node, 2 processes (or one per GPU: --nproc-per-node gpu):
    torchrun --nproc-per-node 2 examples/train_ddp.py

    # corral, on this machine (2 processes on CPU, one per GPU otherwise):
    corral run examples/train_ddp.py

    # corral, on every host of a hostfile (`host slots=N` per line):
    corral run -c hostfile examples/train_ddp.py

    # save a checkpoint after every epoch; if the run stops, the same command
    # with --resume continues it (same --epochs: the lr schedule spans them):
    torchrun --nproc-per-node 2 examples/train_ddp.py --ckpt out/ckpt.pt
    torchrun --nproc-per-node 2 examples/train_ddp.py --ckpt out/ckpt.pt --resume

Launcher contract: with no launcher it runs as one process.  Under torchrun
(or anything that sets the same variables: corral, Slurm + a wrapper) it reads
RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT.  Each process uses
cuda:LOCAL_RANK with NCCL when CUDA is available, else the CPU with gloo.

Checkpoints on many nodes: only global rank 0 writes the checkpoint, on its
own node.  On --resume, rank 0 reads it and *broadcasts* it to every other
rank, so the other nodes need no copy of the file and no shared filesystem:
rank 0 must just run on the same node (and path) as before, which corral and
torchrun do when the host list is unchanged.  That suits a small model; for a
big one, put the checkpoint on shared storage and let every rank read it.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from typing import NoReturn

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

try:  # The progress bar is optional: without tqdm the step lines are enough.
    from tqdm import tqdm
except ImportError:  # pragma: no cover - depends on the environment
    tqdm = None

# -----------------------------------------------------------------------------
# settings: defaults with a comment each; every one is also a command-line flag

parser = argparse.ArgumentParser(description="Train a small MLP with DDP (CPU/gloo or GPU/NCCL).")
add = parser.add_argument
add("--epochs", type=int, default=6, help="passes over the training set")
add("--batch-size", type=int, default=128,
    help="GLOBAL batch; each rank gets it // WORLD_SIZE (a remainder is dropped, with a note)")
add("--lr", type=float, default=3e-3, help="peak AdamW learning rate (cosine decay to lr/10)")
add("--samples", type=int, default=16384, help="training examples (and 1/8 more for validation)")
add("--hidden", type=int, default=128, help="width of the student's two hidden layers")
add("--seed", type=int, default=1337, help="seeds the data and the initial weights")
add("--log-every", type=int, default=20, help="print a step line every N optimizer steps")
add("--ckpt", default="", help="checkpoint written by rank 0 after every epoch ('' = none)")
add("--resume", action="store_true", help="continue from --ckpt: weights, optimizer, epoch, step")
add("--no-progress", action="store_true", help="no tqdm bar on rank 0 (step lines only)")
args = parser.parse_args()

IN_DIM, N_CLASSES = 8, 8  # the teacher's input size and number of labels


def fail(message: str, hint: str) -> NoReturn:
    """Stop with a message a person can act on, and a non-zero exit code."""
    print(f"train_ddp.py: error: {message}\nHINT: {hint}", file=sys.stderr, flush=True)
    sys.exit(2)


# -----------------------------------------------------------------------------
# distributed setup: one process per device; RANK in the environment means a launcher started us

ddp = "RANK" in os.environ or "WORLD_SIZE" in os.environ
if ddp:
    # Check the whole contract up front: a missing MASTER_ADDR would otherwise surface as
    # a cryptic "environment variable MASTER_ADDR expected, but not set" inside torch.
    contract = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    missing = [k for k in contract if k not in os.environ]
    if missing:
        present = [k for k in contract if k in os.environ]
        fail(
            f"missing {', '.join(missing)} (found {', '.join(present)}): "
            "a half-configured distributed launch",
            "start it with a launcher that sets all of them, e.g. `torchrun --nproc-per-node 2 "
            "examples/train_ddp.py` or `corral run examples/train_ddp.py`; "
            "or unset RANK and WORLD_SIZE to run a single process",
        )
    rank = int(os.environ["RANK"])  # this process among all processes on all nodes
    world_size = int(os.environ["WORLD_SIZE"])  # processes on all nodes
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))  # this process on this node: picks the GPU
else:
    rank, world_size, local_rank = 0, 1, 0

if torch.cuda.is_available():
    if local_rank >= torch.cuda.device_count():
        fail(
            f"LOCAL_RANK {local_rank} but this node has {torch.cuda.device_count()} GPU(s)",
            "start at most one process per GPU, e.g. `torchrun --nproc-per-node gpu ...`",
        )
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)  # before init: NCCL binds each rank to its own GPU
    backend = "nccl"
else:
    device = torch.device("cpu")
    backend = "gloo"
if ddp:
    dist.init_process_group(backend=backend)  # env:// rendezvous at MASTER_ADDR:MASTER_PORT
master = rank == 0  # only global rank 0 prints, shows the bar and writes checkpoints
bar = None  # rank 0's tqdm progress bar, opened with the training loop


def print0(*parts: object) -> None:
    """print on global rank 0 only (through tqdm when its bar is on screen)."""
    if not master:
        return
    line = " ".join(str(p) for p in parts)
    if bar is not None:
        bar.write(line)  # keeps the bar at the bottom instead of breaking it
    else:
        print(line, flush=True)


# Each rank's share of the global batch; DDP averages gradients over ranks.  When
# --batch-size does not split evenly (128 over 6 processes), each rank takes the
# whole part (21) and the remainder is dropped: the script runs on any world size.
local_batch = max(1, args.batch_size // world_size)
global_batch = local_batch * world_size  # what one optimizer step actually sees
if global_batch != args.batch_size:
    print0(
        f"note: --batch-size {args.batch_size} does not split evenly over {world_size} processes: "
        f"{local_batch} per process, a global batch of {global_batch} "
        f"(a multiple of {world_size} keeps it exact)"
    )

# -----------------------------------------------------------------------------
# data: generated from the seed, identical on every rank; the sampler gives each rank its own slice


def make_data(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs labelled by a fixed random two-layer teacher network."""
    g = torch.Generator().manual_seed(seed)
    w1, w2 = torch.randn(IN_DIM, 64, generator=g), torch.randn(64, N_CLASSES, generator=g)
    x = torch.randn(n, IN_DIM, generator=g)
    y = (torch.tanh(x @ w1 / IN_DIM**0.5) @ w2).argmax(dim=1)  # scaled: a smooth, learnable rule
    return x, y


x_all, y_all = make_data(args.samples + args.samples // 8, args.seed)
train_set = TensorDataset(x_all[: args.samples], y_all[: args.samples])
x_val, y_val = x_all[args.samples :].to(device), y_all[args.samples :].to(device)
# num_replicas/rank given explicitly so the same code also runs without a process group.
sampler = DistributedSampler(
    train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed
)
# drop_last: every rank takes the same number of steps; none waits for a gradient that never comes.
loader = DataLoader(train_set, batch_size=local_batch, sampler=sampler, drop_last=True)
steps_per_epoch = len(loader)
if steps_per_epoch == 0:
    fail(
        f"--samples {args.samples} gives no full batch of {local_batch} per rank",
        "raise --samples or lower --batch-size",
    )

# -----------------------------------------------------------------------------
# model and optimizer

torch.manual_seed(args.seed)  # same initial weights everywhere (DDP also broadcasts rank 0's)
model = nn.Sequential(
    nn.Linear(IN_DIM, args.hidden),
    nn.GELU(),
    nn.Linear(args.hidden, args.hidden),
    nn.GELU(),
    nn.Linear(args.hidden, N_CLASSES),
).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)

# -----------------------------------------------------------------------------
# resume: rank 0 reads the checkpoint and broadcasts it (see the docstring for why)

start_epoch, step = 0, 0
if args.resume:
    if not args.ckpt:
        fail("--resume needs --ckpt PATH", "pass the --ckpt path of the run to continue")
    # Rank 0 decides for everyone: either a checkpoint or an error message, never a hang.
    box: list[object] = [None]
    if master:
        if os.path.exists(args.ckpt):
            box[0] = torch.load(args.ckpt, map_location="cpu", weights_only=True)
        else:
            box[0] = f"no checkpoint at {args.ckpt} (on the node of rank 0)"
    if ddp:
        dist.broadcast_object_list(box, src=0)
    ckpt = box[0]
    if isinstance(ckpt, str):
        fail(ckpt, "drop --resume to start from scratch, or point --ckpt at an existing checkpoint")
    assert isinstance(ckpt, dict)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    start_epoch, step = int(ckpt["epoch"]), int(ckpt["step"])
    if master:
        print(
            f"resumed from {args.ckpt} at epoch {start_epoch}, step {step} "
            f"(last loss {ckpt['loss']:.4f})",
            flush=True,
        )

if ddp:
    # CPU: no device_ids.  GPU: this rank's device only.
    model = DDP(model, device_ids=[local_rank] if device.type == "cuda" else None)
raw_model = model.module if ddp else model  # what we save: no "module." prefix in the keys


def save_checkpoint(epoch: int, loss: float) -> None:
    """Rank 0 writes atomically (tmp + rename), so a crash never leaves half a file."""
    if master and args.ckpt:
        os.makedirs(os.path.dirname(os.path.abspath(args.ckpt)), exist_ok=True)
        state = {
            "model": raw_model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "epoch": epoch,
            "step": step,
            "loss": loss,
            "args": vars(args),
        }
        tmp = f"{args.ckpt}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, args.ckpt)
    if ddp and args.ckpt:
        dist.barrier()  # nobody runs ahead (or exits) before the checkpoint is complete


def mean_over_ranks(value: float) -> float:
    """The loss averaged over all ranks, so rank 0 prints the loss of the whole batch."""
    if not ddp:
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item() / world_size


@torch.no_grad()
def evaluate() -> tuple[float, float]:
    """Validation loss and accuracy; every rank holds the full (small) validation set."""
    raw_model.eval()
    logits = raw_model(x_val)
    raw_model.train()
    return F.cross_entropy(logits, y_val).item(), (logits.argmax(1) == y_val).float().mean().item()


# -----------------------------------------------------------------------------
# training loop

total_steps = args.epochs * steps_per_epoch
warmup_steps = min(20, total_steps // 10)  # a short ramp: Adam's first steps are noisy


def get_lr(it: int) -> float:
    """Linear warmup, then cosine decay to lr/10.  A pure function of the step, so a resumed
    run continues the schedule exactly, with no scheduler state in the checkpoint."""
    if it < warmup_steps:
        return args.lr * (it + 1) / warmup_steps
    progress = (it - warmup_steps) / max(1, total_steps - warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


if master and tqdm is not None and not args.no_progress and step < total_steps:
    bar = tqdm(total=total_steps, initial=step, unit="step", dynamic_ncols=True, leave=False)

print0(
    f"training on {world_size} process(es) ({backend}, {device.type}) | "
    f"global batch {global_batch} = {world_size} x {local_batch} | "
    f"{steps_per_epoch} steps/epoch | epochs {start_epoch}..{args.epochs}"
)
first_loss = last_loss = math.nan
window: list[
    torch.Tensor
] = []  # losses since the last step line; .item() only when printing (a GPU sync)
t0 = time.perf_counter()
for epoch in range(start_epoch, args.epochs):
    sampler.set_epoch(epoch)  # a different shuffle each epoch, the same on every rank
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        lr = get_lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces (averages) the gradients here
        optimizer.step()
        step += 1
        window.append(loss.detach())
        if bar is not None:
            bar.update(1)
        # Print the first step (to see where it starts), every --log-every steps and the last one.
        if math.isnan(first_loss) or step % args.log_every == 0 or step == total_steps:
            last_loss = mean_over_ranks(
                torch.stack(window).mean().item()
            )  # a collective: all ranks call it
            if math.isnan(first_loss):
                first_loss = last_loss
            dt_ms = (time.perf_counter() - t0) * 1000 / len(window)
            print0(
                f"step {step:5d} | epoch {epoch} | loss {last_loss:.4f} | lr {lr:.2e} | "
                f"{dt_ms:.1f} ms/step"
            )
            window.clear()
            t0 = time.perf_counter()
    val_loss, val_acc = evaluate()
    print0(f"epoch {epoch} done | val loss {val_loss:.4f} | val acc {val_acc * 100:.1f}%")
    save_checkpoint(epoch + 1, last_loss)

# -----------------------------------------------------------------------------
# shut down cleanly: close the bar, leave the process group, exit 0

if bar is not None:
    bar.close()
if step >= total_steps and math.isnan(first_loss):
    print0(
        f"nothing to do: the checkpoint already has {start_epoch} epoch(s); "
        "raise --epochs to train more"
    )
else:
    print0(f"done | step {step} | first loss {first_loss:.4f} | final loss {last_loss:.4f}")
if ddp:
    # The DDP wrapper holds the process group: release it first, so the group's gloo
    # threads are joined now, not torn down with the interpreter (which can abort with
    # "terminate called without an active exception").
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
