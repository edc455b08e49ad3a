"""Pack the node agent for the wire and build the bootstrap command.

The remote command line stays short and fixed: a one-line bootstrap reads a
length-prefixed JSON payload from stdin (the agent's modules), installs them
as in-memory modules and hands stdin over to the agent, which keeps reading
its ops from it.  Nothing is written to the node's disk to start it.
"""

from __future__ import annotations

import json
from functools import lru_cache
from importlib import resources

#: Node-side modules, in dependency order: wire name -> file in corral/agent.
NODE_MODULES = {
    "corral_agent_probes": "probes.py",
    "corral_agent_health": "health.py",
    "corral_agent_facts": "facts.py",
    "corral_agent_links": "links.py",
    "corral_agent_proctree": "proctree.py",
    "corral_agent_relay": "relay.py",
    "corral_agent_telemetry": "telemetry.py",
    "corral_agent_prescan": "prescan.py",
    "corral_agent_jobenv": "jobenv.py",
    "corral_agent_private": "private.py",
    "corral_agent_jobdir": "jobdir.py",
    "corral_agent_flightrec": "flightrec.py",
    "corral_agent_holds": "holds.py",
    "corral_agent_prewarm": "prewarm.py",
    "corral_agent_rankstacks": "rankstacks.py",
    "corral_agent_node": "node.py",
}
MAIN = "corral_agent_node"

# Runs from the payload (not argv), so it can be longer and checked.
_BOOT = """
import sys, types
if sys.version_info < (3, 8):
    sys.stdout.write('{"ev":"fatal","kind":"old-python","t":"corral needs Python 3.8+ on the node, found %s"}\\n' % sys.version.split()[0])
    sys.stdout.flush()
    raise SystemExit(3)
for _name in _b["order"]:
    _m = types.ModuleType(_name)
    _m.__file__ = "<corral:%s>" % _name
    sys.modules[_name] = _m
for _name in _b["order"]:
    exec(compile(_b["modules"][_name], "<corral:%s>" % _name, "exec"), sys.modules[_name].__dict__)
raise SystemExit(sys.modules[_b["main"]].main(_r))
"""

#: The whole remote program as seen in argv/ps.  It runs on Python 2 too
#: (no stdin.buffer there), so that a node's old ``python`` is named by version.
BOOTSTRAP = (
    "import sys,json;_r=getattr(sys.stdin,'buffer',sys.stdin);_n=int(_r.readline());"
    "_b=json.loads(_r.read(_n).decode());exec(_b['boot'])"
)


@lru_cache(maxsize=1)
def hook_source() -> str:
    """The rank hook (sitecustomize) the agent installs for the workload."""
    return resources.files("corral.agent").joinpath("hook/sitecustomize.py").read_text()


#: What the prewarmed torchrun installs for preloaded ranks, in dependency order.
PRELOAD_MODULES = {"corral_agent_prescan": "prescan.py", "corral_agent_preload": "preload.py"}


@lru_cache(maxsize=1)
def preload_modules() -> tuple[tuple[str, str], ...]:
    """(wire name, source) of preloaded ranks' modules, sent with the ``prewarm`` op."""
    pkg = resources.files("corral.agent")
    return tuple((name, pkg.joinpath(fname).read_text()) for name, fname in PRELOAD_MODULES.items())


@lru_cache(maxsize=1)
def payload() -> bytes:
    """Length-prefixed JSON with the agent's modules: what the head writes first."""
    pkg = resources.files("corral.agent")
    modules = {name: pkg.joinpath(fname).read_text() for name, fname in NODE_MODULES.items()}
    body = json.dumps(
        {"boot": _BOOT, "order": list(NODE_MODULES), "modules": modules, "main": MAIN}
    ).encode()
    return str(len(body)).encode() + b"\n" + body


def remote_argv(python: str, tag: str) -> list[str]:
    """argv that starts the agent on a node; ``tag`` makes it findable in ps."""
    return [python, "-c", BOOTSTRAP, "corral-agent", tag]
