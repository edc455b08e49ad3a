"""Large files travel node to node, streaming along a chain.

Sending a 256 MiB checkpoint from the head to N nodes in turn (or in
parallel) pushes N copies through the head's uplink.  The chain sends one:

    head --> node1 --> node2 --> node3
             (writes   (writes   (writes)
              and       and
              forwards) forwards)

Each hop is ``nodetree.receive`` running on the node: it writes the bytes to
a temporary file *and* forwards them to the next hop's ssh while they
arrive, so every link carries the file at the same time and the whole chain
takes about as long as one copy.  Each hop checks the sha256 before
renaming the file into place and reports its result back up the chain.

The chain needs every node to log in to the next one (``corral ssh
setup``); ``reachable`` proves that first, and the caller falls back to
sending from the head (the star) when it cannot, saying so.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral import streams
from corral.errors import HostError
from corral.model import Cluster, Host
from corral.sshsetup.remote import MARK, call_node, payload, remote_command, ssh_argv
from corral.sync import nodedest, nodetree, procs
from corral.transport.ssh import command_line, hop_argv

log = logging.getLogger(__name__)



def node_source() -> str:
    """What a node runs for sync: ``nodedest``, then ``nodetree`` (which uses
    it), as one module there; ``from __future__`` may only open the whole."""
    dest = Path(nodedest.__file__).read_text()
    tree = Path(nodetree.__file__).read_text().replace("from __future__ import annotations\n", "", 1)
    return dest + "\n\n" + tree


SOURCE = node_source()

#: The longest line of a chain's answer the head reads; the rest of a longer
#: one is dropped as it arrives (the hops' lines are short).
MAX_ANSWER_LINE = 1024 * 1024


def _remote(host: Host) -> str:
    return command_line(remote_command(host.python))


async def reachable(cluster: Cluster, pairs: Sequence[tuple[Host, Host]]) -> dict[str, str]:
    """For each hop ``(a, b)``: "ok" or why ``a`` cannot log in to ``b`` (in parallel)."""

    async def one(a: Host, b: Host) -> tuple[str, str]:
        argv = hop_argv(b) + ["true"]
        try:
            why = await call_node(
                a,
                ssh_argv(cluster, a, remote_command(a.python)),
                "nodetree",
                SOURCE,
                "probe",
                {"argv": argv},
                timeout=30,
            )
        except HostError as e:
            why = e.message
        return f"{a.name} -> {b.name}", why

    return dict(await asyncio.gather(*(one(a, b) for a, b in pairs)))


@dataclass(frozen=True, kw_only=True)
class HopResult:
    node: str
    ok: bool
    #: Why this hop failed (None when ok).
    error: str | None = None
    #: Why this hop could not pass the data on (the next hop then failed too).
    next_error: str | None = None
    #: The node's name for the failure ("nospace", "dest-link", ...; "" when unnamed).
    kind: str = ""


async def stream(
    cluster: Cluster,
    chain: Sequence[Host],
    source: Path,
    dest_root: str,
    rel: str,
    size: int,
    digest: str,
    mode: int,
    mtime_ns: int,
    *,
    on_bytes: Callable[[str, int], None] | None = None,
) -> dict[str, HopResult]:
    """Send ``source`` to ``dest_root/rel`` on every host of ``chain``, streaming hop to hop."""
    first, rest = chain[0], chain[1:]
    hops = [{"name": h.name, "argv": hop_argv(h) + ["--", _remote(h)]} for h in rest]
    args = {
        "name": first.name,
        "root": dest_root,
        "rel": rel,
        "size": size,
        "digest": digest,
        "mode": mode,
        "mtime_ns": mtime_ns,
        "chain": hops,
    }
    argv = ssh_argv(cluster, first, remote_command(first.python))
    log.debug("chain %s: %s", " -> ".join(h.name for h in chain), argv)
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    results: dict[str, HopResult] = {}
    seen: dict[str, int] = {}

    async def feed() -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(payload("nodetree", SOURCE, "receive", args, stream=True))
            fh = await asyncio.to_thread(open, source, "rb")
            try:
                while True:
                    chunk = await asyncio.to_thread(fh.read, nodetree.CHUNK)
                    if not chunk:
                        break
                    proc.stdin.write(chunk)
                    await proc.stdin.drain()
            finally:
                fh.close()
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            proc.stdin.close()

    async def read() -> None:
        assert proc.stdout is not None
        # What the hops print is untrusted: a name outside the chain, a count
        # that is not one or a line that is not JSON is skipped, not believed.
        names = {h.name for h in chain}
        async for raw in streams.bounded_lines(proc.stdout, MAX_ANSWER_LINE):
            line = raw.decode(errors="replace").rstrip("\r")
            if line.startswith(nodetree.PROGRESS):
                name, _, n = line[len(nodetree.PROGRESS) :].partition(" ")
                if name not in names or not n.isdigit():
                    continue
                done = int(n)
                if on_bytes is not None and done > seen.get(name, 0):
                    on_bytes(name, done - seen.get(name, 0))
                seen[name] = max(done, seen.get(name, 0))
            elif line.startswith((nodetree.HOP, MARK)):
                body = (
                    line[len(nodetree.HOP) :]
                    if line.startswith(nodetree.HOP)
                    else line[len(MARK) :]
                )
                try:
                    raw_result = json.loads(body)
                except (ValueError, RecursionError):
                    continue
                if isinstance(raw_result, dict):
                    _record(results, raw_result, names)

    try:
        _, _, err = await asyncio.gather(feed(), read(), streams.read_tail(proc.stderr))
        await proc.wait()
    except BaseException:  # stopped: the first hop sees its input end and cleans up
        await procs.reap(proc)
        raise
    for h in chain:
        if h.name not in results:
            why = err.decode(errors="replace").strip().splitlines()
            results[h.name] = HopResult(
                node=h.name,
                ok=False,
                error=_upstream_error(results, chain, h) or (why[-1] if why else "no result"),
            )
    return results


def _record(results: dict[str, HopResult], raw: dict[str, Any], names: set[str]) -> None:
    """A hop's result, for a node of the chain only (the head's own names)."""
    value = raw.get("value")
    if not isinstance(value, dict) or value.get("node") not in names:
        return
    results[value["node"]] = HopResult(
        node=value["node"],
        ok=bool(value.get("ok")),
        error=_text(value.get("error")),
        next_error=_text(value.get("next_error")),
        kind=str(value.get("kind") or ""),
    )


def _text(value: Any) -> str | None:
    """A hop's reason, as text of a bounded length (or None)."""
    return None if value is None else str(value)[:2000]


def _upstream_error(results: dict[str, HopResult], chain: Sequence[Host], host: Host) -> str | None:
    idx = list(chain).index(host)
    if idx == 0:
        return None
    prev = results.get(chain[idx - 1].name)
    if prev is not None and prev.next_error:
        return f"not reached: {prev.next_error}"
    return f"not reached: {chain[idx - 1].name} did not pass the data on"


def file_facts(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_size, st.st_mode & 0o7777, st.st_mtime_ns
