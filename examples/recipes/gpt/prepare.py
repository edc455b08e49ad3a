"""A tokenised data set for train_gpt.py: train.bin / val.bin (uint16 tokens) and vocab_size.txt.

    python prepare.py --out data                     # a tiny synthetic corpus (no download), byte tokens
    python prepare.py --out data --text corpus.txt   # any text file, byte tokens (vocab 256)
    python prepare.py --out data --text corpus.txt --tokenizer gpt2   # GPT-2 BPE (needs tiktoken)

The synthetic corpus is made of sentences from a small grammar, so a model
can learn it in a few hundred steps and a falling loss means something.
The files are written atomically: a data set is never half there.
"""

from __future__ import annotations

import argparse
import os
import random

import numpy as np

SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the robot", "a small bird", "the teacher"]
VERBS = ["sees", "likes", "follows", "draws", "finds", "helps", "carries"]
OBJECTS = ["the ball", "a red box", "the river", "an apple", "the moon", "a long road", "the garden"]
ENDINGS = ["today", "every morning", "at night", "again", "with care", "in the rain"]


def synthetic(n_sentences: int, seed: int) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(n_sentences):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(ENDINGS)}."
        out.append(s[0].upper() + s[1:])
    return " ".join(out) + "\n"


def tokenize(text: str, tokenizer: str) -> tuple[np.ndarray, int]:
    if tokenizer == "bytes":
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16), 256
    import tiktoken  # only for --tokenizer gpt2

    enc = tiktoken.get_encoding("gpt2")
    return np.array(enc.encode_ordinary(text), dtype=np.uint16), enc.n_vocab


def write_atomic(path: str, data: bytes) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--text", help="a text file to tokenise (default: the synthetic corpus)")
    p.add_argument("--sentences", type=int, default=20000, help="size of the synthetic corpus")
    p.add_argument("--tokenizer", choices=["bytes", "gpt2"], default="bytes")
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.text:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    else:
        text = synthetic(args.sentences, args.seed)
    tokens, vocab = tokenize(text, args.tokenizer)
    split = int(len(tokens) * (1 - args.val_fraction))
    os.makedirs(args.out, exist_ok=True)
    write_atomic(os.path.join(args.out, "train.bin"), tokens[:split].tobytes())
    write_atomic(os.path.join(args.out, "val.bin"), tokens[split:].tobytes())
    write_atomic(os.path.join(args.out, "vocab_size.txt"), f"{vocab}\n".encode())
    print(f"{args.out}: {split:,} training and {len(tokens) - split:,} validation tokens, vocabulary {vocab}")


if __name__ == "__main__":
    main()
