"""Run one shell command on every host at once (what people use pdsh for).

Each host gets the command through the same transport as everything else
(ssh with the user's config and connection multiplexing, or locally), with
bounded parallelism.  Results are per host (exit code, output, or a named
connection error) instead of an exception on the first failure, so one
dead node never hides the other sixty-three answers.

The command runs under a tiny POSIX-sh wrapper in its own session.  When the
head goes away (Ctrl-C, a crash, a closed connection) the wrapper sees its
stdin close and kills the command's whole process group: no orphan is left
behind on a node, without needing Python there.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from corral.errors import HostError
from corral.model import Cluster, Host
from corral.transport import transport_for

log = logging.getLogger(__name__)

#: One line, no "!" and no newlines inside quotes: safe under sh, bash, zsh
#: and csh login shells.  The command runs in its own session (setsid); a
#: watcher reads the channel (fd 3); at EOF it signals the wrapper, which
#: TERMs, then KILLs, that session (``pkill -s``: the session id, never a
#: name; the shells' builtin ``kill`` cannot signal a group, and procps'
#: ``kill -- -PGID`` misparses small ids).  Without setsid/pkill it falls
#: back to the command's own pid.
WRAPPER = (
    "exec 3<&0; "
    'if command -v setsid >/dev/null 2>&1; then setsid sh -c "$1" </dev/null & '
    'else sh -c "$1" </dev/null & fi; '
    "c=$!; "
    "trap 'pkill -TERM -s $c 2>/dev/null; kill -TERM $c 2>/dev/null; sleep 2; "
    "pkill -KILL -s $c 2>/dev/null; kill -KILL $c 2>/dev/null; exit 143' USR1; "
    "( while read -r _ <&3; do :; done; kill -s USR1 $$ ) & "
    "w=$!; wait $c; r=$?; kill $w 2>/dev/null; exit $r"
)


@dataclass(frozen=True, kw_only=True)
class HostResult:
    """What one host answered."""

    host: str
    returncode: int
    stdout: str = ""
    stderr: str = ""
    #: Set when the host could not be reached or the command could not run.
    error: HostError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.returncode == 0


def remote_argv(command: str) -> list[str]:
    return ["sh", "-c", WRAPPER, "corral-exec", command]


LineCallback = Callable[[str, str, str], None]  # (host, stream, line)


async def _one(cluster: Cluster, host: Host, command: str, timeout: float | None,
               connect_timeout: float, on_line: LineCallback | None) -> HostResult:
    transport = transport_for(cluster, host, connect_timeout=connect_timeout)
    argv = transport.argv(host, remote_argv(command))
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, start_new_session=True,
        )
        # No PR_SET_PDEATHSIG here (it would force the slow fork path): if corral
        # dies, its end of this stdin pipe closes, ssh forwards the EOF and the
        # remote wrapper stops the command all the same.
    except FileNotFoundError as e:
        err = HostError(host.name, f"cannot run {argv[0]!r}: {e.strerror}")
        return HostResult(host=host.name, returncode=255, error=err)

    async def read(stream: asyncio.StreamReader, name: str, sink: list[str]) -> None:
        async for raw in stream:
            text = raw.decode(errors="replace")
            sink.append(text)
            if on_line is not None:
                on_line(host.name, name, text.rstrip("\n"))

    out: list[str] = []
    err: list[str] = []
    readers = asyncio.gather(read(proc.stdout, "out", out), read(proc.stderr, "err", err))  # type: ignore[arg-type]
    timed_out = False
    try:
        await asyncio.wait_for(proc.wait(), timeout)
    except asyncio.TimeoutError:
        timed_out = True
        await _close(proc)
    except asyncio.CancelledError:
        await _close(proc)
        raise
    finally:
        await asyncio.gather(readers, return_exceptions=True)
        if proc.stdin is not None and not proc.stdin.is_closing():
            proc.stdin.close()
    rc = proc.returncode if proc.returncode is not None else 255
    stdout, stderr = "".join(out), "".join(err)
    if timed_out:
        error = HostError(host.name, f"did not finish within {timeout:.0f}s; stopped it",
                          hint="raise --timeout if the command is expected to take longer", kind="timeout")
        return HostResult(host=host.name, returncode=124, stdout=stdout, stderr=stderr, error=error)
    if rc == 255 and not host.local:
        # ssh's own failure (the remote command's 255 is rare and reads the same).
        return HostResult(host=host.name, returncode=rc, stdout=stdout, stderr=stderr,
                          error=transport.failure(host, rc, stderr))
    return HostResult(host=host.name, returncode=rc, stdout=stdout, stderr=stderr)


async def _close(proc: asyncio.subprocess.Process) -> None:
    """Close stdin (the remote wrapper kills its group), then make sure ssh is gone."""
    if proc.stdin is not None and not proc.stdin.is_closing():
        proc.stdin.close()
    try:
        await asyncio.wait_for(proc.wait(), 5)  # TERM, 2 s, KILL on the node
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()


async def run_everywhere(
    cluster: Cluster,
    command: str,
    *,
    timeout: float | None = None,
    fanout: int = 64,
    connect_timeout: float = 10.0,
    on_line: LineCallback | None = None,
) -> list[HostResult]:
    """``command`` (a shell command line) on every host; results in host order."""
    sem = asyncio.Semaphore(max(1, fanout))

    async def bounded(h: Host) -> HostResult:
        async with sem:
            return await _one(cluster, h, command, timeout, connect_timeout, on_line)

    tasks = [asyncio.ensure_future(bounded(h)) for h in cluster.hosts]
    try:
        return list(await asyncio.gather(*tasks))
    except asyncio.CancelledError:
        # Let every host's teardown finish (close its channel, reap ssh)
        # before the caller's event loop goes away.
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def command_line(words: tuple[str, ...]) -> str:
    """Words after ``--`` as one shell command line, like ssh and pdsh join them."""
    return " ".join(words)


__all__ = ["HostResult", "run_everywhere", "command_line", "remote_argv"]
