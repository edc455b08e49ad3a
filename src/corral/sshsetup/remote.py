"""One-shot calls of a stdlib Python function on a node, over the system ssh.

``ssh setup`` and ``sync`` need a handful of small node-side operations
(inspect ~/.ssh, rewrite a marked block, hash a file tree) on machines where
corral is not installed, and some of them before key login works (over a
password connection).  The long-lived node agent is the wrong tool for that:
it always uses ``BatchMode`` and lives for a whole job.  This module sends a
self-contained stdlib module and the name of one function on ssh's stdin,
runs it with the node's own ``python3`` and reads one JSON result back::

    argv = ssh_argv(cluster, host, remote_command(host.python))
    value = await call_node(host, argv, "sshsetup", SOURCE, "inspect", {"cluster_id": "x"})

The remote command line is short and fixed (``python3 -c BOOT``); the
module, the arguments and, for streaming calls, the data follow on stdin.
The result is the last line that starts with a marker, so a chatty login
shell (``echo`` in .bashrc) cannot corrupt it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shlex
from collections.abc import Callable, Sequence
from typing import Any

from corral import streams
from corral.errors import HostError
from corral.model import Cluster, Host
from corral.transport.ssh import SSHTransport, classify_ssh_failure, client_env, python_hint

log = logging.getLogger(__name__)

#: Prefix of the result line; anything else on stdout is noise (or progress).
MARK = "@@corral-result@@"

#: The largest answer a call reads (a tree's file list for sync: about 100
#: bytes a file).
MAX_ANSWER = 256 * 1024 * 1024

# Runs from the payload, so it can be longer than an argv and checked.
_BOOT = r"""
import json, sys
if sys.version_info < (3, 8):
    _e = "corral needs Python 3.8+ on the node, found " + sys.version.split()[0]
    sys.stdout.write("\n@@corral-result@@" + json.dumps({"error": _e, "kind": "python"}) + "\n")
    raise SystemExit(3)
_g = {"__name__": "corral_node_" + _h["mod"], "_CORRAL_HEADER": _h}
exec(compile(_h["src"], "<corral:%s>" % _h["mod"], "exec"), _g)
try:
    _args = dict(_h["args"])
    if _h.get("stream"):
        _args["stream"] = _r
    _v = {"value": _g[_h["fn"]](**_args)}
except Exception as _e:
    _k = getattr(_e, "kind", None)  # node-side errors meant for the user carry a kind
    _v = {"error": str(_e) if _k else "%s: %s" % (type(_e).__name__, _e), "kind": _k or "error"}
sys.stdout.write("\n@@corral-result@@" + json.dumps(_v) + "\n")
sys.stdout.flush()
"""

#: The whole remote program as seen in ps: reads the payload, runs it (on
#: Python 2 too, so that an old ``python`` is named by version).
BOOT = (
    "import sys,json;_r=getattr(sys.stdin,'buffer',sys.stdin);_n=int(_r.readline());"
    "_h=json.loads(_r.read(_n).decode());exec(_h['boot'])"
)


class RemoteError(Exception):
    """The node-side function raised; ``kind`` is its error class's ``kind``."""

    def __init__(self, message: str, *, kind: str = "error"):
        super().__init__(message)
        self.kind = kind


def payload(
    module: str, source: str, fn: str, args: dict[str, Any], *, stream: bool = False
) -> bytes:
    """Length-prefixed JSON header: what goes on stdin before any data."""
    body = json.dumps(
        {"boot": _BOOT, "mod": module, "src": source, "fn": fn, "args": args, "stream": stream}
    ).encode()
    return str(len(body)).encode() + b"\n" + body


def remote_command(python: str) -> list[str]:
    """The remote argv: the node's interpreter running the bootstrap."""
    return [python, "-c", BOOT]


def ssh_argv(
    cluster: Cluster,
    host: Host,
    remote: Sequence[str],
    *,
    first: Sequence[str] = (),
    multiplex: bool = True,
    connect_timeout: float = 10.0,
) -> list[str]:
    """corral's usual ssh argv for ``host``, with ``first`` options in front.

    ssh keeps the *first* value it sees for each option, so options placed
    right after ``ssh`` override the user's and corral's defaults: this is
    how a password connection turns ``BatchMode`` off, and how a setup
    session pins ``UserKnownHostsFile`` to the host keys it verified.
    """
    transport = SSHTransport(cluster, connect_timeout=connect_timeout, multiplex=multiplex)
    argv = transport.argv(host, list(remote))
    return [argv[0], *first, *argv[1:]]


def parse_result(stdout: bytes) -> tuple[bool, Any]:
    """(found, decoded result object) from a call's stdout."""
    text = stdout.decode(errors="replace")
    idx = text.rfind(MARK)
    if idx < 0:
        return False, None
    line = text[idx + len(MARK) :].splitlines()[0] if text[idx + len(MARK) :] else ""
    try:
        return True, json.loads(line)
    except (ValueError, RecursionError):
        return False, None


async def call_node(
    host: Host,
    argv: list[str],
    module: str,
    source: str,
    fn: str,
    args: dict[str, Any],
    *,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
    failure: Callable[[Host, int, str], HostError] = classify_ssh_failure,
) -> Any:
    """Run ``fn(**args)`` from ``source`` on ``host`` through ``argv``; its value.

    Raises ``HostError`` (named by ``failure`` from ssh's exit code and
    stderr) when the connection fails, ``RemoteError`` when the function
    raised on the node.
    """
    log.debug("%s: %s %s(%s)", host.name, " ".join(shlex.quote(a) for a in argv), fn, list(args))
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=client_env(env),  # not the head's locale (SendEnv LANG LC_*)
            start_new_session=True,  # no tty: ssh never prompts on ours
        )
    except FileNotFoundError as e:
        raise HostError(
            host.name,
            f"cannot run {argv[0]!r}: {e.strerror}",
            hint="install the OpenSSH client (apt-get install openssh-client)",
        ) from None
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None

    async def feed() -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(payload(module, source, fn, args))
            await proc.stdin.drain()
        except (BrokenPipeError, ConnectionResetError):
            pass  # ssh ended first: its stderr says why
        finally:
            proc.stdin.close()

    async def answer() -> tuple[bytes, bytes]:
        # Bounded whatever the node prints: a login shell's output before the
        # answer is dropped as it arrives, and stderr's end is kept.
        out, err, _ = await asyncio.gather(
            streams.read_after_mark(proc.stdout, MARK.encode(), limit=MAX_ANSWER),
            streams.read_tail(proc.stderr),
            feed(),
        )
        await proc.wait()
        return out, err

    try:
        out, err = await asyncio.wait_for(answer(), timeout)
    except streams.AnswerTooLarge as e:
        proc.kill()
        await proc.wait()
        raise HostError(host.name, f"{fn}: the node's answer is too large ({e}; at most {MAX_ANSWER} bytes)",
                        hint="a bug in corral or a node sending more than it was asked for") from None
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise HostError(
            host.name, f"{fn} got no answer within {timeout:.0f}s", kind="timeout"
        ) from None
    except asyncio.CancelledError:  # Ctrl-C: the call stops with the command
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
        raise
    found, result = parse_result(out)
    if not found:
        raise failure(
            host,
            proc.returncode if proc.returncode is not None else -1,
            err.decode(errors="replace"),
        )
    if not isinstance(result, dict):
        raise HostError(host.name, f"{fn}: the node's answer is not an object (a protocol error)",
                        hint="a bug in corral, or something on that node writing into its channel")
    if "error" in result:
        raise RemoteError(str(result["error"])[:2000], kind=str(result.get("kind", "error")))
    return result.get("value")


async def gather_hosts(
    hosts: Sequence[Host], work: Callable[[Host], Any], *, limit: int = 32
) -> tuple[dict[str, Any], list[HostError]]:
    """Run ``work(host)`` (a coroutine) for every host, bounded; values and errors.

    ``RemoteError`` becomes a ``HostError`` naming the host, so callers
    report every failing node at once.
    """
    sem = asyncio.Semaphore(limit)

    async def one(host: Host) -> Any:
        async with sem:
            return await work(host)

    results = await asyncio.gather(*(one(h) for h in hosts), return_exceptions=True)
    values: dict[str, Any] = {}
    problems: list[HostError] = []
    for host, res in zip(hosts, results):
        if isinstance(res, HostError):
            problems.append(res)
        elif isinstance(res, RemoteError):
            old = res.kind == "python"  # the boot found an interpreter older than 3.8
            problems.append(HostError(host.name, str(res), hint=python_hint(host) if old else None,
                                      kind="no-python" if old else res.kind))
        elif isinstance(res, BaseException):
            raise res
        else:
            values[host.name] = res
    return values, problems
