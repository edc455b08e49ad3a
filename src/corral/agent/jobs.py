"""Detached jobs, node side: start a supervisor, list, follow, stop, pack (stdlib only, Python 3.8+).

Shipped on each call as ``python3 -c`` source (``corral.run.detach``), with
``corral.agent.private``: nothing is installed on a node.  One call is one
operation; everything it prints is one JSON object a line, which the head
checks as untrusted input.

On the node, every detached job of this user has a private directory
(``private_dir``: 0700, ours, no symbolic links)::

    $XDG_STATE_HOME/corral/detached/<run-id>/     (~/.local/state/...)
      job.json          what the head sent: cluster, spec, options (0600)
      supervisor.json   the supervisor's pid, its start time and host
      console.log       everything an attended terminal would show
      ready             written once every rank is in user code
      <run-id>/         the run directory: run.json, <host>/rank<N>.log

and corral's package (with click, rich, tomlkit) is unpacked once per
content hash in ``$XDG_CACHE_HOME/corral/pkg/<sha256>/``.  The supervisor
is ``python -c 'from corral.run.supervisor import main'`` with that
directory first on ``sys.path``, in a session of its own.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

try:  # on a node, modules are installed under their wire names
    from corral_agent_private import UnsafePlace, private_dir
except ImportError:  # imported as part of the corral package (tests, head)
    from corral.agent.private import UnsafePlace, private_dir

#: How often a follower looks for new output (seconds).
POLL_S = 0.2
#: A run id: what the head's run ids look like (names a directory here).
RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}\Z")
PKG_HASH = re.compile(r"[0-9a-f]{64}\Z")
#: The supervisor needs the Python corral itself needs.
MIN_PYTHON = (3, 10)


#: Lines of a log sent as one event (``emit_lines``).
BATCH_LINES = 1024
BATCH_CHARS = 64 * 1024


def emit(**event) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def emit_lines(lines, **where) -> None:
    """``lines`` as ``lines`` events of at most BATCH_LINES lines or BATCH_CHARS
    characters (a longer line alone).  One JSON document and one write per
    line made `corral logs` of a large log CPU-bound at both ends."""
    batch, size = [], 0
    for line in lines:
        if batch and (len(batch) >= BATCH_LINES or size + len(line) > BATCH_CHARS):
            emit(ev="lines", t=batch, **where)
            batch, size = [], 0
        batch.append(line)
        size += len(line)
    if batch:
        emit(ev="lines", t=batch, **where)


def _home() -> str:
    return os.path.expanduser("~")


def _xdg(name: str, default: str) -> str:
    path = os.environ.get(name) or ""
    return path if os.path.isabs(path) else os.path.join(_home(), default)


def _base_for(path: str) -> str:
    """The existing place ``path`` is made in: the home when it is below it."""
    home = _home()
    if path.startswith(home.rstrip("/") + "/"):
        return home
    return os.path.dirname(path)


def jobs_root() -> str:
    return os.path.join(_xdg("XDG_STATE_HOME", ".local/state"), "corral", "detached")


def pkg_root() -> str:
    return os.path.join(_xdg("XDG_CACHE_HOME", ".cache"), "corral", "pkg")


def job_dir(run_id: str, create: bool = False) -> str:
    if not RUN_ID.match(run_id):
        raise ValueError("%r is not a run id" % run_id)
    path = os.path.join(jobs_root(), run_id)
    if create:
        private_dir(path, _base_for(path))
    return path


def _read_json(path: str):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read(4 << 20))
    except (OSError, ValueError):
        return None


def _write_private(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _start_time(pid: int):
    """The kernel's start time of ``pid`` (a reused pid has another), or None."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2:].split()
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def supervisor_alive(jobdir: str):
    """True / False for a supervisor of this host; None when it runs on
    another host (a home shared between nodes) and cannot be told from here."""
    sup = _read_json(os.path.join(jobdir, "supervisor.json"))
    if not isinstance(sup, dict):
        return False
    if sup.get("host") != socket.gethostname():
        return None
    pid = sup.get("pid")
    return isinstance(pid, int) and pid > 0 and _start_time(pid) == sup.get("start")


# ---------------------------------------------------------------------------
# operations


def op_put(pkg_hash: str) -> int:
    """Unpack corral's package (a zip on stdin) as ``pkg/<hash>``, verified."""
    import shutil
    import zipfile

    if not PKG_HASH.match(pkg_hash):
        emit(ev="error", t="bad package hash")
        return 2
    data = sys.stdin.buffer.read()
    if hashlib.sha256(data).hexdigest() != pkg_hash:
        emit(ev="error", t="the package arrived damaged (sha256 differs)")
        return 3
    root = private_dir(pkg_root(), _base_for(pkg_root()))
    final = os.path.join(root, pkg_hash)
    if os.path.isdir(final):
        emit(ev="ok")
        return 0
    tmp = os.path.join(root, ".%s.%d" % (pkg_hash[:12], os.getpid()))
    os.mkdir(tmp, 0o700)
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            for name in z.namelist():
                parts = name.split("/")
                if name.startswith("/") or ".." in parts or "\\" in name:
                    raise ValueError("unsafe name in package: %r" % name)
            z.extractall(tmp)
        os.rename(tmp, final)
    except FileExistsError:
        pass  # another call unpacked it first
    except OSError as e:
        if not os.path.isdir(final):
            raise
        del e
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    _prune(root, keep=final)
    emit(ev="ok")
    return 0


#: A package not started for this long is removed when another is unpacked.
PKG_KEEP_S = 30 * 86400


def _prune(root: str, keep: str) -> None:
    import shutil

    for name in os.listdir(root):
        path = os.path.join(root, name)
        try:
            if PKG_HASH.match(name) and path != keep and time.time() - os.lstat(path).st_mtime > PKG_KEEP_S:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def op_launch(run_id: str) -> int:
    """Start the supervisor of ``run_id`` (job.json on stdin) in its own
    session, then pass its console on until every rank is in user code."""
    if sys.version_info < MIN_PYTHON:
        emit(ev="error", kind="old-python",
             t="the supervisor needs Python %d.%d+ on this node, found %s (%s)"
             % (MIN_PYTHON + (sys.version.split()[0], sys.executable)))
        return 3
    request = json.loads(sys.stdin.buffer.read().decode())
    pkg_hash = request["pkg"]
    if not PKG_HASH.match(pkg_hash):
        emit(ev="error", t="bad package hash")
        return 2
    pkg = os.path.join(private_dir(pkg_root(), _base_for(pkg_root())), pkg_hash)
    if not os.path.isdir(pkg):
        emit(ev="need_pkg")
        return 0
    os.utime(pkg)  # in use: kept (see _prune)
    jobdir = job_dir(run_id, create=True)
    _write_private(os.path.join(jobdir, "job.json"), json.dumps(request["job"]).encode())
    log = os.open(os.path.join(jobdir, "console.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW,
                  0o600)
    code = ("import sys; sys.path.insert(0, %r); from corral.run.supervisor import main; "
            "raise SystemExit(main(%r))" % (pkg, jobdir))
    env = dict(os.environ, PYTHONUNBUFFERED="1", CORRAL_SUPERVISOR=run_id)
    env.pop("PYTHONPATH", None)
    proc = subprocess.Popen([sys.executable, "-c", code, "corral-supervisor", run_id], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log, close_fds=True, start_new_session=True, cwd=_home(),
                            env=env)
    os.close(log)
    sup = {"pid": proc.pid, "start": _start_time(proc.pid), "host": socket.gethostname(),
           "user": _user(), "since": time.time()}
    _write_private(os.path.join(jobdir, "supervisor.json"), json.dumps(sup).encode())
    emit(ev="launched", pid=proc.pid, dir=jobdir, host=sup["host"])
    return _follow(jobdir, run_id, until_ready=True, proc=proc)


def _user() -> str:
    try:
        import pwd

        return pwd.getpwuid(os.geteuid()).pw_name
    except (ImportError, KeyError):
        return str(os.geteuid())


class _Tail:
    """New complete lines of a file, from an offset."""

    def __init__(self, path: str, offset: int = 0):
        self.path = path
        self.offset = offset
        self.partial = b""

    def lines(self, final: bool = False) -> list:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return []
        try:
            os.lseek(fd, self.offset, 0)
            chunks = []
            while True:
                data = os.read(fd, 1 << 20)
                if not data:
                    break
                chunks.append(data)
                self.offset += len(data)
        finally:
            os.close(fd)
        data = self.partial + b"".join(chunks)
        *done, self.partial = data.split(b"\n")
        if final and self.partial:
            done.append(self.partial)
            self.partial = b""
        return [d.decode("utf-8", "replace") for d in done]


def _last_lines_offset(path: str, count: int) -> int:
    """Offset where the last ``count`` lines of ``path`` begin."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            start = max(0, size - 256 * 1024 - 200 * count)
            f.seek(start)
            data = f.read()
    except OSError:
        return 0
    if count <= 0:
        return size
    ends = [i for i, b in enumerate(data) if b == 10]
    if data.endswith(b"\n"):
        ends = ends[:-1]
    if len(ends) < count:
        return start
    return start + ends[-count] + 1


def _end_event(jobdir: str, run_id: str) -> dict:
    rec = _read_json(os.path.join(jobdir, run_id, "run.json")) or {}
    end = _read_json(os.path.join(jobdir, "end.json")) or {}
    return {"ev": "end", "status": end.get("status") or rec.get("status"),
            "exit_code": end.get("exit_code", rec.get("exit_code")),
            "failure": (rec.get("failure") or {}).get("description") or end.get("error"),
            "hint": end.get("hint")}


def _follow(jobdir: str, run_id: str, until_ready: bool = False, proc=None, tail=None) -> int:
    """Pass the console on as it grows, until the supervisor ends (or,
    ``until_ready``, until every rank is in user code)."""
    path = os.path.join(jobdir, "console.log")
    t = _Tail(path, 0 if tail is None else _last_lines_offset(path, tail))
    while True:
        emit_lines(t.lines())
        if until_ready and os.path.exists(os.path.join(jobdir, "ready")):
            emit(ev="ready")
            return 0
        gone = proc.poll() is not None if proc is not None else supervisor_alive(jobdir) is False
        if gone:
            emit_lines(t.lines(final=True))
            emit(**_end_event(jobdir, run_id))
            return 0
        time.sleep(POLL_S)


def op_attach(run_id: str, tail: str = "40") -> int:
    jobdir = job_dir(run_id)
    if not os.path.isdir(jobdir):
        emit(ev="missing")
        return 0
    alive = supervisor_alive(jobdir)
    emit(ev="state", alive=alive)
    return _follow(jobdir, run_id, tail=int(tail))


def _rank_files(rundir: str, rank, node):
    """(host, rank or None, path) of the logs asked for, sorted by rank."""
    out = []
    try:
        hosts = sorted(os.listdir(rundir))
    except OSError:
        return out
    for host in hosts:
        hdir = os.path.join(rundir, host)
        if node is not None and host != node or os.path.islink(hdir) or not os.path.isdir(hdir):
            continue
        for name in os.listdir(hdir):
            m = re.match(r"rank(\d+)\.log\Z", name)
            if m and (rank is None or int(m.group(1)) == rank):
                out.append((host, int(m.group(1)), os.path.join(hdir, name)))
            elif name == "launcher.log" and rank is None:
                out.append((host, None, os.path.join(hdir, name)))
    return sorted(out, key=lambda x: (x[1] is None, x[1] if x[1] is not None else 0, x[0]))


def _world_without(rundir: str, rank):
    """The job's world size when ``rank`` is beyond it and has no log (a rank
    of an earlier, larger attempt keeps its log): else None.  A rank that only
    printed nothing yet is no mistake; one the job never had is."""
    if not isinstance(rank, int) or _rank_files(rundir, rank, None):
        return None
    rec = _read_json(os.path.join(rundir, "run.json"))
    world = rec.get("world_size") if isinstance(rec, dict) else None
    if isinstance(world, int) and not isinstance(world, bool) and 0 <= world <= rank:
        return world
    return None


def op_logs(run_id: str, options: str) -> int:
    """Per-rank logs (``options``: JSON rank, node, tail, follow)."""
    opts = json.loads(options)
    jobdir = job_dir(run_id)
    if not os.path.isdir(jobdir):
        emit(ev="missing")
        return 0
    rundir = os.path.join(jobdir, run_id)
    rank, node, tail, follow = opts.get("rank"), opts.get("node"), opts.get("tail"), opts.get("follow")
    world = _world_without(rundir, rank)
    if world is not None:
        emit(ev="no_rank", world=world)
        return 0
    tails = {}
    while True:
        for host, r, path in _rank_files(rundir, rank, node):
            if path not in tails:
                tails[path] = _Tail(path, _last_lines_offset(path, tail) if tail is not None else 0)
            emit_lines(tails[path].lines(final=not follow), h=host, r=r)
        if not follow or supervisor_alive(jobdir) is False:
            if follow:  # what came between the last look and its end
                for host, r, path in _rank_files(rundir, rank, node):
                    emit_lines(tails.setdefault(path, _Tail(path)).lines(final=True), h=host, r=r)
                emit(**_end_event(jobdir, run_id))
            return 0
        time.sleep(POLL_S)


def op_list(which: str = "") -> int:
    """Every detached job of this user here (or the one named)."""
    root = jobs_root()
    try:
        names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    except OSError:
        names = []
    jobs = []
    for name in names:
        if which and name != which or not RUN_ID.match(name):
            continue
        jobdir = os.path.join(root, name)
        if os.path.islink(jobdir):
            continue
        rec = _read_json(os.path.join(jobdir, name, "run.json"))
        sup = _read_json(os.path.join(jobdir, "supervisor.json")) or {}
        end = _read_json(os.path.join(jobdir, "end.json"))
        jobs.append({"run_id": name, "dir": jobdir, "alive": supervisor_alive(jobdir),
                     "ready": os.path.exists(os.path.join(jobdir, "ready")),
                     "supervisor": sup, "record": rec, "end": end})
    emit(ev="jobs", jobs=jobs, holds=[] if which else _holdings(), host=socket.gethostname())
    return 0


def _holdings() -> list:
    """What the live corral jobs of this user hold here (GPUs, ports): the
    attended jobs too, which have no directory here."""
    try:
        try:
            from corral_agent_holds import holdings
        except ImportError:
            from corral.agent.holds import holdings
        return holdings()
    except Exception:  # an unsafe or unreadable registry: no holdings to show, never a failed list
        return []


def op_stop(run_id: str) -> int:
    """SIGINT to the supervisor (as Ctrl-C to an attended head), then pass
    its console on until it has torn the job down."""
    jobdir = job_dir(run_id)
    if not os.path.isdir(jobdir):
        emit(ev="missing")
        return 0
    sup = _read_json(os.path.join(jobdir, "supervisor.json")) or {}
    alive = supervisor_alive(jobdir)
    if not alive:
        emit(ev="not_running", alive=alive)
        emit(**_end_event(jobdir, run_id))
        return 0
    path = os.path.join(jobdir, "console.log")
    offset = os.path.getsize(path) if os.path.exists(path) else 0
    os.kill(sup["pid"], signal.SIGINT)
    emit(ev="stopping", pid=sup["pid"])
    t = _Tail(path, offset)
    while supervisor_alive(jobdir):
        emit_lines(t.lines())
        time.sleep(POLL_S)
    emit_lines(t.lines(final=True))
    emit(**_end_event(jobdir, run_id))
    return 0


def op_pack(run_id: str) -> int:
    """The job's directory as a tar on stdout (``corral logs --sync``)."""
    import tarfile

    jobdir = job_dir(run_id)
    if not os.path.isdir(jobdir):
        return 4
    out = sys.stdout.buffer
    with tarfile.open(fileobj=out, mode="w|gz") as tar:
        for dirpath, dirnames, filenames in os.walk(jobdir):
            dirnames[:] = [d for d in dirnames if not os.path.islink(os.path.join(dirpath, d))]
            for name in filenames:
                path = os.path.join(dirpath, name)
                if name == "job.json" or os.path.islink(path) or not os.path.isfile(path):
                    continue  # job.json holds the --env values: they stay on the node
                tar.add(path, arcname=os.path.relpath(path, jobdir), recursive=False)
    out.flush()
    return 0


OPS = {"put": op_put, "launch": op_launch, "attach": op_attach, "logs": op_logs, "list": op_list,
       "stop": op_stop, "pack": op_pack}


def main(argv) -> int:
    op, args = argv[0], argv[1:]
    try:
        return OPS[op](*args)
    except UnsafePlace as e:
        emit(ev="error", kind="unsafe", t=str(e), hint=e.hint)
        return 3
    except (BrokenPipeError, KeyboardInterrupt):
        return 0
    except (OSError, ValueError) as e:
        emit(ev="error", t="%s: %s" % (type(e).__name__, e))
        return 3
