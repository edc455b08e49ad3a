"""Dataclasses to JSON and back, by their type hints: how a detached job travels.

``corral run --detach`` writes the cluster, the run spec and the run
options into ``job.json`` for the supervisor on node 0.  Written by hand,
that codec broke each time a field was added (a nested options dataclass, a
tuple of GPUs, the parsed ``.deepspeed_env``): the supervisor then failed
to start.  Here every field of every dataclass is written, and read back by
its declared type: tuples, frozensets, paths, mappings, optional and nested
dataclasses.  A field the reader does not know is an error, not dropped.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def to_json(obj: Any) -> Any:
    """Plain JSON values (dict, list, str, number, bool, None) for ``obj``."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, (frozenset, set)):
        return sorted((to_json(v) for v in obj), key=repr)
    if isinstance(obj, (tuple, list)):
        return [to_json(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def from_json(cls: type[T], data: Mapping[str, Any]) -> T:
    """An instance of the dataclass ``cls`` from ``to_json``'s output."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = set(data) - known
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {sorted(unknown)}")
    return cls(**{name: _convert(hints[name], value) for name, value in data.items()})


def _convert(tp: Any, value: Any) -> Any:
    if value is None or tp is Any:
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        choices = [a for a in args if a is not type(None)]
        return _convert(choices[0], value) if len(choices) == 1 else value
    if dataclasses.is_dataclass(tp):
        return from_json(tp, value)
    if tp is Path:
        return Path(value)
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v) for v in value)
        if args:
            return tuple(_convert(a, v) for a, v in zip(args, value))
        return tuple(value)
    if origin in (frozenset, set):
        return origin(_convert(args[0], v) for v in value) if args else origin(value)
    if origin is list:
        return [_convert(args[0], v) for v in value] if args else list(value)
    if origin in (dict, Mapping, typing.Mapping) or tp in (dict, Mapping):
        return {k: _convert(args[1], v) for k, v in value.items()} if args else dict(value)
    return value
