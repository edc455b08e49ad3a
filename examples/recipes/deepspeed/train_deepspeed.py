"""GPT pre-training with DeepSpeed ZeRO-2 or ZeRO-3 (plain ``deepspeed.initialize``): one file.

A small GPT-2 built from a ``GPT2Config`` (nothing is downloaded) trains on
the tokenised file that ../gpt/prepare.py writes; the ZeRO settings live in
a JSON config next to this file (``"auto"`` values are filled in from the
command line, as transformers does):

    python ../gpt/prepare.py --out data
    deepspeed --num_gpus 8 train_deepspeed.py --data data --out ckpt --deepspeed-config ds_zero3.json
    torchrun --nproc-per-node 8 train_deepspeed.py --data data --out ckpt          # ZeRO-2
    corral run -c hostfile train_deepspeed.py --data data --out /shared/ckpt --deepspeed-config ds_zero3.json

What it does right, each a trap that costs a day on a cluster:

- the consolidated model: under ZeRO-3 every rank holds a shard of each
  weight, and ``model.state_dict()`` on rank 0 saves empty tensors.
  ``engine.save_16bit_model`` gathers the shards (every rank must call it;
  the config must say ``stage3_gather_16bit_weights_on_model_save``, or it
  saves nothing: checked here, with the fix named) and rank 0 writes
  ``pytorch_model.bin`` next to ``config.json``: ``GPT2LMHeadModel.from_pretrained``
  loads it.  The recipe reads the file back and compares it with the trained
  weights (gathered) before it says done;
- checkpoints: ``engine.save_checkpoint`` is called by *every* rank (each
  writes its own ZeRO shard of the optimizer state, and under ZeRO-3 of the
  weights); a tag per step and the ``latest`` file written last make a save
  that is killed half-way harmless.  The shards land where each rank runs:
  ``--out`` must be a path every node shares.  With node-local disks, gather
  the checkpoint directory onto one node first (``corral sync`` from each
  node, or rsync), then ``python ckpt/zero_to_fp32.py ckpt model_fp32`` (the
  script DeepSpeed writes next to each checkpoint) consolidates the fp32
  master weights on one machine, without GPUs;
- resume is exact: ``engine.load_checkpoint`` restores the weights, the
  optimizer shards, the scheduler and the step; the data position (an epoch
  seeded ``DistributedSampler`` and the batches already consumed in it) and
  every rank's RNG state (gathered to rank 0 into ``client_state``) are
  restored by the recipe; the DataLoader has its own generator (without one
  it draws from the global RNG for every iterator, once more in a resumed
  run, and dropout would shift);
- on GPUs bf16 (``"bf16": {"enabled": "auto"}``); on CPU fp32, gloo, and
  torch's AdamW (``torch_adam``), so a DS_BUILD_OPS=0 install works.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import shutil
import time

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import GPT2Config, GPT2LMHeadModel

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="directory with train.bin and vocab_size.txt (../gpt/prepare.py)")
    p.add_argument("--out", required=True, help="checkpoints and the final model (shared by every node)")
    p.add_argument("--deepspeed-config", default=os.path.join(HERE, "ds_zero2.json"),
                   help="ds_zero2.json (default) or ds_zero3.json")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out/ckpt")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (as if the job were stopped)")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the deepspeed launcher")
    return p.parse_args(argv)


def ds_config(args) -> dict:
    """The JSON config with its "auto" values filled in from the command line."""
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    auto = {"train_micro_batch_size_per_gpu": args.batch_size, "gradient_accumulation_steps": args.grad_accum,
            "gradient_clipping": args.grad_clip, "lr": args.lr, "weight_decay": args.weight_decay,
            "total_num_steps": args.max_steps, "warmup_num_steps": args.warmup,
            "cos_min_ratio": args.min_lr / args.lr,
            "warmup_min_ratio": 1 / max(1, args.warmup),  # 0 would train the first steps at lr 0
            "enabled": torch.cuda.is_available() and torch.cuda.is_bf16_supported()}

    def fill(node):
        if isinstance(node, dict):
            return {k: auto[k] if v == "auto" else fill(v) for k, v in node.items()}
        return node

    return fill(config)


class Windows(Dataset):
    """Non-overlapping windows of a memory-mapped uint16 token file."""

    def __init__(self, path: str, block: int):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block = block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.data[i * self.block:(i + 1) * self.block].astype(np.int64))


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


def save_checkpoint(engine, step: int, args) -> None:
    """Every rank calls it: each writes its shard; `latest` names the tag once all are written."""
    rngs = [None] * dist.get_world_size()
    dist.all_gather_object(rngs, rng_state())
    ckpt = os.path.join(args.out, "ckpt")
    engine.save_checkpoint(ckpt, tag=f"step{step}", client_state={"step": step, "rng": rngs})
    dist.barrier()
    if dist.get_rank() == 0:  # keep the newest checkpoint only
        for old in os.listdir(ckpt):
            if old.startswith("step") and old != f"step{step}":
                shutil.rmtree(os.path.join(ckpt, old), ignore_errors=True)


def load_checkpoint(engine, args) -> int:
    path, client = engine.load_checkpoint(os.path.join(args.out, "ckpt"))
    if path is None:
        raise SystemExit(f"train_deepspeed.py: --resume: no checkpoint in {args.out}/ckpt\n"
                         "HINT: run without --resume first, or point --out at a path every node shares")
    if len(client["rng"]) == dist.get_world_size():
        set_rng_state(client["rng"][dist.get_rank()])
    return client["step"]


def save_model(engine, model: GPT2LMHeadModel, args, zero3: bool) -> str:
    """The 16-bit consolidated weights (bf16 on GPUs, fp32 on CPU), checked against the trained ones."""
    model_dir = os.path.join(args.out, "model")
    if not engine.save_16bit_model(model_dir, "pytorch_model.bin"):  # every rank: ZeRO-3 gathers here
        raise SystemExit(f"train_deepspeed.py: {args.deepspeed_config}: ZeRO-3 saved no model\n"
                         'HINT: set "stage3_gather_16bit_weights_on_model_save": true in zero_optimization')
    dist.barrier()
    params = list(model.parameters())
    gather = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if zero3 else contextlib.nullcontext()
    with gather:  # under ZeRO-3 the weights are shards until gathered
        if dist.get_rank() == 0:
            model.config.save_pretrained(model_dir)
            saved = torch.load(os.path.join(model_dir, "pytorch_model.bin"), map_location="cpu", weights_only=True)
            for name, p in model.named_parameters():
                if not torch.equal(saved[name], p.detach().to("cpu", saved[name].dtype)):
                    raise SystemExit(f"train_deepspeed.py: the saved model differs from the trained one at {name}")
    return model_dir


def main(argv=None) -> None:
    args = parse_args(argv)
    deepspeed.init_distributed()  # nccl on GPUs, gloo on CPU
    rank, world = dist.get_rank(), dist.get_world_size()
    config = ds_config(args)
    zero3 = config.get("zero_optimization", {}).get("stage") == 3

    with open(os.path.join(args.data, "vocab_size.txt")) as f:
        vocab = int(f.read())
    gpt = GPT2Config(vocab_size=vocab, n_positions=args.block_size, n_embd=args.n_embd,
                     n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=args.dropout,
                     embd_pdrop=args.dropout, attn_pdrop=args.dropout, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT2LMHeadModel(gpt)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    torch.manual_seed(args.seed + 1000 + rank)  # dropout differs per rank...
    random.seed(args.seed + rank)
    np.random.seed(args.seed + rank)
    step = load_checkpoint(engine, args) if args.resume else 0  # ...and resumes exactly
    if args.resume and rank == 0:
        print(f"resumed at step {step}", flush=True)

    train = Windows(os.path.join(args.data, "train.bin"), args.block_size)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=args.seed, drop_last=True)
    # its own generator: without one, every iterator draws a seed from the global RNG, and a
    # resumed run makes one more, so its dropout masks would shift
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed))
    per_epoch = len(loader) // args.grad_accum
    if rank == 0:
        print(f"training on {world} process(es) | ZeRO-{config['zero_optimization']['stage']} | "
              f"{engine.device} | global batch {args.batch_size} x {args.grad_accum} x {world} "
              f"sequences of {args.block_size}", flush=True)
    stop = min(args.max_steps, args.stop_at or args.max_steps)
    tokens_per_step = args.batch_size * args.block_size * args.grad_accum * world
    t0, seen = time.perf_counter(), 0
    engine.train()
    while step < stop:
        epoch, done = divmod(step, per_epoch)
        sampler.set_epoch(epoch)
        batches = itertools.islice(loader, done * args.grad_accum, per_epoch * args.grad_accum)
        total = torch.zeros((), device=engine.device)
        for i, batch in enumerate(batches, start=1):
            batch = batch.to(engine.device)
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)  # divides by the accumulation steps
            engine.step()          # the optimizer steps at the accumulation boundary only
            total += loss.detach().float() / args.grad_accum
            if i % args.grad_accum:
                continue
            step += 1
            seen += tokens_per_step
            if step % args.log_every == 0 or step == 1:
                dist.all_reduce(total)  # (waits for the step: the time below is honest)
                tps = seen / (time.perf_counter() - t0)
                if rank == 0:
                    print(f"step {step} | loss {total.item() / world:.6f} | lr {engine.get_lr()[0]:.2e} "
                          f"| {tps:,.0f} tokens/s", flush=True)
                t0, seen = time.perf_counter(), 0
            total = torch.zeros((), device=engine.device)
            if step % args.save_every == 0 or step == stop:
                save_checkpoint(engine, step, args)
            if step >= stop:
                break

    if step >= args.max_steps:
        model_dir = save_model(engine, model, args, zero3)
        if rank == 0:
            print(f"done | step {step} | model saved to {model_dir} and checked against the trained weights",
                  flush=True)
    elif rank == 0:
        print(f"stopped at step {step} | resume with --resume", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
