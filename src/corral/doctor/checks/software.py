"""Software checks: the same Python and packages everywhere, and a torch that imports.

A node with another torch (or DeepSpeed, or Python) is the classic
multi-node failure that shows up late and cryptic: pickled objects that do
not load, NCCL versions that do not talk, DeepSpeed ops built against
another torch.  The report names the odd hosts (``node[1-3]: torch 2.4.0 /
node4: torch 2.3.1``) and the interpreter that has the odd version.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from corral.doctor.checks.base import (
    ERROR,
    OK,
    WARNING,
    Evidence,
    Finding,
    describe_groups,
    group_hosts,
    odd_ones,
)
from corral.hostrange import HostSet


def _pkg(name: str) -> Callable[[dict], Any]:
    return lambda f: (f.get("packages") or {}).get(name)


#: (key, label, severity when it differs, how to read it, pip requirement name)
VERSIONED: tuple[tuple[str, str, str, Callable[[dict], Any], str | None], ...] = (
    ("torch", "torch", ERROR, _pkg("torch"), "torch"),
    ("torch_cuda", "torch CUDA build", ERROR, _pkg("torch_cuda"), None),
    ("deepspeed", "deepspeed", ERROR, _pkg("deepspeed"), "deepspeed"),
    ("accelerate", "accelerate", WARNING, _pkg("accelerate"), "accelerate"),
    ("transformers", "transformers", WARNING, _pkg("transformers"), "transformers"),
    ("lightning", "lightning", WARNING, _pkg("lightning"), "lightning"),
    ("numpy", "numpy", WARNING, _pkg("numpy"), "numpy"),
)


def python_version(ev: Evidence) -> list[Finding]:
    """Python must agree on major.minor (error) and should on the patch level."""
    full = {h: (ev.facts[h].get("python") or {}).get("version") for h in ev.reachable}
    if not full:
        return []
    minor = {h: ".".join((v or "?").split(".")[:2]) for h, v in full.items()}
    groups = group_hosts(full)
    if len(groups) == 1:
        return [Finding(check="software.python", severity=OK, hosts=groups[0][1],
                        message=f"Python {groups[0][0]}")]
    severity = ERROR if len(group_hosts(minor)) > 1 else WARNING
    odd = odd_ones(groups)
    return [Finding(
        check="software.python", severity=severity, hosts=odd,
        message="Python differs: " + describe_groups(groups, lambda v: f"Python {v}"),
        hint=f"run the same Python on every node: point `python` for {odd} in the cluster file "
             f"at an interpreter of Python {groups[0][0]} ({_paths(ev, odd)} now)",
    )]


def versions(ev: Evidence) -> list[Finding]:
    """Every package of ``VERSIONED`` at one version on every node."""
    out: list[Finding] = []
    for key, label, severity, read, req in VERSIONED:
        values = {h: read(ev.facts[h]) for h in ev.reachable}
        if not values or all(v is None for v in values.values()):
            continue
        groups = group_hosts(values)
        if len(groups) == 1:
            out.append(Finding(check="software.versions", severity=OK, hosts=groups[0][1],
                               message=f"{label} {groups[0][0]}"))
            continue
        odd = odd_ones(groups)
        common = groups[0][0] if len(groups[0][1]) > len(groups[1][1]) else None
        out.append(Finding(
            check="software.versions", severity=severity, hosts=odd,
            message=f"{label} differs: "
                    + describe_groups(groups, lambda v, lb=label, k=key: f"{lb} {_shown(k, v)}"),
            hint=_version_hint(ev, odd, label, req, common),
        ))
    return out


def _shown(key: str, value: Any) -> str:
    if value is not None:
        return str(value)
    return "none (a CPU-only build)" if key == "torch_cuda" else "not installed"


def _version_hint(ev: Evidence, odd: HostSet, label: str, req: str | None, common: Any) -> str:
    where = f"the environment of {_paths(ev, odd)} on {odd}"
    if req and common:
        pin = str(common).split("+", 1)[0]
        return (f"install {req}=={pin} in {where} (what the other nodes have), or point `python` "
                f"for {odd} in the cluster file at an environment that has it")
    if common:
        return f"install the {label} {common} that the other nodes have in {where}"
    return f"pick one {label} for every node and install it in {where} and the others"


def torch_import(ev: Evidence) -> list[Finding]:
    """torch must be installed and import on every node (torchrun needs it)."""
    failed: dict[str, str] = {}
    for h in ev.reachable:
        probe = ev.facts[h].get("torch_import")
        if probe is not None and not probe.get("ok"):
            failed[h] = str(probe.get("error") or "import failed")
    if not failed:
        return []
    out = []
    for error, hosts in group_hosts(failed):
        missing = "not installed" in error
        out.append(Finding(
            check="software.torch", severity=ERROR, hosts=hosts,
            message=error if missing else f"torch does not import: {error}",
            hint=(f"install torch for {_paths(ev, hosts)} on {hosts} (pip install torch), or point "
                  "`python` in the cluster file at the environment that has it")
            if missing else
            f"run `{_paths(ev, hosts)} -c 'import torch'` on {hosts} to see the whole error; "
            "reinstall torch in that environment",
        ))
    return out


def _paths(ev: Evidence, hosts: HostSet) -> str:
    paths = sorted({(ev.facts[h].get("python") or {}).get("path") or "python3" for h in hosts
                    if h in ev.facts})
    return ", ".join(paths) or "python3"


CHECKS = (python_version, versions, torch_import)
