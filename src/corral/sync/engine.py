"""``corral sync``, in order, as a library.

1. list what to send (``filelist``) and describe it (``nodetree.manifest``:
   kind, mode, size, sha256 per file, with a stat cache);
2. ask every node, in one round trip, what differs from that description
   and, with ``--delete``, which files it has that the head does not;
3. dry run / check: report that and stop;
4. delete extra files (never ones the ignore rules protect);
5. when several nodes have something to write, find the destinations that
   are one directory seen by several of them (a home on NFS): only the
   first node of each such group is written to, the others verified;
6. send large files along a node-to-node chain (``pipeline``) when nodes can
   log in to each other, the rest (and everything, otherwise) with rsync
   from the head to every node in parallel;
7. verify: every node describes its tree again; its tree hash must equal
   the head's, else the node and the files are named.

The library never prints; ``SyncView`` receives notes and progress.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from corral.errors import HostError, PreflightError
from corral.model import Cluster, Host
from corral.sshsetup.remote import call_node, gather_hosts, remote_command, ssh_argv
from corral.sync import filelist, nodetree, pipeline, rsync, shared
from corral.sync.filelist import Unit

log = logging.getLogger(__name__)

_SOURCE = pipeline.SOURCE
MiB = 1 << 20
#: A node hashing terabytes for the first time takes long; a dead node is
#: noticed by ssh's keepalives (seconds), not by this.
CALL_TIMEOUT_S = 24 * 3600.0


class SyncView(Protocol):
    def note(self, text: str) -> None: ...
    def start(self, total_bytes: int) -> None: ...
    def advance(self, n: int) -> None: ...
    def done(self) -> None: ...


class _NullView:
    def note(self, text: str) -> None: ...
    def start(self, total_bytes: int) -> None: ...
    def advance(self, n: int) -> None: ...
    def done(self) -> None: ...


@dataclass(frozen=True, kw_only=True)
class SyncOptions:
    paths: tuple[str, ...] = ()
    #: Destination root on the nodes; None = the same path as here.
    to: str | None = None
    #: Without ``to``: where named parts of the project go (the cluster file's
    #: workdir); named trees outside the project keep their own path.
    project_to: str | None = None
    delete: bool = False
    #: Let ``--delete`` prune a directory its guard refuses (a home, ``/``, or
    #: a non-empty directory corral has not marked as a sync destination).
    force_delete: bool = False
    dry_run: bool = False
    #: Only compare (tree hashes, differing files); send nothing.
    check: bool = False
    #: "auto": chain large files when nodes reach each other; "off": always from the head.
    pipeline: str = "auto"
    pipeline_min_bytes: int = 64 * MiB
    connect_timeout: float = 10.0


@dataclass(frozen=True, kw_only=True)
class NodeResult:
    name: str
    copy: tuple[str, ...] = ()
    delete: tuple[str, ...] = ()
    bytes: int = 0
    hash: str = ""
    #: Files that still differ after the sync (or, for --check, that differ): path -> why.
    mismatch: Mapping[str, str] = field(default_factory=dict)
    skipped: str | None = None
    #: Destinations that are the same directory as on another node (a shared
    #: filesystem): destination -> that node, which was written to instead.
    shared: Mapping[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.mismatch


@dataclass(frozen=True, kw_only=True)
class SyncReport:
    units: tuple[tuple[str, str, int], ...]  # (source root, destination, files)
    head_hash: str
    nodes: Mapping[str, NodeResult]
    mode: str  # "up to date", "star", "chain+star", "dry run", "check"
    notes: tuple[str, ...] = ()
    duration_s: float = 0.0
    bytes_sent: int = 0

    @property
    def ok(self) -> bool:
        return all(n.ok for n in self.nodes.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "units": [{"source": s, "dest": d, "files": n} for s, d, n in self.units],
            "tree_hash": self.head_hash,
            "mode": self.mode,
            "ok": self.ok,
            "notes": list(self.notes),
            "duration_s": round(self.duration_s, 3),
            "bytes_sent": self.bytes_sent,
            "nodes": {
                n: {
                    "hash": r.hash,
                    "copy": list(r.copy),
                    "delete": list(r.delete),
                    "bytes": r.bytes,
                    "mismatch": dict(r.mismatch),
                    "skipped": r.skipped,
                    "shared_with": dict(r.shared),
                }
                for n, r in self.nodes.items()
            },
        }


#: What to do about the node's names for a destination it cannot use
#: (``nodetree``'s error kinds).
_HINTS = {
    "dest-permission": "the login user cannot write there: pick a destination it can write "
                       "(--to ~/proj), or have the directory made there with that user as its "
                       "owner (`sudo install -d -o USER DIR`)",
    "dest-link": "remove the link on the node (`rm LINK` removes the link, not what it points to) "
                 "and sync again, or sync into the link's target directly (--to)",
    "nospace": "free space on {host} (`df -h` there), or sync to another disk (--to); the partial "
               "file was removed",
    "readonly": "the destination on {host} is on a read-only file system (a read-only mount, or one "
                "the kernel remounted after disk errors: `dmesg` there); pick a writable --to",
}
#: Failures of a chain hop that a second try from this machine would repeat.
_FINAL = frozenset(_HINTS) | {"dest-path"}


def hinted(problem: HostError) -> HostError:
    """``problem`` with the hint for its kind, when it has none."""
    hint = _HINTS.get(problem.kind)
    if problem.hint or hint is None:
        return problem
    prefix = f"{problem.host}: "
    text = problem.message[len(prefix):] if problem.message.startswith(prefix) else problem.message
    return HostError(problem.host, text, hint=hint.format(host=problem.host), kind=problem.kind)


def combined(hashes: list[str]) -> str:
    if len(hashes) == 1:
        return hashes[0]
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


class Syncer:
    """One sync of ``cluster`` (see the module docstring for the steps)."""

    def __init__(
        self, cluster: Cluster, options: SyncOptions, *, cwd: Path, view: SyncView | None = None
    ):
        self.cluster = cluster
        self.options = options
        self.cwd = cwd
        self.view = view or _NullView()
        self.notes: list[str] = []
        self.sent = 0
        self._probe: asyncio.Task | None = None
        #: Set when the sync ends or is cancelled: the head's hashing thread stops.
        self._stop = threading.Event()
        #: Nodes whose chain hop failed for good (a full disk): not retried.
        self._failed: dict[str, HostError] = {}
        #: node -> {destination: the node written to instead} (``_share``).
        self._shared: dict[str, dict[str, str]] = {}
        self._unprobe: asyncio.Task | None = None

    def _note(self, text: str) -> None:
        self.notes.append(text)
        self.view.note(text)

    async def call(
        self, host: Host, fn: str, args: dict[str, Any], *, timeout: float = CALL_TIMEOUT_S
    ) -> Any:
        remote = remote_command(host.python)
        argv = (
            remote
            if host.local
            else ssh_argv(self.cluster, host, remote, connect_timeout=self.options.connect_timeout)
        )
        return await call_node(host, argv, "nodetree", _SOURCE, fn, args, timeout=timeout)

    # -- steps -------------------------------------------------------------------

    async def run(self) -> SyncReport:
        try:
            return await self._run()
        finally:
            # Cancelled (Ctrl-C): the hashing thread cannot be cancelled, and
            # asyncio.run waits for it before corral exits; it stops at its
            # next chunk instead of at the end of a large tree.
            self._stop.set()
            if self._unprobe is not None and not self._unprobe.done():
                # a failed transfer: the nodes' probe files still go (2 s at most)
                await asyncio.wait([self._unprobe], timeout=2.0)
            for task in (self._probe, self._unprobe):
                if task is not None and not task.done():
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> SyncReport:
        t0 = time.monotonic()
        units = await asyncio.to_thread(
            filelist.build_units, self.cwd, self.options.paths, self.options.to, self.options.project_to
        )
        log.debug("%.2fs: file list (%d unit(s))", time.monotonic() - t0, len(units))
        hosts = [h for h in self.cluster.hosts if not self._is_source(h, units)]
        readonly = self.options.dry_run or self.options.check
        # Three things at once: hashing here, the nodes describing their trees,
        # and (when large files may need streaming) proving node-to-node logins.
        if not readonly and self._may_stream(units, hosts):
            pairs = list(
                zip([h for h in hosts if not h.local], [h for h in hosts if not h.local][1:])
            )
            self._probe = asyncio.create_task(pipeline.reachable(self.cluster, pairs))
        heads, before = await asyncio.gather(
            asyncio.to_thread(
                lambda: [nodetree.manifest(str(u.root), list(u.paths), stop=self._stop) for u in units]
            ),
            self._status(hosts, units, scope=self.options.delete, dry_run=readonly, marks=True),
        )
        self._guard(hosts, before)
        log.debug("%.2fs: manifest here, status of %d node(s)", time.monotonic() - t0, len(hosts))
        head_hash = combined([h["hash"] for h in heads])
        skipped = {
            h.name: NodeResult(
                name=h.name, hash=head_hash, skipped="this machine: the source itself"
            )
            for h in self.cluster.hosts
            if h not in hosts
        }
        plans = {h.name: self._plan(h, units, heads, before[h.name]) for h in hosts}
        unit_info = tuple((str(u.root), u.dest, len(u.paths)) for u in units)
        if readonly:
            nodes = {
                **skipped,
                **{n: self._readonly_result(n, p, before[n]) for n, p in plans.items()},
            }
            return SyncReport(
                units=unit_info,
                head_hash=head_hash,
                nodes=nodes,
                mode="check" if self.options.check else "dry run",
                notes=tuple(self.notes),
                duration_s=time.monotonic() - t0,
            )
        work = [h for h in hosts if plans[h.name]["copy_n"] or plans[h.name]["delete_n"]]
        mode = "up to date"
        after: dict[str, list[dict]] = {}
        if work:
            send = await self._share(work, units, heads, plans) if len(work) > 1 else work
            await self._delete(send, units, plans)
            mode = await self._transfer(send, units, heads, plans)
            if self._unprobe is not None:
                await self._unprobe
            log.debug("%.2fs: transfer (%s)", time.monotonic() - t0, mode)
            after = await self._status(work, units, scope=False, dry_run=False)
            log.debug("%.2fs: verified", time.monotonic() - t0)
        nodes = dict(skipped)
        for h in hosts:
            status = after.get(h.name, before[h.name])
            mismatch = {
                f"{u.dest}/{p}": why
                for u, hd, s in zip(units, heads, status)
                for p, why in nodetree.differ(hd["entries"], s["entries"]).items()
            }
            plan = plans[h.name]
            nodes[h.name] = NodeResult(
                name=h.name,
                copy=tuple(plan["copy"]),
                delete=tuple(plan["delete"]),
                bytes=plan["bytes"],
                hash=combined([s["hash"] for s in status]),
                mismatch=mismatch,
                shared=self._shared.get(h.name, {}),
            )
        return SyncReport(
            units=unit_info,
            head_hash=head_hash,
            nodes=nodes,
            mode=mode,
            notes=tuple(self.notes),
            duration_s=time.monotonic() - t0,
            bytes_sent=self.sent,
        )

    def _may_stream(self, units: list[Unit], hosts: list[Host]) -> bool:
        """Could any file need the chain?  (A stat per file; no hashing.)"""
        if self.options.pipeline == "off" or len([h for h in hosts if not h.local]) < 2:
            return False
        for u in units:
            for rel in u.paths:
                try:
                    if (u.root / rel).lstat().st_size >= self.options.pipeline_min_bytes:
                        return True
                except OSError:
                    continue
        return False

    def _is_source(self, host: Host, units: list[Unit]) -> bool:
        return host.local and all(u.dest == str(u.root) for u in units)

    async def _status(
        self, hosts: list[Host], units: list[Unit], *, scope: bool, dry_run: bool,
        marks: bool = False,
    ) -> dict[str, list[dict]]:
        payload = [
            {"root": u.dest, "paths": list(u.paths), "scope": list(u.scope) if scope else None,
             "marks": list(u.scope) if marks else []}
            for u in units
        ]
        args = {"units": payload, "dry_run": dry_run,
                "mark_all": self.options.delete and self.options.force_delete,
                "guarded": self.options.delete and not self.options.force_delete}
        values, problems = await gather_hosts(hosts, lambda host: self.call(host, "status", args))
        if problems:
            raise PreflightError([hinted(p) for p in problems], what="sync")
        return values

    def _guard(self, hosts: list[Host], before: dict[str, list[dict]]) -> None:
        """``--delete`` only prunes directories that are recognisably synced
        projects: never ``/`` or a home (``--to ~ --delete`` would remove
        ~/.ssh), never a non-empty directory corral has not marked -- unless
        ``--force-delete``.  Dry runs are refused the same way."""
        if not self.options.delete or self.options.force_delete:
            return
        problems = []
        for h in hosts:
            for st in before[h.name]:
                for g in st.get("guard") or []:
                    if not nodetree.refused(g):
                        continue
                    if g["danger"]:
                        why = (f"{g['danger']}: it would remove every file there that is not in the "
                               "synced tree")
                    else:
                        why = (f"it is not empty and corral has not synced to it before (no "
                               f"{nodetree.MARKER} file there)")
                    problems.append(HostError(
                        h.name, f"refusing --delete in {g['path']}: {why}",
                        hint="check --to (or the cluster file's workdir); if that directory really "
                             "holds this project's copy, add --force-delete (corral then marks it, "
                             "and later --delete runs need no flag)",
                        kind="delete-guard"))
        if problems:
            raise PreflightError(problems, what="sync --delete")

    def _plan(
        self, host: Host, units: list[Unit], heads: list[dict], status: list[dict]
    ) -> dict[str, Any]:
        copy: list[tuple[int, str]] = []
        delete: list[tuple[int, str]] = []
        size = 0
        for i, (unit, head, st) in enumerate(zip(units, heads, status)):
            for rel in sorted(nodetree.differ(head["entries"], st["entries"])):
                copy.append((i, rel))
                size += head["entries"][rel][2]
            if self.options.delete and st["extra"]:
                keep = filelist.protected(unit, st["extra"])
                delete += [(i, p) for p in st["extra"] if p not in keep]
        return {
            "copy_pairs": copy,
            "delete_pairs": delete,
            "copy_n": len(copy),
            "delete_n": len(delete),
            "copy": [f"{units[i].dest}/{p}" for i, p in copy],
            "delete": [f"{units[i].dest}/{p}" for i, p in delete],
            "bytes": size,
            # where each unit is on this node: `~/proj` is its own home there
            "dests": [st.get("path") or unit.dest for unit, st in zip(units, status)],
        }

    def _readonly_result(self, name: str, plan: dict, status: list[dict]) -> NodeResult:
        mismatch = {p: "differs" for p in plan["copy"]}
        if self.options.check:
            mismatch.update({p: "extra" for p in plan["delete"]})
        return NodeResult(
            name=name,
            copy=tuple(plan["copy"]),
            delete=tuple(plan["delete"]),
            bytes=plan["bytes"],
            hash=combined([s["hash"] for s in status]),
            mismatch=mismatch if self.options.check else {},
        )

    async def _delete(self, hosts: list[Host], units: list[Unit], plans: dict) -> None:
        async def one(host: Host) -> None:
            for i, unit in enumerate(units):
                paths = [p for j, p in plans[host.name]["delete_pairs"] if j == i]
                if paths:
                    await self.call(host, "delete", {"root": unit.dest, "paths": paths})

        _, problems = await gather_hosts([h for h in hosts if plans[h.name]["delete_n"]], one)
        if problems:
            raise PreflightError(problems, what="sync --delete")

    # -- shared destinations ------------------------------------------------------

    async def _share(
        self, hosts: list[Host], units: list[Unit], heads: list[dict], plans: dict
    ) -> list[Host]:
        """The hosts to write to: one per directory several of ``hosts`` share.

        Each node probes (``nodedest.share_probe``); ``shared.assign`` groups
        the answers and drops the other members' plans.  The probes are
        removed while the files travel."""
        token = os.urandom(8).hex()
        index = {h.name: i for i, h in enumerate(hosts)}

        def roots(host: Host) -> list[str]:
            return list(plans[host.name]["dests"])

        answers, problems = await gather_hosts(hosts, lambda h: self.call(
            h, "share_probe", {"roots": roots(h), "token": token, "index": index[h.name],
                               "count": len(hosts)}))
        self._unprobe = asyncio.create_task(gather_hosts(hosts, lambda h: self.call(
            h, "share_unprobe", {"roots": roots(h), "token": token, "index": index[h.name]})))
        if problems:
            raise PreflightError([hinted(p) for p in problems], what="sync")
        for note in shared.assign([h.name for h in hosts], units, heads, plans, answers, self._shared):
            self._note(note)
        return [h for h in hosts if plans[h.name]["copy_pairs"] or plans[h.name]["delete_pairs"]]

    # -- transfer ----------------------------------------------------------------

    async def _transfer(
        self, hosts: list[Host], units: list[Unit], heads: list[dict], plans: dict
    ) -> str:
        total = sum(plans[h.name]["bytes"] for h in hosts)
        self.view.start(total)
        chained: dict[str, set[tuple[int, str]]] = {h.name: set() for h in hosts}
        mode = "star"
        try:
            large = self._large_files(hosts, heads, plans)
            if large and await self._chain_ok(hosts, large):
                mode = "chain+star"
                for (i, rel), chain in large.items():
                    log.debug("streaming %s along %s", rel, [h.name for h in chain])
                    ok = await self._chain_one(chain, units[i], heads[i], rel)
                    log.debug("streamed %s: ok on %s", rel, ok)
                    for name in ok:
                        chained[name].add((i, rel))

            def progress(n: int) -> None:
                self.sent += n
                self.view.advance(n)

            async def star(host: Host) -> None:
                for i, unit in enumerate(units):
                    paths = [
                        p
                        for j, p in plans[host.name]["copy_pairs"]
                        if j == i and (j, p) not in chained[host.name]
                    ]
                    await rsync.send(
                        self.cluster, host, str(unit.root), plans[host.name]["dests"][i], paths,
                        on_bytes=progress,
                    )

            _, problems = await gather_hosts([h for h in hosts if h.name not in self._failed], star)
        finally:
            self.view.done()
        problems = [*self._failed.values(), *problems]
        if problems:
            raise PreflightError(problems, what="sync")
        return mode

    def _large_files(
        self, hosts: list[Host], heads: list[dict], plans: dict
    ) -> dict[tuple[int, str], list[Host]]:
        """Files worth streaming: large, regular, needed by two nodes or more."""
        if self.options.pipeline == "off":
            return {}
        need: dict[tuple[int, str], list[Host]] = {}
        for h in hosts:
            for i, rel in plans[h.name]["copy_pairs"]:
                kind, _, size, _ = heads[i]["entries"][rel]
                if kind == "f" and size >= self.options.pipeline_min_bytes and not h.local:
                    need.setdefault((i, rel), []).append(h)
        return {k: v for k, v in need.items() if len(v) >= 2}

    async def _chain_ok(self, hosts: list[Host], large: dict[tuple[int, str], list[Host]]) -> bool:
        """Can every node of every chain log in to the next one?  Says so either way."""
        pairs = list(
            dict.fromkeys((a, b) for chain in large.values() for a, b in itertools.pairwise(chain))
        )
        verdicts = await self._probe if self._probe is not None else {}
        missing = [(a, b) for a, b in pairs if f"{a.name} -> {b.name}" not in verdicts]
        if missing:
            verdicts = {**verdicts, **await pipeline.reachable(self.cluster, missing)}
        bad = [
            (f"{a.name} -> {b.name}", verdicts[f"{a.name} -> {b.name}"])
            for a, b in pairs
            if verdicts[f"{a.name} -> {b.name}"] != "ok"
        ]
        if bad:
            hop, why = bad[0]
            self._note(
                f"nodes cannot log in to each other ({hop}: {why}); large files go from this "
                "machine to each node (star). `corral ssh setup` enables node-to-node streaming"
            )
            return False
        longest = max(large.values(), key=len)
        self._note(
            "large files stream node to node: " + " -> ".join(["here"] + [h.name for h in longest])
        )
        return True

    async def _chain_one(self, chain: list[Host], unit: Unit, head: dict, rel: str) -> list[str]:
        """Stream one file along ``chain``; the nodes that got it (the rest fall back to rsync)."""
        _kind, mode, size, digest = head["entries"][rel]
        mtime_ns = (unit.root / rel).stat().st_mtime_ns
        got: dict[str, int] = {}

        def progress(node: str, n: int) -> None:
            got[node] = got.get(node, 0) + n
            self.sent += n
            self.view.advance(n)

        results = await pipeline.stream(
            self.cluster,
            chain,
            unit.root / rel,
            unit.dest,
            rel,
            size,
            digest,
            mode,
            mtime_ns,
            on_bytes=progress,
        )
        ok = [n for n, r in results.items() if r.ok]
        failed = {n: r for n, r in results.items() if not r.ok}
        for n, r in failed.items():
            self.sent -= got.get(n, 0)
            self.view.advance(-got.get(n, 0))
            if r.kind in _FINAL:
                self._failed[n] = hinted(HostError(n, r.error or r.kind, kind=r.kind))
                continue
            self._note(
                f"{n}: streaming {rel} failed ({r.error}); sending it from this machine instead"
            )
        return ok


async def sync(
    cluster: Cluster, options: SyncOptions, *, cwd: Path, view: SyncView | None = None
) -> SyncReport:
    """Sync and verify; raises ``PreflightError`` naming every node that differs afterwards."""
    report = await Syncer(cluster, options, cwd=cwd, view=view).run()
    if not options.dry_run and not report.ok:
        raise PreflightError(
            [mismatch_error(r, report.head_hash) for r in report.nodes.values() if not r.ok],
            what="sync verification" if not options.check else "sync check",
        )
    return report


def mismatch_error(result: NodeResult, head_hash: str) -> HostError:
    items = sorted(result.mismatch.items())
    shown = ", ".join(f"{p} ({why})" for p, why in items[:3]) + (
        f" and {len(items) - 3} more" if len(items) > 3 else ""
    )
    return HostError(
        result.name,
        f"tree hash {result.hash[:12]} differs from this machine's {head_hash[:12]}: "
        f"{len(items)} file(s) differ: {shown}",
        hint="run `corral sync` again; if it persists, something on that node changes the files "
        "(a job writing into the synced tree?) or the disk is full",
        kind="sync-mismatch",
    )
