"""The program a prewarmed launcher runs (stdlib only; text, run by ``python -c``).

Shipped to nodes as ``corral_agent_prewarm``.  The agent starts
``python -c <program>`` for torchrun (also inside ``accelerate launch``) as
soon as the head is connected, so importing torch overlaps preflight; the
program then waits for its job on stdin (``Agent.take_prewarmed``).
"""

from __future__ import annotations

#: A module imported ahead of its job (see ``Agent.op_prewarm``).  Reads one
#: JSON line {args, cwd, env, preload}; an empty line (the head gave up) just
#: exits.  The objects of the import are frozen out of the garbage collector
#: (they live as long as the process; its exit skips collecting them, about
#: half a second of CPU with torch loaded).  With ``preload`` the module's
#: process forks the zygote its ranks are forked from (``preload.py``); in a
#: rank, ``_corral_rank`` runs the rank's script, and nothing of the module.
#: The module itself is dropped from sys.modules again before it runs as
#: ``__main__`` (its imports stay warm): that is the state ``python -m`` leaves,
#: and runpy warns ("found in sys.modules ... unpredictable behaviour") otherwise.
PREWARM = (
    "import json, os, runpy, sys\n"
    "%(die_with_agent)s\n"
    "_corral_start_env = dict(os.environ)\n"
    "import %(module)s\n"
    "%(extra)s\n"
    "job = json.loads(sys.stdin.readline() or 'null')\n"
    "if job is None: raise SystemExit(0)\n"
    "fd = os.open(os.devnull, os.O_RDONLY); os.dup2(fd, 0); os.close(fd)\n"
    "os.chdir(job['cwd']); os.environ.clear(); os.environ.update(job['env'])\n"
    "%(fixups)s\n"
    "import gc; gc.freeze()\n"
    "_corral_rank = None\n"
    "%(preload)s\n"
    "if _corral_rank is not None:\n"
    "    _corral_rank()\n"
    "else:\n"
    "    sys.argv = ['%(module)s'] + job['args']\n"
    "    parent, _, leaf = '%(module)s'.rpartition('.')\n"
    "    del sys.modules['%(module)s']\n"
    "    if parent and hasattr(sys.modules[parent], leaf): delattr(sys.modules[parent], leaf)\n"
    "    runpy.run_module('%(module)s', run_name='__main__', alter_sys=True)\n"
)

#: Sets ``_corral_rank`` in PREWARM when the job asks for preloaded ranks: the
#: modules are installed as the agent's own are (bundle.py), compiled as
#: ``<string>`` (a rank's tracebacks drop those frames), and taken out of
#: sys.modules again once the rank or torchrun is set up.
PRELOAD = (
    "if job.get('preload'):\n"
    "    import types\n"
    "    for _n, _s in %r:\n"
    "        sys.modules[_n] = types.ModuleType(_n)\n"
    "        exec(compile(_s, '<string>', 'exec'), sys.modules[_n].__dict__)\n"
    "    _corral_rank = sys.modules['corral_agent_preload'].start(_corral_start_env)\n"
    "    for _n in %r:\n"
    "        del sys.modules[_n]\n"
)

#: What a prewarmed process must share with its job's environment: it was
#: started before the job's variables were known ...
PREWARM_SENSITIVE = ("PYTHON", "LD_", "LANG", "LC_")
#: ... except these start-up settings, which it applies once the job arrives.
PREWARM_FIXED = ("PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE")
PREWARM_FIXUPS = (
    "if os.environ.get('PYTHONFAULTHANDLER'):\n"
    "    import faulthandler; faulthandler.enable()\n"
    "if os.environ.get('PYTHONDONTWRITEBYTECODE'): sys.dont_write_bytecode = True\n"
    "if os.environ.get('PYTHONUNBUFFERED') and not _corral_start_env.get('PYTHONUNBUFFERED'):\n"
    "    import io\n"
    "    for _n, _fd in (('stdout', 1), ('stderr', 2)):\n"
    "        _o = getattr(sys, _n); _o.flush()\n"
    "        setattr(sys, _n, io.TextIOWrapper(io.open(_fd, 'wb', buffering=0, closefd=False),"
    " encoding=_o.encoding, errors=_o.errors, write_through=True))\n"
)

#: The prewarmed launcher gets SIGTERM if the agent itself dies abruptly
#: (SIGKILL, the OOM killer): torchrun then stops its ranks rather than run on
#: with nobody to stop them.  A fresh launcher gets the same from
#: ``_die_with_agent`` (node.py).
DIE_WITH_AGENT = (
    "try:\n"
    "    import ctypes; ctypes.CDLL(None).prctl(1, 15, 0, 0, 0)\n"
    "except Exception: pass\n"
    "if os.getppid() != %d: raise SystemExit(0)"
)


#: Run in a prewarmed torchrun before its job.  torchrun's exit barrier lives in
#: the TCP store of node rank 0's torchrun, which may pass the barrier and exit
#: (closing the store) before the other nodes have read the reply: they log
#: "Error waiting on exit barrier ... Connection reset by peer" after a
#: successful run (pytorch/pytorch#69520).  Here every agent acknowledges in
#: the store once it is past the barrier, and node rank 0 (the store's host
#: under the static rendezvous corral uses) waits up to 5 s for every
#: acknowledgement before it exits.  Anything unexpected leaves torchrun as is.
TORCHRUN_EXIT_ACK = """
def _corral_exit_ack():
    try:
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
        orig = SimpleElasticAgent._exit_barrier
    except Exception:
        return
    import time
    def _exit_barrier(self, *args, **kwargs):
        result = orig(self, *args, **kwargs)
        try:
            group = self._worker_group
            store, nodes = self._store, int(group.group_world_size)
            store.add("corral_exit_ack", 1)
            if int(group.group_rank) == 0:
                deadline = time.monotonic() + 5.0
                while store.add("corral_exit_ack", 0) < nodes and time.monotonic() < deadline:
                    time.sleep(0.02)
        except Exception:
            pass
        return result
    SimpleElasticAgent._exit_barrier = _exit_barrier
_corral_exit_ack()
"""


def prewarm_program(module: str, *, elastic: bool, preload, agent_pid: int) -> str:
    """``python -c`` text that imports ``module`` now and runs it as ``python -m``
    once its job arrives; ``preload``: (wire name, source) of the modules of
    preloaded ranks, or None."""
    return PREWARM % {
        "module": module,
        "extra": TORCHRUN_EXIT_ACK if elastic else "",
        "preload": PRELOAD % (preload, [name for name, _ in preload]) if preload else "",
        "fixups": PREWARM_FIXUPS,
        "die_with_agent": DIE_WITH_AGENT % agent_pid,
    }
