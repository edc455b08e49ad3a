"""GPT pre-training through accelerate: one file, read top to bottom.

The same script runs on one CPU, one GPU, one node or many, unchanged:

    python ../gpt/prepare.py --out data                       # a tiny tokenised data set (no download)
    python train_accelerate.py --data data --out ckpt         # one process
    accelerate launch --num_processes 8 train_accelerate.py --data data --out ckpt
    corral run --launcher accelerate -c hostfile train_accelerate.py --data data --out /shared/ckpt
    corral run -c hostfile train_accelerate.py --data data --out /shared/ckpt \
        --deepspeed-config ../deepspeed/ds_zero3.json          # DeepSpeed ZeRO-3 (or ds_zero2.json)

The model is GPT-2 built from a ``GPT2Config`` (transformers; nothing is
downloaded), so the saved model loads with ``GPT2LMHeadModel.from_pretrained``.

What it does right, each a trap that costs a day on a cluster:

- ``Accelerator(gradient_accumulation_steps=..., mixed_precision=..., log_with=...)``
  and ``with accelerator.accumulate(model)``: gradients are all-reduced once
  per optimizer step, and the prepared optimizer steps only then;
- the learning-rate scheduler is *not* passed to ``prepare``: a prepared
  scheduler steps once per process on every optimizer step (accelerate's
  convention for a batch that grows with the world size), so a warm-up of 20
  steps would end after 20 / world-size steps on 8 nodes; it is registered for
  checkpointing instead and stepped once per optimizer step;
- resume is exact: ``save_state``/``load_state`` carry model, optimizer,
  scheduler, every process's RNG state and (``register_for_checkpointing``)
  the step; the data loader's order is a function of the seed and the epoch
  (``use_seedable_sampler``), and ``skip_first_batches`` skips what the
  interrupted run had already consumed in its epoch;
- the DataLoader has its own generator: without one, every iterator it
  makes draws a seed from the global RNG, and a resumed run makes one
  iterator more than an uninterrupted one, so its dropout masks would shift;
- the seed differs per process (dropout) only after ``prepare``: the
  sampler takes its seed at ``prepare``, and a different one per process
  would shuffle differently on each, so their shards would overlap;
- ``save_state`` writes to a temporary directory that is renamed once every
  process has written its part: a job killed during a save keeps the previous
  checkpoint.  Every process writes (its RNG state) and reads (the model) the
  checkpoint, so ``--out`` must be on a path every node shares; with
  node-local disks, use the flagship recipe (examples/recipes/gpt), whose
  checkpoint lives on the first node only;
- the final model: ``accelerator.get_state_dict`` (unwrapped: no
  ``module.`` prefixes) on every process, saved from the main one with
  ``save_pretrained`` (safetensors, tied weights once, ``config.json``),
  read back and compared with the trained weights;
- DDP's gradient buckets are re-packed before the first step
  (``settle_buckets``): with more than two processes a resumed run would
  otherwise differ from an uninterrupted one in the last bits.

DeepSpeed ZeRO-2/3 through accelerate (``--deepspeed-config``: the JSON
configs of ../deepspeed, given to ``DeepSpeedPlugin(hf_ds_config=...)``):

- the JSON names the optimizer and the scheduler, so ``prepare`` gets
  ``DummyOptim``/``DummyScheduler``; the engine builds them and, inside
  ``accelerator.backward``, scales the loss, clips and steps both
  (``opt.step()``, ``sched.step()``, ``clip_grad_norm_`` do nothing);
- accelerate fills the JSON's ``"auto"`` values, but three badly
  (``deepspeed_plugin`` fills them, so pass the JSON here, not to ``accelerate
  launch``): ``gradient_clipping`` becomes 1.0 whatever the script asks,
  the scheduler's ``total_num_steps`` is divided by the number of processes
  (the cosine would end after a third of the run on 3 nodes), and
  ``cos_min_ratio`` stays "auto", which DeepSpeed refuses;
- the final model under ZeRO-3: each process holds a shard of every weight;
  ``accelerator.get_state_dict(model)`` gathers them and must run on EVERY
  process (on the main one only, it hangs), and only if the JSON says
  ``stage3_gather_16bit_weights_on_model_save`` (``zero3_save_16bit_model``;
  ds_zero3.json does), else it raises.  The check reads the file back, not
  with ``from_pretrained``: inside a ZeRO-3 job that is a collective;
- ``save_state`` has each process write its own ZeRO shard (optimizer state;
  under ZeRO-3 the weights too) to ``ckpt/pytorch_model/`` where it runs, and
  ``load_state`` has each read its own back: ``--out`` must be shared by every
  node (or gather every node's shards into one directory before resuming;
  ``python ckpt/zero_to_fp32.py ckpt fp32`` consolidates them);
- on CPU (gloo, fp32, torch's AdamW: no compiled ops) accelerate must not be
  told the node is a CPU one (``make_accelerator``); DeepSpeed JIT-compiles
  its shared-memory comm op once, into ``$TORCH_EXTENSIONS_DIR``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil

import numpy as np
import torch
from accelerate import Accelerator, DataLoaderConfiguration, InitProcessGroupKwargs
from accelerate.utils import DeepSpeedPlugin, DummyOptim, DummyScheduler, set_seed
from safetensors.torch import load_file
from torch.utils.data import DataLoader, Dataset
from transformers import GPT2Config, GPT2LMHeadModel


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="directory with train.bin and vocab_size.txt (../gpt/prepare.py)")
    p.add_argument("--out", required=True, help="checkpoint and model directory (shared by every node)")
    p.add_argument("--resume", action="store_true", help="continue from --out/ckpt")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per process per micro-step")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--stop-at", type=int, default=None, help="stop after this step (as if the job were stopped)")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--mixed-precision", choices=["auto", "no", "bf16", "fp16"], default="auto",
                   help="auto: bf16 on GPUs that support it, no on CPU")
    p.add_argument("--log-with", default=None, help="an experiment tracker for accelerate (tensorboard, wandb, ...)")
    p.add_argument("--deepspeed-config", default=None,
                   help="train with DeepSpeed ZeRO: ../deepspeed/ds_zero2.json or ds_zero3.json")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args(argv)


class Windows(Dataset):
    """Non-overlapping windows of a memory-mapped uint16 token file."""

    def __init__(self, path: str, block: int):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block = block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.data[i * self.block:(i + 1) * self.block].astype(np.int64))


class Progress:
    """The step, saved and restored by save_state/load_state (register_for_checkpointing)."""

    def __init__(self):
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def lr_lambda(args):
    def factor(step: int) -> float:  # linear warm-up, then cosine down to --min-lr
        if step < args.warmup:
            return (step + 1) / args.warmup
        t = min(1.0, (step - args.warmup) / max(1, args.max_steps - args.warmup))
        return (args.min_lr + 0.5 * (1 + math.cos(math.pi * t)) * (args.lr - args.min_lr)) / args.lr
    return factor


def deepspeed_plugin(args) -> DeepSpeedPlugin | None:
    """The JSON config; the "auto" values accelerate would fill wrongly are filled here."""
    if not args.deepspeed_config:
        return None
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    params = config.get("scheduler", {}).get("params", {})
    for key, value in (("total_num_steps", args.max_steps), ("warmup_num_steps", args.warmup),
                       ("cos_min_ratio", args.min_lr / args.lr),
                       ("warmup_min_ratio", 1 / max(1, args.warmup))):  # 0: the first steps at lr 0
        if params.get(key) == "auto":
            params[key] = value
    return DeepSpeedPlugin(hf_ds_config=config, gradient_clipping=args.grad_clip)


def settle_buckets(accelerator: Accelerator, model, loader) -> None:
    """One backward pass whose gradients are thrown away (see examples/recipes/gpt/train_gpt.py).

    DDP re-packs its gradient buckets after the first backward; with more
    than two processes where an element lies in its bucket changes the order
    of the all-reduce sum, so a resumed run's first step would differ in the
    last bits.  Eval mode: no dropout, the RNG is not touched.
    """
    if accelerator.num_processes < 3 or accelerator.state.deepspeed_plugin:  # (ZeRO has no DDP buckets)
        return
    model.eval()
    batch = loader.dataset[0][None].to(accelerator.device)
    with accelerator.autocast():
        model(input_ids=batch, labels=batch).loss.backward()
    for p in model.parameters():
        p.grad = None
    model.train()


def save_checkpoint(accelerator: Accelerator, out: str) -> None:
    """save_state into ckpt.tmp, then rename: the previous checkpoint survives a crash."""
    final, tmp = os.path.join(out, "ckpt"), os.path.join(out, "ckpt.tmp")
    if accelerator.is_main_process and os.path.exists(tmp):
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(tmp)  # every process writes its RNG state there
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        old = os.path.join(out, "ckpt.old")
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def make_accelerator(args, mixed: str) -> Accelerator:
    """The Accelerator (DeepSpeed with --deepspeed-config, on CPU too), checked to see every process."""
    plugin, handlers = deepspeed_plugin(args), []
    if plugin and "LOCAL_RANK" not in os.environ:
        raise SystemExit("train_accelerate.py: --deepspeed-config needs a launcher, even for one process\n"
                         "HINT: torchrun --nproc-per-node 1 train_accelerate.py ..., or corral run")
    if plugin and not torch.cuda.is_available():
        # told the node is a CPU one (ACCELERATE_USE_CPU: corral, `accelerate launch --cpu`), accelerate
        # drops a DeepSpeed plugin silently; without it, it finds no backend: every rank trains alone
        os.environ.pop("ACCELERATE_USE_CPU", None)
        handlers.append(InitProcessGroupKwargs(backend="gloo"))
    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum, mixed_precision=mixed, log_with=args.log_with,
        project_dir=args.out, deepspeed_plugin=plugin, kwargs_handlers=handlers,
        # the shuffled order is a function of (seed, epoch): a resumed run sees the same order
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
    )
    world = int(os.environ.get("WORLD_SIZE", 1))
    if accelerator.num_processes != world or (plugin and not accelerator.state.deepspeed_plugin):
        raise SystemExit(f"train_accelerate.py: accelerate runs {accelerator.distributed_type} on "
                         f"{accelerator.num_processes} of {world} processes\n"
                         "HINT: on nodes without GPUs set ACCELERATE_USE_CPU=1 (corral run does)")
    return accelerator


def save_model(accelerator: Accelerator, model, model_dir: str) -> None:
    """Every process calls it: get_state_dict gathers ZeRO-3's shards; the main process saves, reads back."""
    state = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(model_dir, state_dict=state)
        saved = load_file(os.path.join(model_dir, "model.safetensors"))
        wrong = [k for k in state if k in saved and not torch.equal(saved[k], state[k].cpu())]
        if wrong or "transformer.wte.weight" not in saved:
            raise SystemExit(f"train_accelerate.py: the saved model differs from the trained one: {wrong[:3]}")
    accelerator.wait_for_everyone()


def main(argv=None) -> None:
    args = parse_args(argv)
    # (accelerator.print prints once per *node*: with one process per node, on every one)
    mixed = args.mixed_precision
    if mixed == "auto":
        mixed = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"
    accelerator = make_accelerator(args, mixed)

    def say(*words) -> None:
        if accelerator.is_main_process:
            print(*words, flush=True)

    set_seed(args.seed)  # the same initial weights everywhere (load_state later restores every RNG)

    with open(os.path.join(args.data, "vocab_size.txt")) as f:
        vocab = int(f.read())
    config = GPT2Config(vocab_size=vocab, n_positions=args.block_size, n_embd=args.n_embd,
                        n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=args.dropout,
                        embd_pdrop=args.dropout, attn_pdrop=args.dropout, bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    ds = accelerator.state.deepspeed_plugin  # None without DeepSpeed
    if ds and "optimizer" in ds.deepspeed_config:  # the JSON's optimizer and scheduler: the engine builds them
        opt = DummyOptim(groups, lr=args.lr, weight_decay=args.weight_decay)
        sched = DummyScheduler(opt)
    else:
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args))
    train = Windows(os.path.join(args.data, "train.bin"), args.block_size)
    # its own generator: a DataLoader draws a seed from it for every iterator it makes, and
    # from the global RNG without one, so a resumed run (one more iterator) would shift dropout
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(args.seed))
    progress = Progress()
    if isinstance(sched, DummyScheduler):  # DeepSpeed's: stepped and checkpointed by the engine
        model, opt, sched, loader = accelerator.prepare(model, opt, sched, loader)
        accelerator.register_for_checkpointing(progress)
    else:
        model, opt, loader = accelerator.prepare(model, opt, loader)  # not sched: see the docstring
        accelerator.register_for_checkpointing(sched, progress)
    set_seed(args.seed, device_specific=True)  # dropout differs per process, after the sampler is seeded

    if args.resume:
        ckpt = os.path.join(args.out, "ckpt")
        if not os.path.isdir(ckpt):
            raise SystemExit(f"train_accelerate.py: --resume: no checkpoint at {ckpt}\n"
                             "HINT: run without --resume first, or point --out at it")
        accelerator.load_state(ckpt)
        say(f"resumed at step {progress.step}")
    settle_buckets(accelerator, model, loader)
    if args.log_with:
        accelerator.init_trackers("gpt", config=vars(args))

    per_epoch = len(loader) // args.grad_accum  # optimizer steps per epoch
    zero = f"ZeRO-{ds.zero_stage} | " if ds else ""
    say(f"training on {accelerator.num_processes} process(es) | {zero}{accelerator.device.type} | "
                      f"{mixed} | global batch {args.batch_size} x {args.grad_accum} x "
                      f"{accelerator.num_processes} sequences of {args.block_size}")
    stop = min(args.max_steps, args.stop_at or args.max_steps)
    model.train()
    while progress.step < stop:
        epoch, done = divmod(progress.step, per_epoch)
        loader.set_epoch(epoch)
        # skip what this epoch had already consumed before the checkpoint
        batches = accelerator.skip_first_batches(loader, done * args.grad_accum) if done else loader
        total = torch.zeros((), device=accelerator.device)
        for batch in batches:
            with accelerator.accumulate(model):
                loss = model(input_ids=batch, labels=batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients and args.grad_clip:
                    accelerator.clip_grad_norm_(model.parameters(), args.grad_clip)
                opt.step()
                opt.zero_grad()
            total += loss.detach().float() / args.grad_accum
            if not accelerator.sync_gradients:
                continue
            sched.step()
            progress.step += 1
            step = progress.step
            if step % args.log_every == 0 or step == 1:
                mean = accelerator.reduce(total, reduction="mean").item()
                say(f"step {step} | loss {mean:.6f} | lr {sched.get_last_lr()[0]:.2e}")
                accelerator.log({"train/loss": mean}, step=step)
            total = torch.zeros((), device=accelerator.device)
            if step % args.save_every == 0 or step == stop:
                save_checkpoint(accelerator, args.out)
            if step >= stop or step % per_epoch == 0:
                break

    if progress.step >= args.max_steps:
        model_dir = os.path.join(args.out, "model")
        save_model(accelerator, model, model_dir)
        say(f"done | step {progress.step} | model saved to {model_dir}, checked against the trained weights")
    else:
        say(f"stopped at step {progress.step} | resume with --resume")
    accelerator.end_training()
    if torch.distributed.is_initialized():  # (without it gloo can abort at exit)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
