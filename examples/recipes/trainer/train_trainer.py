"""GPT pre-training through the transformers Trainer: one file, read top to bottom.

A small GPT-2 is built from a ``GPT2Config`` (nothing is downloaded) and
trained on the tokenised file that ../gpt/prepare.py writes.  The Trainer
runs DDP by itself under any launcher:

    python ../gpt/prepare.py --out data                   # a tiny tokenised data set (no download)
    python train_trainer.py --data data --out ckpt        # one process
    torchrun --nproc-per-node 8 train_trainer.py --data data --out ckpt
    corral run -c hostfile train_trainer.py --data data --out /shared/ckpt

What it does right, each a trap that costs a day on a cluster:

- the global batch is ``--batch-size`` x ``--grad-accum`` x world size and is
  printed; the schedule (warm-up, cosine to ``--min-lr``) is in optimizer
  steps (``max_steps``), not epochs, so 2 nodes and 4 nodes follow the same
  curve per step;
- ``resume_from_checkpoint``: the Trainer restores model, optimizer,
  scheduler, every rank's RNG state (rng_state_<rank>.pth) and the step, and
  skips the batches the interrupted run had consumed (its sampler is seeded
  by ``data_seed``).  Every rank writes its own RNG file and reads the
  checkpoint, so ``--out`` must be a path every node shares;
- ``--stop-at`` stops the run at a step through a callback that also saves:
  the learning-rate schedule still spans ``--max-steps`` (stopping with a
  smaller ``max_steps`` would change the schedule, and resume would not match);
- DDP's gradient buckets are re-packed before the first step
  (``SettleBuckets``): with more than two ranks a resumed run would otherwise
  differ from an uninterrupted one in the last bits;
- the final model is saved by ``trainer.save_model`` (the main process only,
  unwrapped, safetensors, tied weights handled) with its config, so
  ``GPT2LMHeadModel.from_pretrained(out + "/model")`` loads it anywhere.
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="directory with train.bin and vocab_size.txt (../gpt/prepare.py)")
    p.add_argument("--out", required=True, help="checkpoints and the final model (shared by every node)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per micro-step")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--stop-at", type=int, default=None, help="stop (and save) after this step")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--report-to", default="none", help="tensorboard, wandb, ... (none by default)")
    p.add_argument("--seed", type=int, default=1337)
    return p.parse_args(argv)


class Windows(Dataset):
    """Non-overlapping windows of a memory-mapped uint16 token file, as the Trainer wants them."""

    def __init__(self, path: str, block: int):
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.block = block

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.block

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(self.data[i * self.block:(i + 1) * self.block].astype(np.int64))
        return {"input_ids": ids, "labels": ids}  # the model shifts the labels itself


class StopAt(TrainerCallback):
    """Stop after a step and save a checkpoint there, as a stopped job would have."""

    def __init__(self, step: int | None):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if self.step is not None and state.global_step >= self.step:
            control.should_save = control.should_training_stop = True
        return control


class PrintLoss(TrainerCallback):
    """One plain line per logged loss from the main process (no progress bar in the logs)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step} | loss {logs['loss']:.6f} | lr {logs.get('learning_rate', 0):.2e}",
                  flush=True)


class SettleBuckets(TrainerCallback):
    """One backward pass through the DDP model whose gradients are thrown away.

    DDP re-packs its gradient buckets after its first backward; with more
    than two ranks where an element lies in its bucket changes the order of
    the all-reduce sum, so the first step after a resume (old packing) would
    differ in the last bits from the same step of an uninterrupted run.  In
    eval mode (no dropout), before the Trainer restores the RNG state.
    """

    def __init__(self):
        self.trainer: Trainer | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        if args.world_size < 3 or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return
        batch = self.trainer.train_dataset[0]["input_ids"][None].to(args.device)
        model.eval()
        model(input_ids=batch, labels=batch).loss.backward()
        for p in model.parameters():
            p.grad = None
        model.train()


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        # accelerate names a CPU rank's device "cpu:0", and the Trainer hands that to torch.load
        # as the optimizer state's map_location at resume, which torch refuses ("don't know how
        # to restore data location"); a plain "cpu" device avoids it (transformers 5.17)
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
    with open(os.path.join(args.data, "vocab_size.txt")) as f:
        vocab = int(f.read())
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        learning_rate=args.lr,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr": args.min_lr},
        warmup_steps=args.warmup,
        weight_decay=args.weight_decay,
        adam_beta2=0.95,
        max_grad_norm=args.grad_clip,
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
        use_cpu=not torch.cuda.is_available(),
        logging_steps=args.log_every,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=args.save_every,
        seed=args.seed,
        data_seed=args.seed,
        report_to=args.report_to,
        disable_tqdm=True,
        dataloader_drop_last=True,
    )
    config = GPT2Config(vocab_size=vocab, n_positions=args.block_size, n_embd=args.n_embd,
                        n_layer=args.n_layer, n_head=args.n_head, resid_pdrop=args.dropout,
                        embd_pdrop=args.dropout, attn_pdrop=args.dropout, bos_token_id=None, eos_token_id=None)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT2LMHeadModel(config)
    settle = SettleBuckets()
    trainer = Trainer(model=model, args=training,
                      train_dataset=Windows(os.path.join(args.data, "train.bin"), args.block_size),
                      callbacks=[StopAt(args.stop_at), PrintLoss(), settle])
    trainer.remove_callback(PrinterCallback)  # PrintLoss says it in one line
    settle.trainer = trainer
    if trainer.is_world_process_zero():
        print(f"training on {training.world_size} process(es) | {training.device.type} | global batch "
              f"{args.batch_size} x {args.grad_accum} x {training.world_size} sequences of {args.block_size}",
              flush=True)
    resume = None
    if args.resume:
        resume = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
        if resume is None:
            raise SystemExit(f"train_trainer.py: --resume: no checkpoint-* directory in {args.out}\n"
                             "HINT: run without --resume first, or point --out at it")
        if trainer.is_world_process_zero():
            print(f"resumed at step {int(resume.rsplit('-', 1)[1])}", flush=True)
    trainer.train(resume_from_checkpoint=resume)
    step = trainer.state.global_step
    if step >= args.max_steps:
        model_dir = os.path.join(args.out, "model")
        trainer.save_model(model_dir)  # main process only; unwrapped; with config.json
        if trainer.is_world_process_zero():
            print(f"done | step {step} | model saved to {model_dir}", flush=True)
    elif trainer.is_world_process_zero():
        print(f"stopped at step {step} | resume with --resume", flush=True)
    if torch.distributed.is_initialized():  # (without it gloo can abort at exit)
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
