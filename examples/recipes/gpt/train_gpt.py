"""GPT-style language model pre-training with plain PyTorch DDP: one file, read top to bottom.

The same script runs on one CPU, one GPU, a node of 8 GPUs or many nodes,
unchanged; the launcher decides (torchrun, `corral run`, or nothing):

    python prepare.py --out data                          # a tiny tokenised data set (no download)
    python train_gpt.py --data data --out ckpt            # one process
    torchrun --nproc-per-node 8 train_gpt.py --data data --out ckpt
    corral run -c hostfile train_gpt.py --data data --out /shared/ckpt

What it does right, each a trap that costs a day on a cluster:

- the global batch is fixed (``--batch-size`` sequences per rank x
  ``--grad-accum`` x world size) and printed, so a run on 2 nodes and one on
  4 are comparable; gradients are all-reduced once per optimizer step
  (``no_sync`` on the other micro-steps);
- checkpoints are written by global rank 0 only, from the unwrapped model
  (never ``model.module`` vs ``model`` confusion, never a compiled
  wrapper's ``_orig_mod.`` keys), atomically (temporary name, fsync, rename,
  fsync of the directory), so a node lost in the middle of a save leaves the
  previous checkpoint intact;
- resume is exact: model, optimizer, step (the learning rate is a pure
  function of the step), the data position (batches are drawn from a
  generator seeded by seed, rank and step) and every rank's RNG state
  (gathered to rank 0 at save, handed back to each rank at resume); bit for
  bit on the same world size and hardware, and on CPUs the same number of
  threads per rank (``OMP_NUM_THREADS``; a different count is said at resume);
- rank 0 reads the checkpoint and broadcasts it: nodes with local disks only
  work, as long as the first node is the same one (it is, under a launcher
  that keeps the host order: corral, torchrun with a fixed rendezvous host);
- on GPUs: bf16 autocast, ``torch.compile``, fused AdamW, SDPA (flash)
  attention, TF32 matmuls; tokens/s and model FLOPs utilisation (MFU) are
  printed; TensorBoard logs from rank 0 when tensorboard is installed.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

# ----------------------------------------------------------------------------
# settings


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="directory with train.bin and val.bin (uint16 tokens; prepare.py)")
    p.add_argument("--out", required=True, help="checkpoint directory (shared, or local to the first node)")
    p.add_argument("--resume", action="store_true", help="continue from --out/ckpt.pt")
    # model (GPT-2 small: --n-layer 12 --n-head 12 --n-embd 768 --block-size 1024)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128, help="context length (tokens)")
    p.add_argument("--dropout", type=float, default=0.0)
    # optimisation
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step")
    p.add_argument("--max-steps", type=int, default=200, help="optimizer steps (the cosine schedule spans them)")
    p.add_argument("--stop-at", type=int, default=None,
                   help="stop after this step (as if the job were stopped); --resume continues")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=20, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    # evaluation, logging, checkpoints
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--eval-batches", type=int, default=10)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--tensorboard", default=None, help="TensorBoard log directory (rank 0)")
    # speed
    p.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                   help="auto: bf16 autocast on GPUs that support it, fp32 on CPU")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto", help="auto: on GPUs only")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the accelerator's dense bf16 peak for MFU (known GPUs are recognised)")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args(argv)


# ----------------------------------------------------------------------------
# distributed setup: no launcher means one process


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup() -> Dist:
    if "RANK" not in os.environ:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return Dist(0, 0, 1, device)
    missing = [v for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        sys.exit(f"train_gpt.py: launched with RANK but without {', '.join(missing)}\n"
                 "HINT: start it with torchrun or corral run, or without any of these variables")
    rank, local_rank, world = (int(os.environ[v]) for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return Dist(rank, local_rank, world, device)


def say(d: Dist, *args) -> None:
    if d.main:
        print(*args, flush=True)


# ----------------------------------------------------------------------------
# data: a memory-mapped token file; batches drawn at positions that depend
# only on (seed, rank, step, micro-step), so resuming at step s draws exactly
# what an uninterrupted run would have drawn


class Tokens:
    def __init__(self, path: str, block: int):
        if not os.path.exists(path):
            sys.exit(f"train_gpt.py: {path} not found\nHINT: python prepare.py --out {os.path.dirname(path)}")
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block = block
        if len(self.data) <= block + 1:
            sys.exit(f"train_gpt.py: {path} has {len(self.data)} tokens, fewer than --block-size {block} + 2")

    def batch(self, n: int, seed: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(len(self.data) - self.block - 1, (n,), generator=g).tolist()
        x = torch.from_numpy(np.stack([self.data[s:s + self.block] for s in starts]).astype(np.int64))
        y = torch.from_numpy(np.stack([self.data[s + 1:s + 1 + self.block] for s in starts]).astype(np.int64))
        if device.type == "cuda":
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y


def batch_seed(seed: int, rank: int, step: int, micro: int, split: int = 0) -> int:
    """A generator seed for one micro-batch: the same on every run, different for every rank."""
    x = seed
    for part in (split, rank, step, micro):
        x = (x * 1_000_003 + part + 1) % (1 << 61)
    return x


# ----------------------------------------------------------------------------
# model: GPT-2 style (pre-norm blocks, causal SDPA attention, tied embeddings)


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0


class Attention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.qkv = nn.Linear(c.n_embd, 3 * c.n_embd)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.n_head, self.dropout = c.n_head, c.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, e = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, e // self.n_head).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,  # flash attention where available
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, e))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.attn = Attention(c)
        self.mlp = nn.Sequential(nn.Linear(c.n_embd, 4 * c.n_embd), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * c.n_embd, c.n_embd), nn.Dropout(c.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab_size, c.n_embd)
        self.pos = nn.Embedding(c.block_size, c.n_embd)
        self.drop = nn.Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        self.head = nn.Linear(c.n_embd, c.vocab_size, bias=False)
        self.head.weight = self.tok.weight  # weight tying
        self.apply(self._init)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith(("attn.proj.weight", "mlp.2.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * c.n_layer))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))

    def flops_per_token(self) -> float:
        """Training FLOPs per token (PaLM appendix B: 6N + 12 L H Q T)."""
        c = self.config
        n = sum(p.numel() for p in self.parameters()) - self.pos.weight.numel()
        return 6 * n + 12 * c.n_layer * c.n_head * (c.n_embd // c.n_head) * c.block_size


def optimizer_for(model: GPT, args, device: torch.device) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only; fused kernels on GPUs."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), **extra)


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine down to --min-lr at --max-steps: a pure
    function of the step, so resuming restores the schedule exactly."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
    return args.min_lr + 0.5 * (args.lr - args.min_lr) * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------
# checkpoints: rank 0 writes atomically; every rank's RNG travels with it


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def gather_to_main(d: Dist, obj):
    if d.world == 1:
        return [obj]
    out = [None] * d.world if d.main else None
    dist.gather_object(obj, out, dst=0)
    return out


def save_atomic(obj: dict, path: str) -> None:
    """Write to a temporary name in the same directory, fsync, rename, fsync
    the directory: readers see the old checkpoint or the new one, never half."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(d: Dist, raw: GPT, opt: torch.optim.Optimizer, step: int, args) -> None:
    rngs = gather_to_main(d, rng_state())  # every rank takes part
    if d.main:
        save_atomic({"model": raw.state_dict(), "optimizer": opt.state_dict(), "step": step,
                     "config": asdict(raw.config), "rng": rngs, "world": d.world, "args": vars(args),
                     "threads": torch.get_num_threads()},
                    os.path.join(args.out, "ckpt.pt"))
    if d.world > 1:
        dist.barrier()


def load_checkpoint(d: Dist, raw: GPT, opt: torch.optim.Optimizer, args) -> int:
    """Rank 0 reads the file and broadcasts it: only the first node needs it."""
    path = os.path.join(args.out, "ckpt.pt")
    box = [None]
    if d.main:
        if not os.path.exists(path):
            box = [f"no checkpoint at {path} (on the first node)"]
        else:
            box = [torch.load(path, map_location="cpu", weights_only=False)]
    if d.world > 1:
        dist.broadcast_object_list(box, src=0)
    ckpt = box[0]
    if isinstance(ckpt, str):
        sys.exit(f"train_gpt.py: --resume: {ckpt}\nHINT: run without --resume first, or point --out at it")
    if ckpt["world"] != d.world:
        say(d, f"resume: the checkpoint was written by {ckpt['world']} ranks, this run has {d.world}: "
               "the weights and optimizer carry over, the RNG streams and data positions start anew")
    else:
        set_rng_state(ckpt["rng"][d.rank])
    threads = ckpt.get("threads")
    if d.device.type == "cpu" and threads not in (None, torch.get_num_threads()):
        # A CPU sum is split across the intra-op threads: another count adds
        # the same numbers in another order.
        say(d, f"resume: the checkpoint was written with {threads} CPU threads per rank, this run has "
               f"{torch.get_num_threads()}: it continues correctly, but not bit for bit as an uninterrupted "
               "run would (set OMP_NUM_THREADS to the same value for both)")
    raw.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    return ckpt["step"]


def save_model(d: Dist, raw: GPT, args) -> None:
    """The trained weights alone, loadable into a plain GPT (no DDP, no compile)."""
    if d.main:
        save_atomic({"config": asdict(raw.config), "model": raw.state_dict()}, os.path.join(args.out, "model.pt"))


def load_model(path: str) -> GPT:
    saved = torch.load(path, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**saved["config"]))
    model.load_state_dict(saved["model"])
    return model


# ----------------------------------------------------------------------------
# speed: autocast dtype, compile, MFU

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "L4": 121.0}


def autocast_for(args, device: torch.device):
    use_bf16 = args.dtype == "bf16" or (args.dtype == "auto" and device.type == "cuda"
                                        and torch.cuda.is_bf16_supported())
    if not use_bf16:
        return contextlib.nullcontext, "fp32"
    return (lambda: torch.autocast(device.type, dtype=torch.bfloat16)), "bf16"


def peak_tflops(args, device: torch.device) -> float | None:
    if args.peak_tflops:
        return args.peak_tflops
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def tensorboard(d: Dist, args):
    if not (d.main and args.tensorboard):
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        say(d, "tensorboard is not installed: --tensorboard ignored (pip install tensorboard)")
        return None
    return SummaryWriter(args.tensorboard)


def settle_buckets(model: nn.Module, data: Tokens, args, d: Dist, autocast) -> None:
    """One backward pass whose gradients are thrown away, before the first step.

    DDP all-reduces gradients in buckets and, after its first backward,
    re-packs the buckets in the order gradients became ready.  With more
    than two ranks the sum of one element depends on where it lies in its
    bucket, so the first step after a resume (old packing) would differ in
    the last bits from the same step of an uninterrupted run (new packing).
    Doing the first backward here, in eval mode (no dropout: the RNG is not
    touched) makes every run, fresh or resumed, train with the same packing.
    """
    model.eval()
    x, y = data.batch(args.batch_size, batch_seed(args.seed, d.rank, -1, 0), d.device)
    with autocast():
        _, loss = model(x, y)
    loss.backward()
    for p in model.parameters():
        p.grad = None
    model.train()


# ----------------------------------------------------------------------------
# evaluation


@torch.no_grad()
def evaluate(d: Dist, model: nn.Module, val: Tokens, args, autocast, step: int) -> float:
    model.eval()
    total = torch.zeros((), device=d.device)
    for i in range(args.eval_batches):
        x, y = val.batch(args.batch_size, batch_seed(args.seed, d.rank, step, i, split=1), d.device)
        with autocast():
            _, loss = model(x, y)
        total += loss.detach().float()
    total /= args.eval_batches
    if d.world > 1:
        dist.all_reduce(total)
        total /= d.world
    model.train()
    return total.item()


# ----------------------------------------------------------------------------
# training


def main(argv=None) -> None:
    args = parse_args(argv)
    d = setup()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    random.seed(args.seed + d.rank)
    np.random.seed(args.seed + d.rank)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    train = Tokens(os.path.join(args.data, "train.bin"), args.block_size)
    val = Tokens(os.path.join(args.data, "val.bin"), args.block_size)
    with open(os.path.join(args.data, "vocab_size.txt")) as f:
        vocab = int(f.read())
    config = GPTConfig(vocab, args.block_size, args.n_layer, args.n_head, args.n_embd, args.dropout)
    raw = GPT(config).to(d.device)
    opt = optimizer_for(raw, args, d.device)
    torch.manual_seed(args.seed + 1000 + d.rank)  # dropout differs per rank...
    step = load_checkpoint(d, raw, opt, args) if args.resume else 0  # ...and resumes exactly
    compiled = args.compile == "on" or (args.compile == "auto" and d.device.type == "cuda")
    model: nn.Module = torch.compile(raw) if compiled else raw
    if d.world > 1:
        model = DDP(model, device_ids=[d.local_rank] if d.device.type == "cuda" else None)
    autocast, dtype_name = autocast_for(args, d.device)
    if d.world > 1:
        settle_buckets(model, train, args, d, autocast)
    writer = tensorboard(d, args)
    tokens_per_step = args.batch_size * args.block_size * args.grad_accum * d.world
    n_params = sum(p.numel() for p in raw.parameters())
    say(d, f"training on {d.world} process(es) | {d.device.type} | {dtype_name} | compile {'on' if compiled else 'off'} "
           f"| {n_params / 1e6:.2f}M parameters | global batch {args.batch_size} x {args.grad_accum} x {d.world} "
           f"sequences of {args.block_size} = {tokens_per_step} tokens/step")
    if args.resume:
        say(d, f"resumed at step {step}")
    peak = peak_tflops(args, d.device)
    last_stop = args.stop_at if args.stop_at is not None else args.max_steps
    t0, seen = time.perf_counter(), 0
    while step < min(args.max_steps, last_stop):
        lr = lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        total = torch.zeros((), device=d.device)
        for micro in range(args.grad_accum):
            x, y = train.batch(args.batch_size, batch_seed(args.seed, d.rank, step, micro), d.device)
            last = micro == args.grad_accum - 1
            sync = contextlib.nullcontext() if last or d.world == 1 else model.no_sync()
            with sync, autocast():
                _, loss = model(x, y)
                (loss / args.grad_accum).backward()
            total += loss.detach().float() / args.grad_accum
        if args.grad_clip:
            torch.nn.utils.clip_grad_norm_(raw.parameters(), args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        seen += tokens_per_step
        if step % args.log_every == 0 or step == 1:
            if d.world > 1:
                dist.all_reduce(total)
                total /= d.world
            if d.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            tps = seen / dt
            mfu = f"{100 * tps * raw.flops_per_token() / (peak * 1e12):.1f}%" if peak else "n/a"
            say(d, f"step {step} | loss {total.item():.6f} | lr {lr:.2e} | {tps:,.0f} tokens/s | mfu {mfu}")
            if writer:
                writer.add_scalar("train/loss", total.item(), step)
                writer.add_scalar("train/tokens_per_s", tps, step)
            t0, seen = time.perf_counter(), 0
        if step % args.eval_every == 0 or step == args.max_steps:
            v = evaluate(d, model, val, args, autocast, step)
            say(d, f"eval | step {step} | val loss {v:.6f}")
            if writer:
                writer.add_scalar("val/loss", v, step)
        if step % args.save_every == 0 or step == last_stop or step == args.max_steps:
            save_checkpoint(d, raw, opt, step, args)
    if step >= args.max_steps:
        save_model(d, raw, args)
        say(d, f"done | step {step} | model saved to {os.path.join(args.out, 'model.pt')}")
    else:
        say(d, f"stopped at step {step} | resume with --resume")
    if writer:
        writer.close()
    if d.world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
