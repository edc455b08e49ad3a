"""Destinations several nodes share (a home on NFS): written once, verified from each.

Several rsyncs into one NFS directory race (rsync's "symlink ... failed:
File exists", exit 23) and send the tree once per node to the same file
server.  Each node creates a probe file named for the sync and its index and
looks up the others' (``nodedest.share_probe``); nodes that see each other's
probes share that destination.  Only the first node of a group is written
to; the verify step still describes the directory from every node, so a node
wrongly grouped (a lying answer) is named, not silently left out of date.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from corral.hostrange import fold
from corral.sync.filelist import Unit


def assign(names: list[str], units: list[Unit], heads: list[dict], plans: dict[str, dict[str, Any]],
           answers: Mapping[str, Any], shared: dict[str, dict[str, str]]) -> list[str]:
    """Drop, from the plan of every node but the first of each group, the units
    whose destination it shares; record them in ``shared`` (node ->
    {destination: the node written to}); the notes that say so."""
    notes = []
    for i, unit in enumerate(units):
        seen = [_seen(answers.get(n), i, len(names)) for n in names]
        for group in share_groups(len(names), seen):
            first, others = names[group[0]], [names[j] for j in group[1:]]
            for n in others:
                _drop_unit(plans[n], i, units, heads)
                shared.setdefault(n, {})[unit.dest] = first
            if others:
                notes.append(f"{fold(others)}: {unit.dest} is the same directory as on {first} (a shared "
                             f"filesystem): written once, from {first}, and verified from each")
    return notes


def _drop_unit(plan: dict[str, Any], unit: int, units: list[Unit], heads: list[dict]) -> None:
    """Nothing of ``unit`` is written to this node (another node shares its directory)."""
    plan["copy_pairs"] = [(j, p) for j, p in plan["copy_pairs"] if j != unit]
    plan["delete_pairs"] = [(j, p) for j, p in plan["delete_pairs"] if j != unit]
    plan["copy"] = [f"{units[j].dest}/{p}" for j, p in plan["copy_pairs"]]
    plan["delete"] = [f"{units[j].dest}/{p}" for j, p in plan["delete_pairs"]]
    plan["bytes"] = sum(heads[j]["entries"][p][2] for j, p in plan["copy_pairs"])


def _seen(answer: Any, unit: int, count: int) -> list[int]:
    """The peers a node says it saw for ``unit``: untrusted, so only indices
    of this sync's nodes, each at most once."""
    if not isinstance(answer, list) or unit >= len(answer) or not isinstance(answer[unit], list):
        return []
    return sorted({j for j in answer[unit][:count] if type(j) is int and 0 <= j < count})


def share_groups(count: int, seen: list[list[int]]) -> list[list[int]]:
    """Nodes ``0..count-1`` joined wherever one saw another's probe; each group
    sorted, singles included, in order of their first member."""
    parent = list(range(count))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, peers in enumerate(seen):
        for j in peers:
            a, b = root(i), root(j)
            if a != b:
                parent[max(a, b)] = min(a, b)
    groups: dict[int, list[int]] = {}
    for i in range(count):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values())
