"""Detached jobs, head side: start one, reach it again, bring its run directory back.

``corral run --detach`` packs corral (``package``), sends the job to node 0
and starts its supervisor there (``corral.agent.jobs``, ``supervisor``),
and returns once every rank is in user code.  This machine keeps a stub in
its runs directory (``runs/<run-id>/run.json`` with a ``detached`` key,
and ``detached.json``: the cluster and node 0), so ``attach``, ``logs``,
``stop`` and ``runs`` find the job again; from another machine, ``-c
CLUSTER`` finds it on the nodes themselves.

Everything a node prints is untrusted: each call's output is one JSON
object a line, checked here (type, size) before anyone uses it.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from corral.agent.holds import clean_holding
from corral.agent.private import private_dir
from corral.errors import CorralError, HostError, UsageError
from corral.frames import MAX_LINE
from corral.model import Cluster, Host
from corral.run.logs import RUN_FILE
from corral.run.options import RunOptions
from corral.run.package import jobs_program, supervisor_package
from corral.run.plan import RunSpec
from corral.run.supervisor import cluster_from_json, cluster_to_json, job_document
from corral.transport import transport_for

#: The stub's file naming the cluster and node 0 of a detached run.
DETACHED_FILE = "detached.json"
#: Longest line of a node's answer read (a JSON event; a rank's line is at most MAX_LINE).
MAX_EVENT = MAX_LINE + 64 * 1024
#: Holdings (jobs' GPUs and ports) read from one node's answer, at most.
MAX_HOLDINGS = 256
#: A run directory's pack from a node, at most (bytes unpacked, per file).
MAX_SYNC_FILE = 1 << 34


class DetachError(CorralError):
    """A detached job could not be started or reached."""

    exit_code = 3
    category = "infrastructure"


@dataclass(frozen=True, kw_only=True)
class Detached:
    """Where a detached job lives: its cluster (as this machine reaches it) and node 0."""

    run_id: str
    cluster: Cluster
    #: The local stub directory, when this machine has one.
    stub: Path | None = None

    @property
    def host(self) -> Host:
        return self.cluster.hosts[0]


# ---------------------------------------------------------------------------
# calling a node


def _argv(cluster: Cluster, host: Host, op: str, args: tuple[str, ...]) -> tuple[list[str], dict | None]:
    transport = transport_for(cluster, host)
    return transport.argv(host, [host.python, "-c", jobs_program(), op, *args]), transport.env()


def node_events(cluster: Cluster, host: Host, op: str, *args: str, stdin: bytes | None = None,
                timeout: float | None = None, batches: bool = False) -> Iterator[dict]:
    """Run one node-side operation on ``host``; yield its events as they come.
    A node that cannot be reached is a HostError naming it (ssh's reason).
    A node sends lines in batches (``lines`` events, checked here); with
    ``batches`` they are yielded as such, else as one ``line`` event each."""
    argv, env = _argv(cluster, host, op, args)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    except OSError as e:
        raise HostError(host.name, f"cannot run {argv[0]!r}: {e.strerror}",
                        hint="install the OpenSSH client (apt-get install openssh-client), or fix the host's "
                             "`python` in the cluster file", kind="detach") from None
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        if stdin is not None:
            assert proc.stdin is not None
            try:
                proc.stdin.write(stdin)
                proc.stdin.close()
            except BrokenPipeError:
                pass
        assert proc.stdout is not None
        got = False
        for raw in iter(lambda: proc.stdout.readline(MAX_EVENT), b""):
            ev = _event(raw)
            if ev is not None:
                got = True
                if batches:
                    yield ev
                else:
                    yield from _lines(ev)
            if deadline is not None and time.monotonic() > deadline:
                break
        rc = proc.wait(timeout=10)
        err = proc.stderr.read(64 * 1024).decode(errors="replace") if proc.stderr else ""
        if rc != 0 and not got:
            raise transport_for(cluster, host).failure(host, rc, err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()


#: Lines one ``lines`` event may carry (the node sends at most 1,024).
MAX_BATCH = 4096


def _event(raw: bytes) -> dict | None:
    """One line of a node's answer, if it is a well-formed event."""
    try:
        ev = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(ev, dict) or not isinstance(ev.get("ev"), str):
        return None
    if ev["ev"] == "lines":
        t = ev.get("t")
        if not isinstance(t, list) or len(t) > MAX_BATCH or not all(isinstance(x, str) for x in t):
            return None
        return ev
    if "t" in ev and not isinstance(ev["t"], str):
        return None
    return ev


def _lines(ev: dict) -> Iterator[dict]:
    """A ``lines`` batch as the ``line`` events its readers take, one per line."""
    if ev["ev"] != "lines":
        yield ev
        return
    where = {k: v for k, v in ev.items() if k not in ("ev", "t")}
    for text in ev["t"]:
        yield {"ev": "line", **where, "t": text}


def node_call(cluster: Cluster, host: Host, op: str, *args: str, stdin: bytes | None = None,
              timeout: float = 30) -> list[dict]:
    return list(node_events(cluster, host, op, *args, stdin=stdin, timeout=timeout))


def raise_node_error(host: Host, ev: dict) -> None:
    if ev.get("ev") == "error":
        hint = ev.get("hint") if isinstance(ev.get("hint"), str) else None
        if ev.get("kind") == "old-python":
            hint = f"point `python` for {host.name} in the cluster file at a Python 3.10+ (or run without --detach)"
        raise HostError(host.name, str(ev.get("t"))[:2000], hint=hint, kind="detach")


# ---------------------------------------------------------------------------
# starting


def start(cluster: Cluster, spec: RunSpec, options: RunOptions, *, head_env, head_cwd: str,
          on_line: Callable[[str], None]) -> dict:
    """Start the supervisor on node 0 and pass its console on until every
    rank is in user code; return the last event (``ready``, or ``end`` when
    the job ended first)."""
    host = cluster.hosts[0]
    doc = job_document(cluster, spec, options, head_env=head_env, head_cwd=head_cwd)
    data, digest = supervisor_package()
    request = json.dumps({"pkg": digest, "job": doc}).encode()
    for _ in range(2):
        for ev in node_events(cluster, host, "launch", spec.run_id, stdin=request):
            raise_node_error(host, ev)
            kind = ev["ev"]
            if kind == "need_pkg":
                for put in node_call(cluster, host, "put", digest, stdin=data, timeout=300):
                    raise_node_error(host, put)
                break
            if kind == "line":
                on_line(ev["t"])
            elif kind in ("ready", "end"):
                return ev
        else:
            raise HostError(host.name, "the connection ended before its supervisor said the job started",
                            hint=f"`corral attach {spec.run_id}` shows what it does now", kind="detach")
    raise HostError(host.name, "corral's package could not be installed for the supervisor", kind="detach")


def write_stub(runs_dir: Path, cluster: Cluster, spec: RunSpec, started: float) -> Path:
    """This machine's record of a detached run (the job itself is on node 0)."""
    stub = runs_dir / spec.run_id
    runs_dir.mkdir(parents=True, exist_ok=True)
    stub.mkdir(mode=0o700)
    _write(stub / DETACHED_FILE, {"run_id": spec.run_id, "host": cluster.hosts[0].name,
                                   "cluster": cluster_to_json(cluster)})
    _write(stub / RUN_FILE, {"run_id": spec.run_id, "status": "running", "launcher": spec.launcher,
                             "program": spec.program, "args": list(spec.args), "started": started,
                             "detached": {"host": cluster.hosts[0].name}, "head": None})
    return stub


def mark_failed(stub: Path, why: str) -> None:
    """A detached start that never reached node 0's supervisor."""
    try:
        rec = json.loads((stub / RUN_FILE).read_text())
    except (OSError, ValueError):
        return
    rec.update(status="failed", ended=time.time(), failure={"description": why[:2000], "kind": "start"})
    _write(stub / RUN_FILE, rec)


def _write(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# finding one again


def from_stub(stub: Path) -> Detached | None:
    try:
        data = json.loads((stub / DETACHED_FILE).read_text())
        return Detached(run_id=data["run_id"], cluster=cluster_from_json(data["cluster"]), stub=stub)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def find(run: str, root: Path, cluster: Callable[[], Cluster] | None) -> Detached:
    """A detached run by id (or prefix) from this machine's stubs, else
    (given ``-c``) by its full id on the cluster's nodes."""
    from corral.run.history import list_runs

    stubs = [r for r in list_runs(root) if r.run_id.startswith(run) and (r.dir / DETACHED_FILE).is_file()]
    if len(stubs) > 1:
        raise UsageError(f"{run!r} matches {len(stubs)} detached runs", hint="give more of the run id")
    if stubs:
        found = from_stub(stubs[0].dir)
        if found is not None:
            return found
    if cluster is None:
        attended = [r for r in list_runs(root) if r.run_id.startswith(run)]
        why = "an attended run (its head is the terminal that started it)" if attended else "not found"
        raise UsageError(f"no detached run {run!r} in {root}: {why}",
                         hint="give the cluster it runs on (-c FILE or -H HOSTS) to look on its nodes; "
                              "`corral ps -c FILE` lists the jobs there")
    c = cluster()
    for host in c.hosts:
        try:
            jobs = list_jobs(c, host, run)
        except HostError:
            continue
        if jobs:
            idx = c.hosts.index(host)
            c2 = Cluster(**{**{k: getattr(c, k) for k in ("source", "name", "env", "workdir", "ssh_options",
                                                          "ssh_config", "path")},
                            "hosts": (host, *c.hosts[:idx], *c.hosts[idx + 1:])})
            return Detached(run_id=run, cluster=c2)
    raise UsageError(f"no detached run {run!r} on {c.hosts[0].name} or the other nodes of the cluster",
                     hint="`corral ps -c FILE` lists the jobs there (give the whole run id)")


def adopt(root: Path, d: Detached) -> Detached:
    """A job found on the nodes from a machine without its stub: give this
    machine one, so the next command (and ``corral runs``) finds it by id."""
    stub = root / d.run_id
    if (stub / DETACHED_FILE).is_file():
        return Detached(run_id=d.run_id, cluster=d.cluster, stub=stub)
    root.mkdir(parents=True, exist_ok=True)
    stub.mkdir(mode=0o700, exist_ok=True)
    _write(stub / DETACHED_FILE, {"run_id": d.run_id, "host": d.host.name, "cluster": cluster_to_json(d.cluster)})
    if not (stub / RUN_FILE).exists():
        _write(stub / RUN_FILE, {"run_id": d.run_id, "status": "running", "detached": {"host": d.host.name},
                                 "head": None})
    found = Detached(run_id=d.run_id, cluster=d.cluster, stub=stub)
    refresh(found)
    return found


def list_jobs(cluster: Cluster, host: Host, which: str = "") -> list[dict]:
    """The detached jobs of this user on ``host`` (its answer, checked for shape)."""
    return _list_node(cluster, host, which)[0]


def _list_node(cluster: Cluster, host: Host, which: str = "") -> tuple[list[dict], list[dict]]:
    """``host``'s detached jobs of this user, and what the live corral jobs of
    this user hold there (attended ones too), each checked as untrusted input."""
    for ev in node_call(cluster, host, "list", *((which,) if which else ()), timeout=30):
        raise_node_error(host, ev)
        if ev["ev"] == "jobs" and isinstance(ev.get("jobs"), list):
            jobs = [j for j in ev["jobs"] if isinstance(j, dict) and isinstance(j.get("run_id"), str)]
            raw = ev.get("holds") if isinstance(ev.get("holds"), list) else []
            holds = [h for h in map(clean_holding, raw[:MAX_HOLDINGS]) if h is not None and h["run_id"] != "?"]
            return jobs, [{**h, "host": host.name} for h in holds]
    return [], []


def list_everywhere(cluster: Cluster) -> tuple[list[dict], list[dict], list[HostError]]:
    """Every node's detached jobs, in parallel; what live jobs hold on each
    node (``host`` added: the cluster's name for it); the nodes that did not answer."""
    jobs: dict[str, dict] = {}
    holds: list[dict] = []
    problems: list[HostError] = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(32, len(cluster.hosts))) as pool:
        futures = {pool.submit(_list_node, cluster, h): h for h in cluster.hosts}
        for fut in concurrent.futures.as_completed(futures):
            try:
                found, held = fut.result()
            except HostError as e:
                problems.append(e)
                continue
            holds += held
            for job in found:
                rec = job.get("record") if isinstance(job.get("record"), dict) else {}
                hosts = {h.get("name") for h in rec.get("hosts", []) if isinstance(h, dict)}
                if hosts and not hosts & set(cluster.names):
                    continue  # another cluster's job, in a home these nodes share
                job["node"] = futures[fut].name
                old = jobs.get(job["run_id"])
                if old is None or (old.get("alive") is None and job.get("alive") is not None):
                    jobs[job["run_id"]] = job  # a home shared by nodes: the supervisor's own node knows
    return sorted(jobs.values(), key=lambda j: j["run_id"], reverse=True), holds, problems


def job_state(job: dict) -> str:
    """running / starting / succeeded / failed / interrupted / died (the
    supervisor was killed: the nodes stopped the job by themselves)."""
    rec = job.get("record") if isinstance(job.get("record"), dict) else {}
    end = job.get("end") if isinstance(job.get("end"), dict) else {}
    status = str(end.get("status") or rec.get("status") or "starting")
    if job.get("alive"):
        return "running" if job.get("ready") and status == "running" else (
            "starting" if status in ("running", "starting") else "stopping")
    if job.get("alive") is False and status in ("running", "starting"):
        return "died"
    return status


def refresh(d: Detached, job: dict | None = None) -> dict | None:
    """Bring the stub's run.json up to date from node 0 (None: unreachable)."""
    if job is None:
        try:
            found = list_jobs(d.cluster, d.host, d.run_id)
        except HostError:
            return None
        job = found[0] if found else None
    if job is None or d.stub is None:
        return job
    rec = dict(job.get("record") or {}) if isinstance(job.get("record"), dict) else {}
    end = job.get("end") if isinstance(job.get("end"), dict) else {}
    old = json.loads((d.stub / RUN_FILE).read_text())
    rec = {**old, **rec, "detached": {"host": d.host.name, "dir": job.get("dir")}, "head": None}
    rec["status"] = job_state(job)
    if end.get("error") and not rec.get("failure"):
        rec["failure"] = {"description": str(end["error"])[:2000], "kind": "start"}
    if rec["status"] in ("died",) and not rec.get("failure"):
        rec["failure"] = {"description": f"its supervisor on {d.host.name} was killed; the nodes stopped "
                                         "the job by themselves", "kind": "supervisor"}
    _write(d.stub / RUN_FILE, rec)
    return job


def refresh_stubs(root: Path) -> None:
    """``corral runs``: detached runs this machine last saw running, asked again (in parallel)."""
    from corral.run.history import list_runs

    stale = [from_stub(r.dir) for r in list_runs(root)
             if r.data.get("detached") and r.data.get("status") in ("running", "starting", "stopping")]
    stale_ok = [d for d in stale if d is not None]
    if not stale_ok:
        return
    with concurrent.futures.ThreadPoolExecutor(max_workers=min(16, len(stale_ok))) as pool:
        list(pool.map(refresh, stale_ok))


# ---------------------------------------------------------------------------
# the run directory, brought back


def sync(d: Detached, dest: Path) -> Path:
    """Copy the job's directory on node 0 into ``dest`` (this machine's run
    directory of it): run.json, every rank's log, console.log."""
    argv, env = _argv(d.cluster, d.host, "pack", (d.run_id,))
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    private_dir(str(dest))
    with subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env=env, start_new_session=True) as proc:
        assert proc.stdout is not None
        try:
            with tarfile.open(fileobj=proc.stdout, mode="r|gz") as tar:
                for member in tar:
                    _extract(tar, member, dest, d.run_id)
        except (tarfile.TarError, EOFError, OSError) as e:
            proc.kill()
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            rc = proc.wait()
            if rc not in (0, None) and rc != -9:
                raise transport_for(d.cluster, d.host).failure(d.host, rc, err) from None
            raise HostError(d.host.name, f"its run directory could not be read: {e}", kind="detach") from None
        rc = proc.wait()
        if rc != 0:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise transport_for(d.cluster, d.host).failure(d.host, rc, err)
    if d.stub is not None and d.stub != dest:
        pass
    return dest


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo, dest: Path, run_id: str) -> None:
    """One file of the pack: a regular file, below ``dest``, never through a link.
    ``<run-id>/x`` (the run directory) lands as ``dest/x``; the supervisor's
    own files (console.log, end.json...) beside it."""
    parts = member.name.split("/")
    if not member.isfile() or member.name.startswith("/") or ".." in parts or "" in parts \
            or member.size > MAX_SYNC_FILE:
        return
    if parts[0] == run_id and len(parts) > 1:
        parts = parts[1:]
    if parts[-1] in (DETACHED_FILE,) or (len(parts) == 1 and parts[0].endswith(".tmp")):
        return
    target = dest.joinpath(*parts)
    for parent in reversed(target.relative_to(dest).parents[:-1]):
        here = dest / parent
        if here.is_symlink():
            return
        here.mkdir(mode=0o700, exist_ok=True)
    src = tar.extractfile(member)
    if src is None:
        return
    keep = None
    if parts == [RUN_FILE] and (dest / RUN_FILE).is_file():
        try:
            keep = json.loads((dest / RUN_FILE).read_text()).get("detached")
        except ValueError:
            keep = None
    fd = os.open(target.with_name(target.name + ".part"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW,
                 0o600)
    with os.fdopen(fd, "wb") as f:
        while chunk := src.read(1 << 20):
            f.write(chunk)
    os.replace(target.with_name(target.name + ".part"), target)
    if keep is not None:
        try:
            rec = json.loads(target.read_text())
            if isinstance(rec, dict):
                rec["detached"], rec["head"] = keep, None
                _write(target, rec)
        except ValueError:
            pass
