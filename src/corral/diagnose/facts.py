"""Turn doctor's per-host facts into host-specific fix steps.

A generic fix ("set NCCL_IB_DISABLE=1 if there is no InfiniBand") becomes an
exact one ("node3 has no InfiniBand device: set NCCL_IB_DISABLE=1 on node3")
when the facts doctor collected say so.  Rules name a *predicate* from
:data:`PREDICATES` in a ``[[rule.refine]]`` entry; the predicate decides
whether it holds for a host and supplies the values its fix template uses.

Facts follow the schema shared with ``corral doctor`` (see docs/diagnose.md).
Unknown values are ``None`` and never count as evidence: "no InfiniBand"
means ``infiniband == []``, not a missing key.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

Facts = Mapping[str, Any]
AllFacts = Mapping[str, Facts]
Values = dict[str, str]
Check = Callable[[Facts | None, AllFacts, Mapping[str, str]], "Values | None"]

_VIRTUAL_KINDS = frozenset({"bridge", "veth", "docker", "virtual"})
_MAX_HOST_STEPS = 8


@dataclass(frozen=True)
class Predicate:
    """A named condition on facts, and the template values it provides."""

    name: str
    provides: frozenset[str]
    check: Check
    #: True: evaluated per host against that host's facts; False: once, cluster-wide.
    per_host: bool = True


# --------------------------------------------------------------------------
# helpers


def _interfaces(hf: Facts) -> list[Mapping[str, Any]]:
    return [i for i in (hf.get("interfaces") or []) if isinstance(i, Mapping) and i.get("name")]


def _describe(iface: Mapping[str, Any]) -> str:
    addrs = ", ".join(iface.get("addresses") or []) or "no address"
    state = iface.get("state") or "?"
    return f"{iface['name']} ({addrs}, {state})"


def _usable(iface: Mapping[str, Any]) -> bool:
    return bool(iface.get("addresses")) and iface.get("state") not in ("down",)


def _best_interface(hf: Facts) -> Mapping[str, Any] | None:
    """The interface a human would pick: up, addressed, physical before virtual, docker last."""
    candidates = [i for i in _interfaces(hf)
                  if _usable(i) and i.get("kind") != "loopback" and i["name"] != "lo"]
    candidates.sort(key=lambda i: (i.get("kind") == "docker", i.get("kind") in _VIRTUAL_KINDS,
                                   i.get("kind") != "ethernet"))
    return candidates[0] if candidates else None


def _suggest(hf: Facts) -> str:
    best = _best_interface(hf)
    return best["name"] if best else "<interface>"


def _ifname_problem(hf: Facts, spec: str, *, nccl: bool) -> str | None:
    """Why ``spec`` (an *_SOCKET_IFNAME value) selects no usable interface, or None if it does."""
    ifaces = {i["name"]: i for i in _interfaces(hf)}
    if not ifaces:
        return None  # interfaces unknown: no evidence either way
    exact = not nccl or spec.startswith("=")
    exclude = nccl and spec.startswith("^")
    names = [n.strip() for n in spec.lstrip("=^").split(",") if n.strip()]
    if exclude:
        chosen = [i for n, i in ifaces.items() if not any(n.startswith(p) for p in names)]
    elif exact:
        chosen = [ifaces[n] for n in names if n in ifaces]
    else:
        chosen = [i for n, i in ifaces.items() if any(n.startswith(p) for p in names)]
    if any(_usable(i) for i in chosen):
        return None
    if not chosen:
        return "excludes every interface" if exclude else "matches no interface on this host"
    if not any(i.get("addresses") for i in chosen):
        return "names an interface without an IP address"
    return "names an interface that is down"


def _ifname_check(var: str, nccl: bool) -> Check:
    def check(hf: Facts | None, _all: AllFacts, cap: Mapping[str, str]) -> Values | None:
        if hf is None:
            return None
        env = hf.get("env") or {}
        spec = cap.get("ifname") or env.get(var)
        if not spec:
            return None
        problem = _ifname_problem(hf, spec, nccl=nccl)
        if problem is None:
            return None
        return {
            "var": var,
            "ifname": spec,
            "problem": problem,
            "interfaces": "; ".join(_describe(i) for i in _interfaces(hf)),
            "suggest": _suggest(hf),
        }

    return check


def _no_infiniband(hf: Facts | None, _all: AllFacts, _cap: Mapping[str, str]) -> Values | None:
    if hf is None or hf.get("infiniband") is None:
        return None
    if hf["infiniband"] or any(i.get("kind") == "infiniband" for i in _interfaces(hf)):
        return None
    return {}


def _ib_down(hf: Facts | None, _all: AllFacts, _cap: Mapping[str, str]) -> Values | None:
    ports = [p for p in (hf or {}).get("infiniband") or [] if isinstance(p, Mapping)]
    down = [f"{p.get('device')} port {p.get('port')} ({p.get('state')})"
            for p in ports if str(p.get("state", "")).upper() != "ACTIVE"]
    return {"ib_down": ", ".join(down)} if down else None


def _virtual_interfaces(hf: Facts | None, _all: AllFacts, _cap: Mapping[str, str]) -> Values | None:
    if hf is None or (hf.get("env") or {}).get("NCCL_SOCKET_IFNAME"):
        return None
    # NCCL's default already skips lo* and docker*; anything else virtual is a candidate.
    virtual = [i["name"] for i in _interfaces(hf)
               if i.get("kind") in _VIRTUAL_KINDS and _usable(i)
               and not i["name"].startswith(("lo", "docker"))]
    best = _best_interface(hf)
    if not virtual or best is None or best.get("kind") in _VIRTUAL_KINDS:
        return None  # nothing better to point NCCL at (e.g. a container with only a veth)
    return {"virtual": ", ".join(virtual), "suggest": best["name"]}


def _versions_differ(_hf: Facts | None, all_facts: AllFacts, _cap: Mapping[str, str]) -> Values | None:
    parts = []
    for key in ("torch", "torch_cuda", "nccl", "deepspeed"):
        seen = {h: (f.get("packages") or {}).get(key) for h, f in all_facts.items()}
        known = {h: v for h, v in seen.items() if v}
        if len(set(known.values())) > 1:
            parts.append(f"{key}: " + ", ".join(f"{h} {v}" for h, v in sorted(known.items())))
    return {"versions": "; ".join(parts)} if parts else None


def _driver_info(hf: Facts | None, _all: AllFacts, _cap: Mapping[str, str]) -> Values | None:
    if hf is None or not hf.get("driver"):
        return None
    return {
        "driver": str(hf["driver"]),
        "cuda_driver": str(hf.get("cuda_driver") or "unknown"),
        "torch_cuda": str((hf.get("packages") or {}).get("torch_cuda") or "unknown"),
    }


def _gpu_info(hf: Facts | None, _all: AllFacts, _cap: Mapping[str, str]) -> Values | None:
    if hf is None or hf.get("gpus") is None:
        return None
    gpus = [g for g in hf["gpus"] if isinstance(g, Mapping)]
    names: dict[str, int] = {}
    for g in gpus:
        names[str(g.get("name", "GPU"))] = names.get(str(g.get("name", "GPU")), 0) + 1
    listing = ", ".join(f"{n} x {name}" for name, n in names.items()) or "none"
    visible = hf.get("cuda_visible_devices")
    if visible is not None:
        listing += f"; CUDA_VISIBLE_DEVICES={visible}"
    return {"gpus": str(len(gpus)), "gpu_list": listing}


def _shm_size(hf: Facts | None, _all: AllFacts, _cap: Mapping[str, str]) -> Values | None:
    size = (hf or {}).get("shm_bytes")
    if not isinstance(size, int):
        return None
    return {"shm": _human_bytes(size)}


def _ds_batch(_hf: Facts | None, _all: AllFacts, cap: Mapping[str, str]) -> Values | None:
    try:
        return {"expected": str(int(cap["mbs"]) * int(cap["gas"]) * int(cap["ws"]))}
    except (KeyError, ValueError):
        return None


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}".replace(".0 ", " ")
        n /= 1024  # type: ignore[assignment]
    return str(n)  # pragma: no cover


_IF_VALUES = frozenset({"var", "ifname", "problem", "interfaces", "suggest"})

PREDICATES: dict[str, Predicate] = {
    p.name: p
    for p in (
        Predicate("no_infiniband", frozenset(), _no_infiniband),
        Predicate("ib_down", frozenset({"ib_down"}), _ib_down),
        Predicate("nccl_ifname_missing", _IF_VALUES, _ifname_check("NCCL_SOCKET_IFNAME", True)),
        Predicate("gloo_ifname_missing", _IF_VALUES, _ifname_check("GLOO_SOCKET_IFNAME", False)),
        Predicate("virtual_interfaces", frozenset({"virtual", "suggest"}), _virtual_interfaces),
        Predicate("versions_differ", frozenset({"versions"}), _versions_differ, per_host=False),
        Predicate("driver_info", frozenset({"driver", "cuda_driver", "torch_cuda"}), _driver_info),
        Predicate("gpu_info", frozenset({"gpus", "gpu_list"}), _gpu_info),
        Predicate("shm_size", frozenset({"shm"}), _shm_size),
        Predicate("ds_batch", frozenset({"expected"}), _ds_batch, per_host=False),
    )
}


# --------------------------------------------------------------------------
# applying a rule's refinements


class _Strict(dict):
    def __missing__(self, key: str) -> str:
        raise KeyError(key)


def _render(template: str, needs: Iterable[str], values: Mapping[str, Any]) -> str | None:
    if any(values.get(n) in (None, "") for n in needs):
        return None
    try:
        return template.format_map(_Strict({k: v for k, v in values.items() if v is not None}))
    except (KeyError, IndexError, ValueError):
        return None


def refine_steps(
    refinements: Iterable[Any],
    *,
    captures: Mapping[str, str],
    host: str | None,
    rank: int | None,
    facts: AllFacts | None,
) -> list[str]:
    """Host-specific fix steps for one diagnosis, in rule order, without duplicates.

    With the failing host known, per-host predicates look only at its facts;
    with it unknown they look at every host in ``facts`` (one step per host
    where the predicate holds), so "which node lacks InfiniBand" is still named.
    """
    facts = facts or {}
    base: dict[str, Any] = dict(captures)
    base.update(host=host, rank=None if rank is None else str(rank))
    steps: list[str] = []
    for ref in refinements:
        if getattr(ref, "fallback", False) and steps:
            continue
        pred = PREDICATES.get(ref.when) if ref.when else None
        if pred is None:
            candidates = [dict(base)]
        elif not pred.per_host:
            found = pred.check(None, facts, captures)
            candidates = [] if found is None else [{**base, **found}]
        else:
            hosts = [host] if host in facts else ([] if host else sorted(facts))
            candidates = []
            for h in hosts[:_MAX_HOST_STEPS]:
                found = pred.check(facts[h], facts, captures)
                if found is not None:
                    candidates.append({**base, "host": h, **found})
        for values in candidates:
            step = _render(ref.fix, ref.needs, values)
            if step and step not in steps:
                steps.append(step)
    return steps
