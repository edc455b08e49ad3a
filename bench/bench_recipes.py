#!/usr/bin/env python3
"""Recipes on one GPU: the flagship DDP recipe vs the DeepSpeed ZeRO-2 recipe, tokens/s.

    .venv/bin/python bench/bench_recipes.py                       # GPT-2 124M, B=16 x T=1024
    .venv/bin/python bench/bench_recipes.py --batch-size 32 --steps 60

Each recipe trains GPT-2 small (12 layers, 12 heads, 768 wide, 1024 tokens
of context, vocabulary 50304) on random tokens (throughput does not depend
on what the tokens say; no tokenizer or download needed), run directly
(``python`` / ``torchrun --nproc-per-node 1``) and under ``corral run -n 1``
on this machine.  The tokens/s is the median of the recipe's own log lines
after the warm-up steps (``torch.compile`` compiles in the first ones), and
the flagship's MFU line is printed with it.  It prints one line per run and
the ZeRO-2 / DDP ratio; nothing is asserted (speed goals live here).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPES = os.path.join(REPO, "examples", "recipes")


def tokens(directory: str, n: int = 20_000_000, vocab: int = 50304) -> None:
    rng = np.random.default_rng(0)
    for name, size in (("train.bin", n), ("val.bin", n // 10)):
        rng.integers(0, 50257, size, dtype=np.uint16).tofile(os.path.join(directory, name))
    with open(os.path.join(directory, "vocab_size.txt"), "w") as f:
        f.write(f"{vocab}\n")


def measure(argv: list[str], warmup: int) -> tuple[float, str]:
    res = subprocess.run(argv, capture_output=True, text=True, cwd=REPO)
    if res.returncode != 0:
        sys.exit(f"failed: {' '.join(argv)}\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")
    rows = re.findall(r"step (\d+) \|.*?\| ([\d,]+) tokens/s(?: \| mfu ([\d.]+%|n/a))?", res.stdout)
    late = [(float(t.replace(",", "")), m) for s, t, m in rows if int(s) > warmup]
    if not late:
        sys.exit(f"no tokens/s after step {warmup}: {res.stdout[-2000:]}")
    tps = statistics.median(t for t, _ in late)
    return tps, late[-1][1] or ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=20, help="log lines up to this step are not counted")
    p.add_argument("--no-corral", action="store_true", help="run the recipes directly only")
    args = p.parse_args()
    work = tempfile.mkdtemp(prefix="bench-recipes-")
    data = os.path.join(work, "data")
    os.makedirs(data)
    tokens(data)
    model = ["--n-layer", "12", "--n-head", "12", "--n-embd", "768", "--block-size", "1024",
             "--batch-size", str(args.batch_size), "--max-steps", str(args.steps), "--warmup", "10",
             "--log-every", "5", "--save-every", "100000"]
    gpt = [os.path.join(RECIPES, "gpt", "train_gpt.py"), "--data", data, *model, "--eval-every", "100000",
           "--eval-batches", "1"]
    ds = [os.path.join(RECIPES, "deepspeed", "train_deepspeed.py"), "--data", data, *model,
          "--deepspeed-config", os.path.join(RECIPES, "deepspeed", "ds_zero2.json")]
    runs = [("ddp (flagship), direct", [sys.executable, *gpt, "--out", os.path.join(work, "a")]),
            ("deepspeed zero-2, direct", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
                                          *ds, "--out", os.path.join(work, "b")])]
    if not args.no_corral:
        corral = [sys.executable, "-m", "corral", "run", "-n", "1"]
        runs += [("ddp (flagship), corral run", corral + gpt + ["--out", os.path.join(work, "c")]),
                 ("deepspeed zero-2, corral run", corral + ds + ["--out", os.path.join(work, "d")])]
    results = {}
    for name, argv in runs:
        tps, mfu = measure(argv, args.warmup)
        results[name] = tps
        print(f"{name:32s} {tps:12,.0f} tokens/s  {('mfu ' + mfu) if mfu else ''}", flush=True)
    print(f"zero-2 / ddp (direct): {results['deepspeed zero-2, direct'] / results['ddp (flagship), direct']:.2f}x")


if __name__ == "__main__":
    main()
