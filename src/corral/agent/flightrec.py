"""The collective flight recorder on a node (stdlib only, Python 3.8+).

Shipped to nodes as ``corral_agent_flightrec``.  The agent turns PyTorch's
flight recorder on in the job's environment, with torch's own dump files in
the job's node-local directory (``<job dir>/flightrec``).  The rank hook
(``hook/sitecustomize.py``) writes a dump when asked through its FIFO and
when its process exits; the agent sends the dumps to the head as
``flightrec`` events (one per file, bounded by ``MAX_SEND``), before the job's
directory is removed.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import stat
import time

#: Largest dump sent to the head (bytes of the file); a larger JSON dump is
#: cut to its newest entries (the head reads frames of up to 4 MiB).
MAX_SEND = 2 * 1024 * 1024
#: The files the rank hook writes: suffix -> format on the wire.
FORMATS = {".cpu.json": "json", ".nccl.json": "json", ".nccl.pkl": "pickle"}


def job_env(fr_dir: str, env: dict) -> dict:
    """What turns the flight recorder on: ``CORRAL_FR_DIR`` for the rank hook,
    which sets torch's own variables in the rank itself, under the names the
    rank's torch reads (``hook/sitecustomize.py``, ``_corral_fr_env``): only
    the rank's Python knows which torch it imports."""
    return {} if env.get("CORRAL_FR_DIR") else {"CORRAL_FR_DIR": fr_dir}


def request(fr_dir: str, ranks, timeout: float = 3.0) -> dict:
    """Ask each live rank (its hook's FIFO) for a dump; wait up to ``timeout``
    for them.  {rank: "dumped" | "no answer" | "no flight recorder"}."""
    before = {r: _done(fr_dir, r) for r in ranks}
    asked = []
    out = {}
    for r in ranks:
        fifo = os.path.join(fr_dir, "rank%d.fifo" % r)
        try:
            st = os.lstat(fifo)
            if not stat.S_ISFIFO(st.st_mode) or st.st_uid != os.getuid():
                raise OSError(errno.EPERM, "not our FIFO")
            # Non-blocking: a rank without the hook's thread (exited) gives ENXIO at once.
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            try:
                os.write(fd, b"1")
            finally:
                os.close(fd)
            asked.append(r)
        except OSError:
            out[r] = "no flight recorder"
    deadline = time.monotonic() + timeout
    while asked and time.monotonic() < deadline:
        asked = [r for r in asked if _done(fr_dir, r) == before[r]]
        if asked:
            time.sleep(0.05)
    for r in ranks:
        out.setdefault(r, "no answer" if r in asked else "dumped")
    return out


def _done(fr_dir: str, rank: int) -> str:
    try:
        with open(os.path.join(fr_dir, "rank%d.done" % rank)) as f:
            return f.read(64)
    except OSError:
        return ""


def send_dumps(chan, fr_dir: str, pids: dict) -> int:
    """Send every dump file in ``fr_dir`` as a ``flightrec`` event; how many.
    Only ranks the agent knows (``pids``: rank -> pid, from the hook's pid
    files) and only regular files of ours."""
    sent = 0
    for rank in sorted(pids):
        for suffix, fmt in FORMATS.items():
            name = "rank%d%s" % (rank, suffix)
            data = _read(os.path.join(fr_dir, name))
            if data is None:
                continue
            if len(data) > MAX_SEND:
                data = _newest(data, fmt)
                if data is None:
                    continue
            text = data.decode("utf-8", "replace") if fmt == "json" else base64.b64encode(data).decode()
            chan.send(ev="flightrec", r=rank, pid=pids[rank], name=name, fmt=fmt, data=text)
            sent += 1
    return sent


def _read(path: str):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return None
        return f.read(16 * MAX_SEND)


def _newest(data: bytes, fmt: str):
    """A JSON dump over ``MAX_SEND`` cut to its newest entries; None for a
    pickle (its size cannot be cut without reading it)."""
    if fmt != "json":
        return None
    try:
        dump = json.loads(data)
        entries = dump["entries"]
    except (ValueError, KeyError, TypeError):
        return None
    while entries:
        entries = entries[len(entries) // 4 or 1:]
        dump["entries"] = entries
        out = json.dumps(dump).encode()
        if len(out) <= MAX_SEND:
            return out
    return None
