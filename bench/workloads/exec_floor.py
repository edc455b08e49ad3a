"""Benchmark helper: the least a Python `corral exec` could do before its ssh processes run.

    exec_floor.py CLUSTER.toml wrap|plain

Reads the cluster file, builds corral's own ssh argv (multiplexing included)
for every host and starts them all at once, with corral's remote cleanup
wrapper (``wrap``) or without it (``plain``); then collects the output.  No
click, asyncio or rich: it measures how far corral's start-up is from the
floor, and what the wrapper costs.  Not a tool: no timeouts, no errors.
"""

import os
import selectors
import subprocess
import sys
from pathlib import Path

import corral
from corral.inventory.tomlfile import read_corral_toml
from corral.transport.ssh import SSHTransport

# corral's remote wrapper, read from fanout.py's source: importing that module
# would import asyncio, which is what this floor leaves out.
_src = (Path(corral.__file__).parent / "fanout.py").read_text()
_start = _src.index("WRAPPER = (") + len("WRAPPER = ")
WRAPPER = eval(_src[_start:_src.index("\n)\n", _start) + 2])  # a parenthesised run of string literals

cluster = read_corral_toml(Path(sys.argv[1]))
wrap = sys.argv[2] == "wrap"
transport = SSHTransport(cluster, connect_timeout=10)
procs = []
for host in cluster.hosts:
    remote = ["sh", "-c", WRAPPER, "corral-exec", "hostname"] if wrap else ["hostname"]
    procs.append(subprocess.Popen(transport.argv(host, remote), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True))
sel = selectors.DefaultSelector()
out = {p: [] for p in procs}
for p in procs:
    sel.register(p.stdout, selectors.EVENT_READ, p)
    sel.register(p.stderr, selectors.EVENT_READ, p)
open_pipes = 2 * len(procs)
while open_pipes:
    for key, _ in sel.select():
        data = os.read(key.fileobj.fileno(), 65536)
        if data:
            out[key.data].append(data)
        else:
            sel.unregister(key.fileobj)
            open_pipes -= 1
for p in procs:
    p.stdin.close()
    p.wait()
sys.stdout.write("".join(b"".join(chunks).decode() for chunks in out.values()))
