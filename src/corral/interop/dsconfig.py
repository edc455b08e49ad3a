"""DeepSpeed JSON configs, checked before launch.

DeepSpeed reads its config on every rank after the model is built: a
misspelled top-level key is ignored without a word, a misspelled ZeRO key
(``stage3_gather_16bit_weights_on_mode_save``) stops every rank minutes
into the job (older DeepSpeed ignored it too, saving no 16-bit weights), and
``train_batch_size != micro x accumulation x world`` fails the same way.
Here the file is read where corral runs (the project is the same on every
node), its keys are checked against the DeepSpeed installed here, else
against corral's list (``dskeys``, which names its DeepSpeed version), with
the nearest known key as the fix, and the batch arithmetic against the
job's world size.
"""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from typing import Any, Iterable

from corral.errors import ForeignConfigError
from corral.interop.dskeys import DsKeys

#: Script options that name a DeepSpeed config (``deepspeed.add_config_arguments``,
#: and the transformers Trainer's ``--deepspeed ds.json``).
SCRIPT_OPTIONS = ("--deepspeed_config", "--deepspeed")
#: accelerate launch's option for it.
ACCELERATE_OPTION = "--deepspeed_config_file"
MAX_BYTES = 4 << 20


def named_configs(args: Iterable[str], options: tuple[str, ...]) -> list[str]:
    """The ``.json`` files given to any of ``options`` (``--opt F`` or ``--opt=F``)."""
    args = list(args)
    out = []
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name not in options:
            continue
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        if value.endswith(".json"):
            out.append(value)
    return out


@dataclass(frozen=True, kw_only=True)
class _Located:
    data: dict
    text: str


def load(path: str, shown: str) -> _Located | None:
    """The parsed file, or None when it is not here (it may be on the nodes only)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ForeignConfigError(f"cannot read it ({e.strerror})", path=shown) from None
    text = raw.decode("utf-8", errors="replace")

    def no_duplicates(pairs: list) -> dict:
        seen: dict = {}
        for key, value in pairs:
            if key in seen:
                raise ForeignConfigError(
                    f"{key!r} is given twice: DeepSpeed refuses the file", path=shown,
                    line=_line_of(text, [key], occurrence=2), key=key, hint="keep one of them")
            seen[key] = value
        return seen

    try:
        data = json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise ForeignConfigError(f"is not valid JSON: {e.msg}", path=shown, line=e.lineno,
                                 hint="DeepSpeed reads it with json.load: fix the syntax there") from None
    if not isinstance(data, dict):
        raise ForeignConfigError("is not a JSON object of DeepSpeed settings", path=shown)
    return _Located(data=data, text=text)


def _line_of(text: str, keys: list[str], occurrence: int = 1) -> int | None:
    """The line of ``"a": {... "b":`` for the key path ``[a, b]`` (the first place
    each key appears after its parent's)."""
    pos = 0
    for i, key in enumerate(keys):
        found = [m.start() for m in re.finditer(r'"%s"\s*:' % re.escape(key), text[pos:])]
        want = occurrence if i == len(keys) - 1 else 1
        if len(found) < want:
            return None
        pos += found[want - 1]
    return text.count("\n", 0, pos) + 1


def check(path: str, shown: str, *, world_size: int | None, keys: DsKeys) -> list[str]:
    """Raise for the first problem of the file at ``path``; return notes.  A file
    that is not here is left to the nodes (a note says so)."""
    located = load(path, shown)
    if located is None:
        return [f"{shown}: not here, so not checked before launch (the nodes read their copy)"]
    check_keys(located, shown, keys)
    return check_batch(located, shown, world_size)


def check_keys(located: _Located, shown: str, keys: DsKeys) -> None:
    def walk(section: dict, path: list[str]) -> None:
        known = keys.known(".".join(path))
        for key, value in section.items():
            if known is not None and key not in known:
                _unknown(located.text, shown, path, key, known, keys)
            if isinstance(value, dict) and keys.known(".".join([*path, key])) is not None:
                walk(value, [*path, key])

    walk(located.data, [])


def _unknown(text: str, shown: str, path: list[str], key: str, known: frozenset[str], keys: DsKeys) -> None:
    full = ".".join([*path, key])
    near = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    where = "the top level" if not path else ".".join(path)
    source = f"DeepSpeed {keys.version}, {keys.origin}"
    if near:
        hint = f"did you mean {near[0]!r}? rename the key to {'.'.join([*path, near[0]])}"
    else:
        hint = f"remove it, or check the key against DeepSpeed's config documentation for {where}"
    raise ForeignConfigError(
        f"{full}: DeepSpeed has no such setting in {where} ({source}): "
        + ("the whole job would fail when DeepSpeed reads it" if path else "it would be ignored without a word"),
        path=shown, line=_line_of(text, [*path, key]), key=full, hint=hint)


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_batch(located: _Located, shown: str, world_size: int | None) -> list[str]:
    """``train_batch_size = micro x accumulation x world`` (DeepSpeed's
    ``_batch_assertion``, after it derives the one left out); "auto" values
    (the transformers Trainer's) are left to it.  With model or sequence
    parallelism DeepSpeed's world is the data-parallel part of the ranks: a
    product that fits a divisor of the ranks is taken as that, and said."""
    d = located.data
    train, micro, acc = (_int(d.get(k)) for k in
                         ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"))
    given = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
             if d.get(k) is not None]
    if world_size is None or train is None or len(given) < 2 or (micro is None and acc is None):
        return []
    per_rank = (micro or 1) * (acc or 1)  # the one left out is derived: any whole number >= 1
    if train % (per_rank * world_size) == 0 and (micro is None or acc is None or train == per_rank * world_size):
        return []
    if train % per_rank == 0 and world_size % (train // per_rank) == 0 and micro and acc:
        dp = train // per_rank
        return [f"{shown}: train_batch_size {train} = {micro} x {acc} x {dp}: right only if groups of "
                f"{world_size // dp} of the {world_size} ranks are model/sequence parallel (DeepSpeed's world "
                "is the data-parallel ranks)"]
    parts = " x ".join(f"{k} {d[k]}" for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
                       if d.get(k) is not None)
    fix = per_rank * world_size
    relation = "is not" if micro and acc else "is not a multiple of"
    raise ForeignConfigError(
        f"train_batch_size {train} {relation} {parts} x {world_size} ranks = {fix}: DeepSpeed stops every "
        "rank with \"Check batch related parameters\" once the model is built",
        path=shown, line=_line_of(located.text, ["train_batch_size"]), key="train_batch_size",
        hint=f"set train_batch_size to {fix}, or leave it out (DeepSpeed derives it), or change the other "
             "two or the number of ranks (-n, the hosts)")


def configs_of_run(args: Iterable[str], launcher_args: Iterable[str], head_cwd: str) -> list[tuple[str, str]]:
    """(path here, as named) of every DeepSpeed config a run names."""
    named = named_configs(args, SCRIPT_OPTIONS) + named_configs(launcher_args, (ACCELERATE_OPTION,))
    return [(os.path.join(head_cwd, os.path.expanduser(n)), n) for n in dict.fromkeys(named)]


def check_run(args: Iterable[str], launcher_args: Iterable[str], head_cwd: str, world_size: int | None,
              *, more: Iterable[tuple[str, str]] = ()) -> list[str]:
    """Check every DeepSpeed config a run names (``more``: others, such as an
    accelerate config's ``deepspeed_config_file``); raise for the first
    problem, return notes."""
    from corral.interop.dskeys import keys

    notes: list[str] = []
    for path, shown in dict.fromkeys([*configs_of_run(args, launcher_args, head_cwd), *more]):
        notes += check(path, shown, world_size=world_size, keys=keys())
    return notes
