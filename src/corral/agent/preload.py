"""Preloaded ranks: torchrun's workers forked from a process that has imported torch.

Every rank of a torchrun job is a fresh ``python -u script.py`` that spends
its first seconds importing torch, and its last half second tearing torch's
modules down again; eight ranks on one node do it eight times over (and on a
shared filesystem, eight times over the network).  The prewarmed torchrun
(``prewarm.py``: ``PREWARM``) has imported torch already, before its job
arrived.  With preloading on, it forks one *zygote* from that state before
torchrun starts any thread, and torchrun's worker ``Popen`` asks the zygote
for each rank instead of exec'ing a new interpreter.  The rank starts with
torch imported and the import-time objects frozen out of the garbage
collector (``gc.freeze``, the usual pre-fork recipe), so it also exits fast.

The rank still is a child of torchrun (the zygote double-forks; torchrun is a
child subreaper and adopts it), in its own session, with torchrun's
environment, working directory, stdio, argv, ``sys.path`` and ``__main__``
exactly as ``python -u script.py`` would set them.  What a forked rank
cannot have the same is whatever was decided while torch was imported: the
dynamic loader's and Python's start-up settings, locale, OpenMP/MKL thread
settings, torch's import-time ``TORCH_*`` configuration.  So a rank is
preloaded only when none of those differ between the zygote and the rank
(``OMP_NUM_THREADS``, which torchrun sets itself, is re-applied), and when
the script does not change them before importing torch (a short static
look at its top level).  Otherwise, and when anything about the zygote is
unexpected, torchrun starts the rank as a fresh interpreter, as it always
does, and the reason is printed.

This file is stdlib only: the head sends it (with ``prescan.py``, which
decides what may be preloaded) in the ``prewarm`` op, and it runs inside the
prewarmed torchrun.
"""

import os
import sys

try:  # in the prewarmed torchrun, installed under its wire name (prewarm.py: PRELOAD)
    from corral_agent_prescan import FIXED_UP, blas_pools, env_mismatch, omp_threads, script_blocker
except ImportError:  # imported as part of the corral package (tests)
    from corral.agent.prescan import FIXED_UP, blas_pools, env_mismatch, omp_threads, script_blocker


# --------------------------------------------------------------------------
# Wire: a length-prefixed JSON message, with file descriptors on its header


def _send(sock, obj, fds=()):
    import json
    import socket

    body = json.dumps(obj).encode()
    head = b"%08d" % len(body)
    if fds:
        socket.send_fds(sock, [head], list(fds))
    else:
        sock.sendall(head)
    sock.sendall(body)


def _recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _recv(sock):
    """(message, fds); (None, []) at end of stream."""
    import json
    import socket

    head, fds, _flags, _addr = socket.recv_fds(sock, 8, 8)
    if not head:
        return None, []
    if len(head) < 8:
        rest = _recv_exact(sock, 8 - len(head))
        if rest is None:
            return None, []
        head += rest
    body = _recv_exact(sock, int(head))
    if body is None:
        return None, []
    return json.loads(body), list(fds)


# --------------------------------------------------------------------------
# The rank, in the forked child


def _set_title(argv):
    """Make ps show ``python -u script.py ...`` (the argv area, as setproctitle does).

    Only when the kernel's idea of that area checks out: it lies in one
    writable mapping and holds exactly what /proc/self/cmdline shows (some
    sandboxed kernels report zeros there).
    """
    import ctypes

    with open("/proc/self/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    start, end = int(fields[45]), int(fields[46])
    room = end - start
    if start <= 0 or room <= 1:
        return
    writable = False
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, _, hi = parts[0].partition("-")
            if int(lo, 16) <= start and end <= int(hi, 16):
                writable = parts[1].startswith("rw")
                break
    if not writable:
        return
    with open("/proc/self/cmdline", "rb") as f:
        shown = f.read()
    if ctypes.string_at(start, room) != shown[:room] or len(shown) != room:
        return
    text = b"\0".join(a.encode(errors="replace") for a in argv)[: room - 1]
    ctypes.memmove(start, text + b"\0" * (room - len(text)), room)


def _trim_excepthook(previous):
    """Drop the zygote's own frames (``<string>``) from the top of a traceback."""

    def hook(etype, value, tb):
        while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
            tb = tb.tb_next
        if value is not None:
            try:
                value.__traceback__ = tb  # what the default hook prints from
            except Exception:
                pass
        previous(etype, value, tb)

    return hook


def _unbuffered_stdio():
    """What ``python -u`` sets up: write-through text over unbuffered files."""
    import io

    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        try:
            old.flush()
        except Exception:
            pass
        stream = io.TextIOWrapper(
            io.open(fd, "wb", buffering=0, closefd=False),
            encoding=getattr(old, "encoding", None) or "utf-8",
            errors=getattr(old, "errors", None) or ("backslashreplace" if fd == 2 else "strict"),
            line_buffering=False, write_through=True,
        )
        setattr(sys, name, stream)
        setattr(sys, "__%s__" % name, stream)


def _reseed():
    """State a fresh interpreter would not share with its siblings.

    torch seeds its default generator from OS entropy when it is imported:
    forked from one zygote, every rank had the same seed, so the ranks of a
    node drew the same dropout masks, and their DataLoader workers (seeded
    from it) the same augmentations.  numpy's legacy global RandomState is
    seeded the same way (when the zygote imported it), and multiprocessing's
    authkey is drawn per process.  Python's ``random``, ``tempfile``'s name
    sequence (keyed by pid) and ``uuid4`` (os.urandom) renew themselves
    after a fork.  The one thing no reseed can change is the str hash seed
    (``PYTHONHASHSEED`` unset): a node's preloaded ranks share their
    zygote's, where fresh ones would each draw their own (docs/run.md).
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        try:  # only the CPU generator: CUDA's are seeded on their first use, as in a fresh interpreter
            torch.default_generator.seed()
        except Exception:
            pass
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        try:
            np_random.seed()
        except Exception:
            pass
    mp_process = sys.modules.get("multiprocessing.process")
    if mp_process is not None:
        try:
            mp_process.current_process().authkey = os.urandom(32)
        except Exception:
            pass


def _fix_thread_pools(env, start_env):
    """Give this rank the thread counts a fresh interpreter would read from its env."""
    import ctypes

    if env.get("OMP_NUM_THREADS") == start_env.get("OMP_NUM_THREADS"):
        return
    n = omp_threads(env)
    if n <= 0:
        return
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(n)
    if not (env.get("OPENBLAS_NUM_THREADS") or env.get("GOTO_NUM_THREADS")):
        for fn in blas_pools()[0]:
            fn(ctypes.c_int(n))


def _wait_adopted(middle):
    """Until torchrun has adopted this rank (its first parent exits at once)."""
    import time

    deadline = time.monotonic() + 2.0
    while os.getppid() == middle and time.monotonic() < deadline:
        time.sleep(0.0005)


def _ignored_signals():
    """Signals this process ignores: an exec'd child inherits exactly these."""
    import signal

    ignored = []
    for sig in range(1, 32):
        try:
            if signal.getsignal(sig) == signal.SIG_IGN:
                ignored.append(sig)
        except (ValueError, OSError):
            pass
    return ignored


def _exec_signals(ignored):
    """The dispositions ``python`` starts with after torchrun exec'd it.

    exec keeps ignored signals ignored and resets caught ones to default;
    Python then ignores SIGPIPE and SIGXFSZ and, unless SIGINT is ignored,
    turns it into KeyboardInterrupt.
    """
    import signal

    for sig in range(1, 32):
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        if sig in (signal.SIGPIPE, getattr(signal, "SIGXFSZ", None)):
            want = signal.SIG_IGN
        elif sig in ignored:
            want = signal.SIG_IGN
        elif sig == signal.SIGINT:
            want = signal.default_int_handler
        else:
            want = signal.SIG_DFL
        try:
            signal.signal(sig, want)
        except (ValueError, OSError):
            pass


def _become_rank(msg, fds, start_env):
    """Turn this forked child into the rank; return the function that runs it."""
    import signal
    import types

    if msg.get("new_session"):
        os.setsid()
    given = dict(zip(msg["fd_targets"], fds))
    for target in (0, 1, 2):
        fd = given.get(target)
        if fd is not None and fd != target:
            os.dup2(fd, target)
    for fd in fds:
        if fd > 2:
            os.close(fd)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    _exec_signals(set(msg.get("ignored") or ()))
    os.chdir(msg["cwd"])
    env = msg["env"]
    os.environ.clear()
    os.environ.update(env)
    argv = msg["argv"]  # [python, -u, script, args...] or [python, -u, -m, module, args...]
    try:
        _set_title(argv)
    except Exception:
        pass
    try:
        sys.orig_argv = list(argv)
    except Exception:
        pass
    hook_dir = msg.get("hook_dir")
    tail = [p for p in sys.path[1:] if p != hook_dir]
    front = [hook_dir] if hook_dir else []
    _unbuffered_stdio()
    _reseed()
    _fix_thread_pools(env, start_env)
    sys.excepthook = _trim_excepthook(sys.excepthook)
    if hook_dir:
        hook_file = os.path.join(hook_dir, "sitecustomize.py")
        try:
            with open(hook_file) as f:
                code = compile(f.read(), hook_file, "exec")
            # The environment's own sitecustomize already ran in the zygote.
            exec(code, {"__name__": "_corral_rank_hook", "__file__": hook_file, "_CORRAL_NO_CHAIN": True})
        except Exception:
            pass

    # A new __main__, as Python's start-up makes it (the zygote's holds its own code's globals).
    main = types.ModuleType("__main__")
    main.__annotations__ = {}
    main.__builtins__ = sys.modules["builtins"]
    sys.modules["__main__"] = main

    if argv[2] == "-m":
        module, args = argv[3], argv[4:]
        sys.argv = [argv[2]] + args  # runpy replaces "-m" with the module's file
        sys.path[:] = [os.getcwd()] + front + tail

        def run_module():
            import runpy

            runpy._run_module_as_main(module, alter_argv=True)

        return run_module

    script, args = argv[2], argv[3:]
    sys.argv = [script] + args
    sys.path[:] = [os.path.dirname(os.path.realpath(script))] + front + tail

    def run_script():
        from importlib.machinery import SourceFileLoader

        path = os.path.abspath(script)
        main.__file__ = path
        main.__cached__ = None
        main.__loader__ = SourceFileLoader("__main__", path)
        main.__spec__ = None
        main.__package__ = None
        with open(path, "rb") as f:
            source = f.read()
        exec(compile(source, path, "exec", dont_inherit=True), main.__dict__)

    return run_script


# --------------------------------------------------------------------------
# The zygote


def _zygote(sock, start_env):
    """Fork ranks on request; return (in a rank only) the function that runs it."""
    import ctypes
    import signal

    try:  # if torchrun dies, so does its zygote
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    try:
        _set_title([sys.executable, "(corral: torchrun's rank zygote, torch preloaded)"])
    except Exception:
        pass
    while True:
        try:
            msg, fds = _recv(sock)
        except OSError:
            msg, fds = None, []
        if msg is None:
            os._exit(0)
        r, w = os.pipe()
        middle = os.fork()
        if middle == 0:
            os.close(r)
            me = os.getpid()
            rank = os.fork()
            if rank == 0:
                os.close(w)
                sock.close()
                _wait_adopted(me)
                return _become_rank(msg, fds, start_env)
            os.write(w, b"%d" % rank)
            os._exit(0)
        os.close(w)
        for fd in fds:
            os.close(fd)
        data = b""
        while True:
            chunk = os.read(r, 64)
            if not chunk:
                break
            data += chunk
        os.close(r)
        os.waitpid(middle, 0)  # the rank is torchrun's child from here on (subreaper)
        _send(sock, {"pid": int(data)} if data else {"error": "fork failed"})


def _note(text):
    """The one line a node prints when its ranks start as fresh interpreters."""
    sys.stderr.write("corral: starting ranks as fresh interpreters: %s\n" % text)
    sys.stderr.flush()


#: A fork takes milliseconds; a zygote silent this long is stuck.
SPAWN_TIMEOUT_S = 60.0


class ZygoteStuck(RuntimeError):
    """The zygote took a request and never answered: the rank may half exist."""


class Preloader:
    """torchrun's side: asks the zygote for ranks."""

    def __init__(self, sock, zygote_pid, start_env, hook_dir):
        self.sock = sock
        self.zygote_pid = zygote_pid
        self.start_env = start_env
        self.hook_dir = hook_dir
        self.broken = None
        self.noted = set()
        self.scripts = {}
        self.pools = None

    def note(self, text):
        if text not in self.noted:
            self.noted.add(text)
            _note(text)

    def why_not(self, args, env):
        """None if this worker can be forked from the zygote, else why not."""
        if self.broken:
            return self.broken
        if len(args) < 3 or args[0] != sys.executable or args[1] != "-u":
            return "torchrun starts %r, not python -u SCRIPT" % (args[:2],)
        if args[2] == "-m":
            if len(args) < 4:
                return "no module after -m"
        elif args[2].startswith("-"):
            return "python option %s" % args[2]
        elif not os.path.isfile(args[2]):
            return "%s is not a file" % args[2]
        key = env_mismatch(self.start_env, env, self.hook_dir, skip=FIXED_UP)
        if key:
            return "%s differs from the preloaded interpreter's" % key
        if env.get("OMP_NUM_THREADS") != self.start_env.get("OMP_NUM_THREADS") and omp_threads(env):
            if self.pools is None:
                self.pools = blas_pools()[1] or ""
            if self.pools:
                return "OMP_NUM_THREADS differs and " + self.pools
        if args[2] != "-m":
            path = os.path.abspath(args[2])
            if path not in self.scripts:
                self.scripts[path] = script_blocker(path)
            if self.scripts[path]:
                return "%s %s" % (args[2], self.scripts[path])
        return None

    def spawn(self, args, env, cwd, fds, new_session):
        """The rank's pid; raises OSError when the zygote cannot deliver."""
        targets = [t for t, fd in zip((0, 1, 2), fds) if fd is not None]
        msg = {"argv": list(args), "env": dict(env), "cwd": cwd or os.getcwd(),
               "fd_targets": targets, "new_session": bool(new_session), "hook_dir": self.hook_dir,
               "ignored": _ignored_signals()}
        import signal
        import socket

        _send(self.sock, msg, [fd for fd in fds if fd is not None])
        self.sock.settimeout(SPAWN_TIMEOUT_S)
        try:
            reply, _ = _recv(self.sock)
        except socket.timeout:
            # Not a fallback: a late rank from the zygote would join the job twice.
            self.broken = "the preloaded interpreter did not answer"
            os.kill(self.zygote_pid, signal.SIGKILL)
            raise ZygoteStuck("corral: the preloaded interpreter did not start rank %s within %.0f s; "
                              "run again with --fresh-ranks" % (env.get("RANK", "?"), SPAWN_TIMEOUT_S)) from None
        if not reply or "pid" not in reply:
            raise OSError("the zygote did not answer (%s)" % ((reply or {}).get("error") or "closed"))
        return int(reply["pid"])


def _popen_class(preloader):
    import subprocess

    names = subprocess.Popen._execute_child.__code__.co_varnames
    try:
        session_at = names.index("start_new_session") - 1  # minus self
    except ValueError:
        session_at = None

    class PreloadedPopen(subprocess.Popen):
        """torchrun's worker Popen: forked from the zygote when it can be."""

        def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env,
                           startupinfo, creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite,
                           errread, errwrite, *rest):
            all_args = (args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                        creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite) + rest
            argv = [os.fsdecode(a) for a in args] if isinstance(args, (list, tuple)) else None
            why = "unusual arguments" if (argv is None or shell or preexec_fn or pass_fds or executable
                                          or env is None) else preloader.why_not(argv, env)
            if why:
                preloader.note(why)
                return super()._execute_child(*all_args)
            new_session = bool(all_args[session_at]) if session_at is not None else False
            fds = [fd if fd != -1 else None for fd in (p2cread, c2pwrite, errwrite)]
            try:
                pid = preloader.spawn(argv, {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()},
                                      os.fsdecode(cwd) if cwd else None, fds, new_session)
            except (OSError, ValueError) as e:
                preloader.broken = "the preloaded interpreter failed: %s" % e
                preloader.note(preloader.broken)
                return super()._execute_child(*all_args)
            self.pid = pid
            self._child_created = True
            devnull = getattr(self, "_devnull", None)
            if p2cread != -1 and p2cwrite != -1 and p2cread != devnull:
                os.close(p2cread)
            if c2pwrite != -1 and c2pread != -1 and c2pwrite != devnull:
                os.close(c2pwrite)
            if errwrite != -1 and errread != -1 and errwrite != devnull:
                os.close(errwrite)
            if devnull is not None:
                os.close(devnull)
            self._closed_child_pipe_fds = True

    return PreloadedPopen


def start(start_env):
    """In the prewarmed torchrun, once its job's environment is in place.

    Returns None in torchrun (which then runs as usual, asking the zygote for
    its ranks) and, in a rank forked from the zygote, the function that runs
    the rank's script.
    """
    import ctypes
    import gc
    import socket
    import warnings

    note = _note
    try:
        from torch.distributed.elastic.multiprocessing.subprocess_handler import (
            subprocess_handler as sh,
        )
    except ImportError:
        note("this torch has no subprocess_handler to hook")
        return None
    if not hasattr(sh, "Popen") or not hasattr(socket, "send_fds"):
        note("this torch or Python is too old for preloaded ranks")
        return None
    log_dir = os.environ.get("CORRAL_LOG_DIR")
    hook_dir = os.path.join(os.path.dirname(log_dir), "hook") if log_dir else None
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        note("cannot become a child subreaper")
        return None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    gc.freeze()  # torch's import-time objects: never collected again, so exits are fast
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # the BLAS pool thread: fork-safe
        pid = os.fork()
    if pid == 0:
        ours.close()
        return _zygote(theirs, start_env)
    theirs.close()
    sh.Popen = _popen_class(Preloader(ours, pid, start_env, hook_dir))
    return None
