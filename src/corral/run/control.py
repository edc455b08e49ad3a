"""Reaching a running job from outside its head process: `corral stacks RUN`.

The head of a run listens on a unix socket (job-scoped, mode 0600, in a
private 0700 directory); ``corral stacks`` sends one request line and reads
one JSON answer.  Only the user who started the run can connect.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from corral.agent.private import UnsafePlace, existing_private_dir, private_dir, runtime_dir
from corral.agent.session import AgentPool
from corral.diagnose.stacks import (
    StackKey,
    dump_title,
    never_met_note,
    parse_key,
    rendezvous_note,
    stack_order,
    stack_report,
)
from corral.errors import CorralError
from corral.run.plan import STACK_SIGNAL, LaunchPlan

#: sun_path is 108 bytes on Linux (104 on the BSDs), with the final NUL.
_SUN_PATH_MAX = 100


def control_path(run_id: str) -> Path:
    """Where this run's head listens: a private directory, a path short enough
    for a unix socket.  ``corral stacks`` reads the path from run.json.

    ``$XDG_RUNTIME_DIR`` (the user's own, made by the login) when there is
    one; else ``corral-<uid>/ctl`` in the temp dir, made 0700 or checked
    (ours, not a symbolic link, writable only by us): another user can make
    that name first in a shared /tmp.  A long ``$TMPDIR`` (some HPC sites set
    one per job) would overflow sun_path, so /tmp is used then."""
    name = f"{run_id}.sock"
    for base, path in _control_dirs():
        if len(os.fsencode(path / name)) > _SUN_PATH_MAX:
            continue
        try:
            private_dir(str(path), str(base))
        except UnsafePlace as e:
            raise CorralError(f"no safe directory for this run's control socket: {e}", hint=e.hint) from None
        except OSError:
            continue
        return path / name
    raise CorralError(
        f"no directory for this run's control socket: {Path(tempfile.gettempdir())} gives a path over "
        f"{_SUN_PATH_MAX} bytes and /tmp is not writable",
        hint="set TMPDIR to a short writable directory, e.g. TMPDIR=/tmp")


def _control_dirs() -> list[tuple[Path, Path]]:
    """(shared place, control directory in it), in the order they are tried."""
    out = []
    runtime = runtime_dir()
    if runtime:
        out.append((Path(runtime), Path(runtime) / "corral" / "ctl"))
    for tmp in (tempfile.gettempdir(), "/tmp"):
        out.append((Path(tmp), Path(tmp) / f"corral-{os.getuid()}" / "ctl"))
    return out


def live_controls() -> dict[str, Path]:
    """Run id -> control socket of every run of this user whose head is
    listening now, wherever it was started (its run directory is under the
    directory `corral run` was started in, which another shell may not be in).
    Only from directories that pass ``private_dir``'s checks: a socket in
    another user's directory could be theirs."""
    found: dict[str, Path] = {}
    for tmp, base in _control_dirs():
        try:
            if not existing_private_dir(str(base), str(tmp)):
                continue
        except UnsafePlace as e:
            raise CorralError(f"not looking for runs' control sockets there: {e}", hint=e.hint) from None
        except OSError:
            continue
        for path in sorted(base.glob("*.sock")):
            run_id = path.name[: -len(".sock")]
            if run_id in found:
                continue
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(1.0)
            try:
                s.connect(str(path))
            except OSError:
                continue  # left behind by a head that was killed
            finally:
                s.close()
            found[run_id] = path
    return found


async def collect_stacks(pool: AgentPool, timeout: float = 3.0, *,
                         unanswered: list[str] | None = None) -> dict[StackKey, str]:
    """faulthandler dumps of every rank on every node: {global rank: text},
    and of the Python processes ranks started themselves: {(rank, pid): text}.
    Hosts whose agent did not answer (lost, partitioned) are added to
    ``unanswered``, so their ranks are not called "not a Python rank"."""

    async def one(s) -> dict[str, str]:
        try:
            # `timeout` here bounds the call; the node waits up to its own 3 s for the dumps.
            return await s.call("node.stacks", sig=STACK_SIGNAL, timeout=timeout + 10) or {}
        except Exception:  # noqa: BLE001 - a lost node simply has no stacks
            if unanswered is not None:
                unanswered.append(s.name)
            return {}

    if unanswered is not None:
        unanswered.extend(s.name for s in pool.sessions if s.closed)

    answers = await asyncio.gather(*(one(s) for s in pool.sessions if not s.closed))
    out: dict[StackKey, str] = {}
    for answer in answers:
        out.update({parse_key(k): v for k, v in answer.items()})
    return out


def ranks_of(plan: LaunchPlan, hosts: list[str]) -> dict[int, str]:
    """rank -> host, for the ranks of ``hosts`` (nodes that did not answer)."""
    return {r: n.host.name for n in plan.nodes if n.host.name in hosts for r in n.ranks}


@dataclass(frozen=True, kw_only=True)
class StackSnapshot:
    """Every rank's stack at one moment: the merged tree, the odd ranks out,
    a note on the rendezvous when there is one, and the file it was saved to."""

    dumps: dict[StackKey, str]
    lines: list[str]
    odd: set[StackKey]
    note: str | None
    path: Path


async def stack_snapshot(pool: AgentPool, plan: LaunchPlan, run_dir: Path) -> StackSnapshot:
    """Collect, merge and save (``run_dir/stacks-<time>.txt``: the tree, the
    note, then every raw dump) every rank's stack: for a hang and for a
    quiet stretch alike."""
    unanswered: list[str] = []
    dumps = await collect_stacks(pool, unanswered=unanswered)
    lines, odd = stack_report(dumps, plan.world_size, unanswered=ranks_of(plan, unanswered))
    note = (rendezvous_note(dumps, plan.master_addr, plan.master_port)
            or never_met_note(dumps, plan.world_size))
    path = run_dir / f"stacks-{time.strftime('%H%M%S')}.txt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with open(fd, "w") as f:
        f.write("\n".join(lines + ([note] if note else [])) + "\n\n" + "\n".join(
            f"===== {dump_title(k)} =====\n{t}" for k, t in sorted(dumps.items(), key=lambda kv: stack_order(kv[0]))))
    return StackSnapshot(dumps=dumps, lines=lines, odd=odd, note=note, path=path)


Handler = Callable[[str], Awaitable[dict]]


async def serve(path: Path, handler: Handler) -> asyncio.base_events.Server:
    """Answer one JSON line per connection; the request is one word."""

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                request = (await asyncio.wait_for(reader.readline(), 5)).decode().strip()
                if not request:
                    return  # connected and left: a liveness probe (`corral stacks` looking for runs)
                answer = await handler(request)
            except Exception as e:  # noqa: BLE001 - report to the client, keep serving
                answer = {"error": f"{type(e).__name__}: {e}"}
            writer.write((json.dumps(answer) + "\n").encode())
            await writer.drain()
        except (ConnectionError, OSError):
            pass  # the client left before its answer (Ctrl-C on `corral stacks`): not the run's problem
        finally:
            writer.close()

    if path.exists():
        path.unlink()
    server = await asyncio.start_unix_server(client, path=str(path))
    os.chmod(path, 0o600)
    return server


def request(path: str, what: str, timeout: float = 30.0) -> dict:
    """Client side: send ``what``, return the JSON answer."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(path)
    except OSError as e:
        raise CorralError(f"cannot reach the run's head process at {path}: {e.strerror}",
                          hint="is the run still running? `corral runs` lists runs and their status") from None
    with s:
        s.sendall((what + "\n").encode())
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data or b"{}")
