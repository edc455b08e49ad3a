"""Run one of corral's own workload scripts on every node, through ``corral run``'s path.

The smoke test of ``corral doctor`` and the all-reduce of ``corral bench``
must exercise exactly what a user's job goes through (agents, preflight,
verified rendezvous address, torchrun, the cluster file's environment), so
they are launched by ``corral.run.runner.Runner`` like any script.  Only the
script's location is special: it is written into a private scratch
directory on each node for the run, and removed afterwards.

Rank 0 of the script prints marker lines (``CORRAL_SMOKE {...}``); the
head collects them, and keeps every other line for the failure report.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from corral.agent.session import AgentPool
from corral.doctor.workloads import script_text
from corral.errors import PreflightError
from corral.model import Cluster
from corral.run.options import RunOptions
from corral.run.plan import RunSpec
from corral.run.result import RunResult
from corral.run.runner import Runner

log = logging.getLogger(__name__)

#: Output lines kept for the report (every rank, every stream).
KEEP_LINES = 4000


@dataclass(frozen=True, kw_only=True)
class ScriptRun:
    """How one scripted run went."""

    result: RunResult | None
    #: Set when the run never started (a host unreachable, no common address...).
    preflight: PreflightError | None = None
    #: JSON objects rank 0 printed after the marker.
    marks: tuple[dict, ...] = ()
    #: ``(host, rank, text)`` of every output line kept.
    lines: tuple[tuple[str, int | None, str], ...] = ()
    timed_out: bool = False
    seconds: float = 0.0
    #: The run directory, kept when the run failed (else removed).
    run_dir: Path | None = None

    @property
    def succeeded(self) -> bool:
        return self.result is not None and self.result.status == "succeeded" and not self.timed_out


class _Capture:
    """A RunView that records lines instead of printing them."""

    def __init__(self, marker: str):
        self.marker = marker + " "
        self.lines: collections.deque = collections.deque(maxlen=KEEP_LINES)
        self.marks: list[dict] = []

    def line(self, host: str, rank: int | None, stream: str, text: str) -> None:
        if text.startswith(self.marker):
            try:
                self.marks.append(json.loads(text[len(self.marker):]))
                return
            except ValueError:
                pass
        self.lines.append((host, rank, text))

    def status(self, host: str, rank: int | None, text: str) -> None: ...
    def message(self, text: str) -> None:
        log.debug("run: %s", text)

    def stopping(self) -> None: ...
    def close(self) -> None: ...


async def run_workload(
    cluster: Cluster,
    script: str,
    *,
    marker: str,
    args: tuple[str, ...] = (),
    env: Mapping[str, str] | None = None,
    nproc: int | None = None,
    timeout: float,
    head_env: Mapping[str, str],
    head_cwd: str,
    connect_timeout: float = 10.0,
) -> ScriptRun:
    """Write ``script`` to every node, run it with torchrun through the Runner, clean up."""
    started = time.monotonic()
    pool = AgentPool(cluster, tag=f"corral-scratch-{script.split('.')[0]}",
                     connect_timeout=connect_timeout)
    try:
        await pool.open()
    except PreflightError as e:
        # A node that answered a moment ago is gone (it went down, its sshd
        # died): that is this run's result, for the caller's report, not an
        # error that throws the report away.
        return ScriptRun(result=None, preflight=e, marks=(), lines=(), timed_out=False,
                         seconds=time.monotonic() - started, run_dir=None)
    runs_dir = Path(tempfile.mkdtemp(prefix="corral-workload-"))
    capture = _Capture(marker)
    result: RunResult | None = None
    preflight: PreflightError | None = None
    timed_out = False
    dirs: dict[str, str] = {}
    try:
        dirs = await pool.call_all("links.scratch_write", lambda s: {"files": {script: script_text(script)}})
        # spare hosts too (the Runner holds them back): a spare must be as ready as the rest
        scratch = replace(cluster, hosts=tuple(h.with_(workdir=dirs[h.name], spare=False) for h in cluster.hosts))
        spec = RunSpec(program=script, args=args, launcher="torchrun", nproc_per_node=nproc,
                       env=dict(env or {}))
        runner = Runner(scratch, spec, RunOptions(runs_dir=runs_dir, connect_timeout=connect_timeout),
                        view=capture, head_env=head_env, head_cwd=head_cwd)
        result, preflight, timed_out = await _bounded(runner, timeout)
    finally:
        if dirs:
            try:
                await pool.call_all("links.scratch_remove", lambda s: {"path": dirs[s.name]}, timeout=30)
            except PreflightError as e:  # the run's own report says more
                log.debug("scratch cleanup: %s", e)
        await pool.close()
    ok = result is not None and result.status == "succeeded" and not timed_out
    run_dir = result.run_dir if result is not None else None
    if ok:
        shutil.rmtree(runs_dir, ignore_errors=True)
        run_dir = None
    elif run_dir is None:
        shutil.rmtree(runs_dir, ignore_errors=True)
    return ScriptRun(result=result, preflight=preflight, marks=tuple(capture.marks),
                     lines=tuple(capture.lines), timed_out=timed_out,
                     seconds=time.monotonic() - started, run_dir=run_dir)


async def _bounded(runner: Runner, timeout: float) -> tuple[RunResult | None, PreflightError | None, bool]:
    """Run, and stop the job (as Ctrl-C would) when it takes longer than ``timeout``."""
    task = asyncio.create_task(runner.run())
    try:
        return await asyncio.wait_for(asyncio.shield(task), timeout), None, False
    except asyncio.TimeoutError:
        runner.interrupt()
        try:
            return await task, None, True
        except PreflightError as e:
            return None, e, True
    except PreflightError as e:
        return None, e, False
