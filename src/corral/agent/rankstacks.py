"""Python stacks of a node's ranks, on request (stdlib only; shipped as ``corral_agent_rankstacks``).

The rank hook registers ``faulthandler`` on a signal and writes each dump
to ``rank<N>.stacks`` in the job's log directory; here the agent signals
the ranks it knows (and the Python processes they started) and reads what
each one appended.
"""

import os
import time


def collect(tailer, sig: int, timeout: float = 3.0) -> dict:
    """Ask every rank on this node for its Python stacks; {rank: dump text}.

    Only the pids the rank hook registered are signalled (never by name),
    and only after the hook registered faulthandler on ``sig`` for them.
    The Python processes a rank started itself (mp.spawn workers) are asked
    too, under ``"<rank>/<pid>"``: the head shows them where their rank only
    waits for them.
    """
    log_dir = tailer.log_dir

    def path(key) -> str:
        if isinstance(key, tuple):
            return os.path.join(log_dir, "rank%d.w%d.stacks" % key)
        return os.path.join(log_dir, "rank%d.stacks" % key)

    def size(key) -> int:
        try:
            return os.path.getsize(path(key))
        except OSError:
            return 0

    workers = tailer.workers()
    before = {key: size(key) for key in [*tailer.pids, *workers]}
    asked = tailer.signal_ranks(int(sig))
    for key in workers:
        try:
            os.kill(key[1], int(sig))
            asked.append(key)
        except OSError:
            pass
    deadline = time.monotonic() + float(timeout)
    last = {}
    while time.monotonic() < deadline:
        now = {k: size(k) for k in asked}
        if all(now[k] > before.get(k, 0) for k in asked) and now == last:
            break  # every dump started, and none grew since the last look
        last = now
        time.sleep(0.1)
    out = {}
    for key in asked:
        try:
            with open(path(key), "rb") as f:
                f.seek(before.get(key, 0))
                name = "%d/%d" % key if isinstance(key, tuple) else str(key)
                out[name] = f.read().decode("utf-8", "replace")
        except OSError:
            pass
    return out
