"""The keys a DeepSpeed JSON config may have, from a DeepSpeed installation.

DeepSpeed reads its top-level keys one by one from the dict (an unknown one
is ignored without a word) and its sections (``zero_optimization``, ``fp16``,
``bf16``, monitors, ...) through pydantic models.  ``installed_keys()`` asks
the DeepSpeed installed here; where there is none (the head usually has no
torch), ``shipped_keys()`` is the list taken from the DeepSpeed named in
``ds_keys.json`` (regenerated with ``python scripts/ds_config_keys.py``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import subprocess
import sys
from dataclasses import dataclass
from importlib import resources
from typing import Mapping

#: Sections read through a pydantic model: section path -> (module, class).
SECTION_MODELS = {
    "zero_optimization": ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
    "zero_optimization.offload_optimizer": ("deepspeed.runtime.zero.offload_config",
                                            "DeepSpeedZeroOffloadOptimizerConfig"),
    "zero_optimization.offload_param": ("deepspeed.runtime.zero.offload_config", "DeepSpeedZeroOffloadParamConfig"),
    "fp16": ("deepspeed.runtime.precision_config", "DeepSpeedFP16Config"),
    "bf16": ("deepspeed.runtime.precision_config", "DeepSpeedBF16Config"),
    "comms_logger": ("deepspeed.comm.config", "CommsLoggerConfig"),
    "tensorboard": ("deepspeed.monitor.config", "TensorBoardConfig"),
    "wandb": ("deepspeed.monitor.config", "WandbConfig"),
    "csv_monitor": ("deepspeed.monitor.config", "CSVConfig"),
    "comet": ("deepspeed.monitor.config", "CometConfig"),
    "compile": ("deepspeed.compile.config", "CompileConfig"),
    "hybrid_engine": ("deepspeed.runtime.config", "HybridEngineConfig"),
}


@dataclass(frozen=True, kw_only=True)
class DsKeys:
    """Known keys: ``top`` for the top level, ``sections`` per section path."""

    version: str
    #: "installed here" or "corral's list"
    origin: str
    top: frozenset[str]
    sections: Mapping[str, frozenset[str]]

    def known(self, path: str) -> frozenset[str] | None:
        """The keys of a section path ("" = top level); None when not checked."""
        return self.top if path == "" else self.sections.get(path)


def collect() -> dict:
    """Read the key lists from the DeepSpeed importable here (imports torch).

    Top level: every ``NAME = "key"`` constant of DeepSpeed's ``*constants.py``
    and ``*config.py`` modules (read as text: importing them all takes
    seconds) and the keys its config readers look up by name; a wide net,
    so a key DeepSpeed reads is never called unknown.  Sections: the fields
    and aliases of their pydantic models."""
    import importlib
    from pathlib import Path

    import deepspeed

    root = Path(deepspeed.__path__[0])
    top: set[str] = set(s.split(".")[0] for s in SECTION_MODELS)
    constant = re.compile(r"""^[A-Z][A-Z0-9_]*\s*=\s*["']([a-z][a-z0-9_]*)["']""", re.M)
    lookup = re.compile(r"""(?:param_dict|ds_config)(?:\.get\(\s*|\[)["'](\w+)["']"""
                        r"""|["'](\w+)["']\s+(?:not\s+)?in\s+(?:param_dict|ds_config)""")
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("ops/", "inference/")) or not re.search(r"(constants|config)\.py$", rel):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        top.update(constant.findall(text))
        top.update(a or b for a, b in lookup.findall(text))
    sections = {}
    for section, (module, cls) in SECTION_MODELS.items():
        model = getattr(importlib.import_module(module), cls)
        names = set()
        for field, info in model.model_fields.items():
            names.add(field)
            for alias in (info.alias, info.validation_alias):
                if isinstance(alias, str):
                    names.add(alias)
        sections[section] = sorted(names)
    return {"deepspeed": deepspeed.__version__, "top": sorted(top), "sections": sections}


def _from(data: dict, origin: str) -> DsKeys:
    return DsKeys(version=data["deepspeed"], origin=origin, top=frozenset(data["top"]),
                  sections={k: frozenset(v) for k, v in data["sections"].items()})


@functools.cache
def shipped_keys() -> DsKeys:
    text = resources.files("corral.interop").joinpath("ds_keys.json").read_text()
    return _from(json.loads(text), "corral's list")


@functools.cache
def installed_keys(python: str = sys.executable) -> DsKeys | None:
    """The keys of the DeepSpeed installed for ``python``, read in a child
    process (importing DeepSpeed imports torch and logs); None without one."""
    if python == sys.executable and importlib.util.find_spec("deepspeed") is None:
        return None
    try:
        out = subprocess.run([python, "-c", "import json, corral.interop.dskeys as k; print(json.dumps(k.collect()))"],
                             capture_output=True, text=True, timeout=60)
        return _from(json.loads(out.stdout.strip().splitlines()[-1]), "installed here")
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError):
        return None


def keys() -> DsKeys:
    """The installed DeepSpeed's keys where there is one, else corral's list."""
    return installed_keys() or shipped_keys()
