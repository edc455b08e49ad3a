"""corral's rank hook, imported by every Python process of a corral run.

The node agent puts this file's directory first on the workload's PYTHONPATH,
so Python imports it at start-up (``site`` imports ``sitecustomize``), before
any user code runs.  The user's script is unchanged.

In a process that is a training rank (torchrun/DeepSpeed set ``RANK``;
Lightning's children set ``LOCAL_RANK`` and ``NODE_RANK``), it:

- points the process's stdout and stderr (the file descriptors, so C and
  NCCL output too) at ``$CORRAL_LOG_DIR/rank<N>.log``, which the agent
  tails; one file keeps the order in which the rank wrote.  Files, not pipes: a slow head or network never blocks a
  training step, and nothing is lost if the head disconnects;
- records its pid (``rank<N>.pid``) so the agent can tell which rank exited
  first and signal exactly the ranks (never by name);
- records an uncaught exception's last line (``rank<N>.status``, with its
  rank and pid: the agent believes only a pid of its own process tree, within
  the node's ranks, and only the status that names that rank and pid);
- enables faulthandler, so a crash in native code (SIGSEGV...) prints where
  in the program it happened into the rank's log;
- registers a faulthandler stack dump on ``CORRAL_STACK_SIGNAL`` into
  ``rank<N>.stacks`` so ``corral stacks`` / ``--hang-timeout`` can show
  where every rank is, without ptrace or special privileges.

- with the flight recorder on (``CORRAL_FR_DIR``), writes torch's flight
  recorder dump (its last collectives) to ``$CORRAL_FR_DIR/rank<N>.*.json``
  when the agent writes to ``rank<N>.fifo`` (a hang, ``corral stacks``: a
  thread blocked on the FIFO answers even while the main thread waits inside
  a collective) and when the process exits normally or by an exception.

A new interpreter started under a rank (an ``mp.spawn`` worker) registers
the same dump into ``rank<N>.w<pid>.stacks`` and nothing else.

Processes that are not ranks (torchrun itself, ``accelerate launch``) are
left alone.  Then the next ``sitecustomize`` on sys.path, if any, is run, so
an environment's own customisation still applies.  Stdlib only, Python 3.8+,
and it never raises: a broken hook must not break training.
"""

import os
import sys


def _corral_rank():
    env = os.environ
    rank = env.get("RANK", "")
    if rank.isdigit():
        return int(rank)
    local = env.get("LOCAL_RANK", "")
    node = env.get("GROUP_RANK") or env.get("NODE_RANK") or ""
    per_node = env.get("CORRAL_NPROC_PER_NODE", "")
    if local.isdigit() and node.isdigit() and per_node.isdigit():
        return int(node) * int(per_node) + int(local)
    return None


def _corral_dumps(base):
    """Where this process is, when it crashes and on request; whether the
    request can be answered.

    faulthandler prints a native crash (SIGSEGV, SIGBUS, SIGFPE, SIGABRT...),
    which leaves no Python traceback, into the log; a stack dump of every
    thread goes to ``<base>.stacks`` on ``CORRAL_STACK_SIGNAL``."""
    import faulthandler

    try:
        if not faulthandler.is_enabled():
            faulthandler.enable(all_threads=False)
    except Exception:
        pass
    sig = os.environ.get("CORRAL_STACK_SIGNAL", "")
    if not sig.isdigit():
        return False
    try:
        stacks = open(base + ".stacks", "a")
        faulthandler.register(int(sig), file=stacks, all_threads=True, chain=False)
    except Exception:
        return False
    return True


def _corral_pidfile(base, text):
    """``<base>.pid``, whole or not at all.  Written after ``_corral_dumps``:
    the agent signals the pid it finds there, so the handler is in place
    first (the signal's default action kills)."""
    tmp = base + ".pid.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, base + ".pid")


def _corral_fr_dump(base):
    """Write this rank's flight recorder dump, if torch.distributed is in use
    (never imported here: a process that does not use it has nothing to say).

    ``<base>.cpu.json`` (gloo and other CPU-side process groups, torch 2.8+),
    ``<base>.nccl.json`` (CUDA builds), or ``<base>.nccl.pkl`` from a torch
    that has only the pickle format; then ``<base>.done`` with a counter, which
    the agent waits for.  Each file whole or not at all."""
    c10d = sys.modules.get("torch._C._distributed_c10d")
    if c10d is None:
        return
    calls = (("_dump_nccl_trace_json", ".nccl.json", (True, False)),
             ("_dump_fr_trace_json", ".cpu.json", (True, False)))
    wrote = 0
    for name, suffix, args in calls:
        fn = getattr(c10d, name, None)
        if fn is None:
            continue
        try:
            data = fn(*args)
        except Exception:
            continue
        _corral_write(base + suffix, data)
        wrote += 1
    if not wrote and getattr(c10d, "_dump_nccl_trace", None) is not None:
        try:
            _corral_write(base + ".nccl.pkl", c10d._dump_nccl_trace())
        except Exception:
            pass
    global _CORRAL_FR_COUNT
    _CORRAL_FR_COUNT += 1
    _corral_write(base + ".done", ("%d %d" % (os.getpid(), _CORRAL_FR_COUNT)).encode())


_CORRAL_FR_COUNT = 0


def _corral_write(path, data):
    if isinstance(data, str):
        data = data.encode("utf-8")
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


#: Entries each process group keeps (torch's documented value for debugging hangs).
_CORRAL_FR_ENTRIES = "2000"


def _corral_torch_version():
    """(major, minor) of the torch this process would import, read from its
    ``version.py`` without importing it; None when there is none."""
    import importlib.util
    import re

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    with open(os.path.join(os.path.dirname(spec.origin), "version.py")) as f:
        m = re.search(r"__version__\s*=\s*['\"](\d+)\.(\d+)", f.read(4096))
    return (int(m.group(1)), int(m.group(2))) if m else None


def _corral_fr_env(fr_dir):
    """torch's flight recorder variables, set in this process before torch
    reads them, under the names its torch knows: torch 2.10 and later read
    ``TORCH_FR_BUFFER_SIZE``/``TORCH_FR_DUMP_TEMP_FILE`` and warn on the older
    ``TORCH_NCCL_TRACE_BUFFER_SIZE``/``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``; older
    torch reads only those (NCCL only before 2.8), so both are set there.
    ``TORCH_NCCL_DUMP_ON_TIMEOUT`` has one name.  A value the job set under
    either name wins (``TORCH_NCCL_TRACE_BUFFER_SIZE=0`` keeps it off)."""
    try:
        version = _corral_torch_version()
    except Exception:
        version = None
    prefix = os.path.join(fr_dir, "torch_trace_rank_")
    names = {"TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
             "TORCH_FR_BUFFER_SIZE": _CORRAL_FR_ENTRIES, "TORCH_FR_DUMP_TEMP_FILE": prefix}
    if version is None or version < (2, 10):
        names.update(TORCH_NCCL_TRACE_BUFFER_SIZE=_CORRAL_FR_ENTRIES, TORCH_NCCL_DEBUG_INFO_TEMP_FILE=prefix)
    pairs = (("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"),
             ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"))
    for pair in pairs:
        if any(os.environ.get(n) for n in pair):
            for n in pair:
                names.pop(n, None)
    for name, value in names.items():
        if not os.environ.get(name):
            os.environ[name] = value


def _corral_flightrec(rank):
    """Dump on request (a write to ``rank<N>.fifo``) and at exit."""
    fr_dir = os.environ.get("CORRAL_FR_DIR", "")
    if not fr_dir or not os.path.isdir(fr_dir):
        return
    _corral_fr_env(fr_dir)
    import atexit
    import threading

    base = os.path.join(fr_dir, "rank%d" % rank)
    fifo = base + ".fifo"
    os.mkfifo(fifo, 0o600)

    def serve():
        while True:
            try:
                # Blocks, holding no lock, until the agent opens it for writing.
                with open(fifo, "rb") as f:
                    f.read()
                _corral_fr_dump(base)
            except Exception:
                return

    threading.Thread(target=serve, name="corral-flightrec", daemon=True).start()

    me = os.getpid()

    def at_exit():
        if os.getpid() != me:
            return  # a forked child exiting: the dump is the rank's, not its copy's
        try:
            _corral_fr_dump(base)
        except Exception:
            pass

    atexit.register(at_exit)


def _corral_install():
    log_dir = os.environ.get("CORRAL_LOG_DIR")
    if not log_dir or not os.path.isdir(log_dir):
        return
    rank = _corral_rank()
    if rank is None:
        return
    if os.environ.get("CORRAL_CAPTURED") == str(rank):
        # A new interpreter started under this rank (an mp.spawn worker, a
        # `subprocess.run([sys.executable, ...])`): its fds already point at
        # the rank's files; it only needs to be able to say where it is, in
        # rank<N>.w<pid>.stacks.  Its pid file holds its parent's pid too, so
        # the agent signals only a rank's own children.
        worker = os.path.join(log_dir, "rank%d.w%d" % (rank, os.getpid()))
        if _corral_dumps(worker):
            _corral_pidfile(worker, "%d %d" % (os.getpid(), os.getppid()))
        return
    os.environ["CORRAL_CAPTURED"] = str(rank)
    base = os.path.join(log_dir, "rank%d" % rank)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    # One file for both streams, as a terminal shows them: a traceback stays
    # after the prints that preceded it.
    target = os.open(base + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(target, 1)
    os.dup2(target, 2)
    os.close(target)
    try:
        sys.stdout.reconfigure(line_buffering=True)
    except Exception:
        pass
    previous = sys.excepthook

    def record_exception(etype, value, tb):
        try:
            import json

            text = "%s: %s" % (etype.__name__, value) if str(value) else etype.__name__
            inner = str(value).strip().splitlines()
            if etype.__name__ == "ProcessRaisedException" and inner:
                # torch.multiprocessing.spawn re-raises a worker's error as text
                # ending in that worker's own exception line: that is the error.
                text = "%s (in mp.spawn process %s)" % (inner[-1].strip(), getattr(value, "error_index", "?"))
            # Names its rank and process: the agent believes a status only
            # from the process it registered for that rank.
            with open(base + ".status", "w") as f:
                json.dump({"exc": text[:2000], "rank": rank, "pid": os.getpid()}, f)
        except Exception:
            pass
        previous(etype, value, tb)

    sys.excepthook = record_exception

    _corral_dumps(base)
    try:
        _corral_flightrec(rank)
    except Exception:
        pass
    _corral_pidfile(base, str(os.getpid()))


def _corral_chain():
    """Run the sitecustomize this one shadows, if the environment has one."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            import importlib.util

            spec = importlib.util.spec_from_file_location("_corral_next_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            return


try:
    _corral_install()
except Exception:
    pass
try:
    if not globals().get("_CORRAL_NO_CHAIN"):  # set when a preloaded rank runs this file
        _corral_chain()
except Exception:
    pass
