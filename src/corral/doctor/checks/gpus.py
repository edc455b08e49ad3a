"""GPU checks: counts that match the slots, one GPU model, drivers that fit torch, one NCCL.

A CPU-only cluster (no nvidia-smi anywhere) passes with one line saying so:
gloo is then the backend and none of this applies.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from corral.agent.probes import visible_count
from corral.doctor.checks.base import (
    ERROR,
    OK,
    WARNING,
    Evidence,
    Finding,
    describe_groups,
    group_hosts,
    odd_ones,
    version_tuple,
)
from corral.hostrange import HostSet


def visible_gpus(facts: Mapping[str, Any]) -> int:
    """GPUs a job on this node may use: nvidia-smi's list, cut by CUDA_VISIBLE_DEVICES."""
    return visible_count(len(facts.get("gpus") or []), facts.get("cuda_visible_devices"))


def _models(facts: Mapping[str, Any]) -> str:
    names: dict[str, int] = {}
    for gpu in facts.get("gpus") or []:
        names[gpu.get("name") or "?"] = names.get(gpu.get("name") or "?", 0) + 1
    return ", ".join(f"{n}x {name}" for name, n in names.items()) or "no GPU"


def counts(ev: Evidence) -> list[Finding]:
    """Every node has GPUs or none does; their counts fit ``slots``."""
    count = {h: visible_gpus(ev.facts[h]) for h in ev.reachable}
    if not count:
        return []
    if not any(count.values()):
        return [Finding(check="gpus.count", severity=OK, hosts=HostSet.of(count),
                        message="no GPUs (nvidia-smi lists none): jobs use CPUs and gloo")]
    out: list[Finding] = []
    groups = group_hosts(count)
    without = HostSet.of(h for h, n in count.items() if n == 0)
    if without:
        out.append(Finding(
            check="gpus.count", severity=ERROR, hosts=without,
            message="some nodes have no usable GPU: "
                    + describe_groups(groups, lambda n: f"{n} GPU(s)"),
            hint=f"on {without}: check `nvidia-smi` (driver loaded?) and CUDA_VISIBLE_DEVICES; "
                 "or leave those hosts out of the cluster",
        ))
    for h in ev.reachable:
        slots = ev.slots.get(h)
        if slots is not None and count[h] and slots > count[h]:
            out.append(Finding(
                check="gpus.count", severity=ERROR, hosts=HostSet.of([h]),
                message=f"slots={slots} but only {count[h]} GPU(s) are visible"
                        + _visible_note(ev.facts[h]),
                hint=f"set slots = {count[h]} for {h} in the cluster file, or make the GPUs visible",
            ))
    unset = [h for h in ev.reachable if ev.slots.get(h) is None]
    if len(groups) > 1 and not without and unset:
        out.append(Finding(
            check="gpus.count", severity=ERROR, hosts=odd_ones(groups),
            message="GPU counts differ and processes per node follow them: "
                    + describe_groups(groups, lambda n: f"{n} GPU(s)"),
            hint="every node runs the same number of processes: set `slots` for every host "
                 "in the cluster file (or pass --nproc-per-node)",
        ))
    if not out:
        out.append(Finding(check="gpus.count", severity=OK, hosts=HostSet.of(count),
                           message=describe_groups(groups, lambda n: f"{n} GPU(s) visible")))
    return out


def _visible_note(facts: Mapping[str, Any]) -> str:
    visible = facts.get("cuda_visible_devices")
    return f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""


def models(ev: Evidence) -> list[Finding]:
    """One GPU model (and memory size) everywhere: the slowest GPU paces every step."""
    with_gpus = {h: _models(ev.facts[h]) for h in ev.reachable if ev.facts[h].get("gpus")}
    if not with_gpus:
        return []
    groups = group_hosts(with_gpus)
    if len(groups) == 1:
        return [Finding(check="gpus.models", severity=OK, hosts=groups[0][1], message=groups[0][0])]
    return [Finding(
        check="gpus.models", severity=WARNING, hosts=odd_ones(groups),
        message="mixed GPU models: " + describe_groups(groups, str),
        hint="synchronous data parallel runs at the pace of the slowest GPU, and the smallest "
             "memory bounds the batch; use one model per job",
    )]


def drivers(ev: Evidence) -> list[Finding]:
    """One driver version; a driver that supports torch's CUDA build; a torch that sees the GPUs."""
    hosts = [h for h in ev.reachable if ev.facts[h].get("gpus")]
    if not hosts:
        return []
    out: list[Finding] = []
    groups = group_hosts({h: ev.facts[h].get("driver") for h in hosts})
    if len(groups) > 1:
        out.append(Finding(
            check="gpus.driver", severity=WARNING, hosts=odd_ones(groups),
            message="NVIDIA driver differs: " + describe_groups(groups, lambda v: f"driver {v}"),
            hint="install one driver version on every node (mixed drivers are a common source of "
                 "NCCL errors)",
        ))
    for h in hosts:
        out.extend(_torch_fits(h, ev.facts[h]))
    if not out:
        f = ev.facts[hosts[0]]
        out.append(Finding(check="gpus.driver", severity=OK, hosts=HostSet.of(hosts),
                           message=f"driver {f.get('driver')} (CUDA {f.get('cuda_driver')}), torch "
                                   f"CUDA {(f.get('packages') or {}).get('torch_cuda')}"))
    return out


def _torch_fits(host: str, f: Mapping[str, Any]) -> list[Finding]:
    one = HostSet.of([host])
    pkgs = f.get("packages") or {}
    probe = f.get("torch_import") or {}
    built, driver = pkgs.get("torch_cuda"), f.get("cuda_driver")
    if pkgs.get("torch") and not built and not probe.get("hip"):
        return [Finding(check="gpus.driver", severity=ERROR, hosts=one,
                        message=f"torch {pkgs.get('torch')} is a CPU-only build on a node with GPUs",
                        hint="install a CUDA build of torch (https://pytorch.org/get-started/locally/)")]
    if built and driver and version_tuple(built) > version_tuple(driver):
        major = version_tuple(built)[:1] != version_tuple(driver)[:1]
        return [Finding(
            check="gpus.driver", severity=ERROR if major else WARNING, hosts=one,
            message=f"torch is built for CUDA {built} but the driver supports CUDA {driver}",
            hint="update the NVIDIA driver, or install a torch built for an older CUDA "
                 f"(cu{''.join(driver.split('.')[:2])} or lower)",
        )]
    if probe.get("ok") and built and probe.get("cuda_available") is False:
        return [Finding(check="gpus.driver", severity=ERROR, hosts=one,
                        message="torch.cuda.is_available() is False although nvidia-smi lists GPUs"
                                + (f" ({probe['cuda_error']})" if probe.get("cuda_error") else ""),
                        hint="check the driver (`nvidia-smi`), CUDA_VISIBLE_DEVICES and that the "
                             "process may open /dev/nvidia*")]
    return []


def nccl(ev: Evidence) -> list[Finding]:
    """One NCCL version: ranks with different NCCLs may not even connect."""
    values = {h: (ev.facts[h].get("packages") or {}).get("nccl") for h in ev.reachable}
    if not any(values.values()):
        return []
    groups = group_hosts(values)
    if len(groups) == 1:
        return [Finding(check="gpus.nccl", severity=OK, hosts=groups[0][1],
                        message=f"NCCL {groups[0][0]}")]
    return [Finding(
        check="gpus.nccl", severity=ERROR, hosts=odd_ones(groups),
        message="NCCL differs: " + describe_groups(groups, lambda v: f"NCCL {v or 'none'}"),
        hint="install the same torch build everywhere (its NCCL comes with it), and unset "
             "LD_LIBRARY_PATH entries that load another libnccl",
    )]


CHECKS = (counts, models, drivers, nccl)
