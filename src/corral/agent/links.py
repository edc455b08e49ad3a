"""Node-to-node measurements for doctor and bench (stdlib only).

Called through the agent's ``call`` op as ``links.<function>``.  The head
orchestrates; each function here does one side of one measurement:

- TCP reachability: ``listen`` opens a port (kernel-chosen or given) on all
  addresses, ``connect`` tries peers and classifies failures (refused: no
  listener or a REJECT rule; timeout: packets dropped, a firewall; ...);
- SSH mesh: ``ssh_check`` runs ``ssh -o BatchMode=yes <peer> true`` to every
  peer, as DeepSpeed's pdsh launcher and MPI would, and classifies failures;
- bandwidth: ``sink_start``/``send`` are a built-in TCP sender and receiver
  (the receiver measures, after an omitted warm-up), ``iperf3_start``/
  ``iperf3_send`` drive iperf3 where it is installed;
- scratch files: ``scratch_write``/``scratch_remove`` put the smoke-test and
  benchmark scripts in a private temporary directory on the node.

Every server started here is stopped by its ``*_stop`` call, and in any case
when the agent exits (iperf3 servers are children in the agent's tree, which
the agent kills on exit).  Never imports corral.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time

try:  # on a node, modules are installed under their wire names
    from corral_agent_probes import free_port
except ImportError:  # imported as part of the corral package (tests, head)
    from corral.agent.probes import free_port

_servers: dict = {}
_lock = threading.Lock()
_CHUNK = 1 << 20
_SSH_OK = "corral-ssh-ok"


# --------------------------------------------------------------------------
# TCP reachability


def listen(port=0, seconds=60.0) -> dict:
    """Listen on ``port`` (0: a free one) on every address; return the port.

    Connections are accepted and closed.  Stops by itself after ``seconds``
    so a head that died leaves nothing behind.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("0.0.0.0", int(port)))
        s.listen(128)
    except OSError as e:
        s.close()
        return {"port": int(port), "error": e.strerror or str(e)}
    bound = _serve("tcp", s, seconds, lambda conn: conn.close())
    return {"port": bound, "error": None}


def _serve(kind: str, s: socket.socket, seconds: float, on_conn) -> int:
    """Accept on listening socket ``s`` in a thread until stopped or ``seconds`` pass.

    The server is registered under (kind, port) so that unlisten/sink_stop
    can stop it; ``on_conn`` gets each accepted connection.  Returns the port.
    """
    s.settimeout(0.2)
    port = s.getsockname()[1]
    stop = threading.Event()
    with _lock:
        _servers[(kind, port)] = (stop, s)

    def serve() -> None:
        deadline = time.monotonic() + float(seconds)
        while not stop.is_set() and time.monotonic() < deadline:
            try:
                conn, _ = s.accept()
            except (TimeoutError, OSError):
                continue
            on_conn(conn)
        s.close()

    threading.Thread(target=serve, daemon=True).start()
    return port


def unlisten(port) -> bool:
    with _lock:
        entry = _servers.pop(("tcp", int(port)), None)
    if entry is None:
        return False
    entry[0].set()
    return True


def connect(targets, wait=3.0) -> list:
    """Try every ``{"address", "port"}`` in parallel, ``wait`` seconds each; add ``"result"``.

    Results: ``ok``, ``refused``, ``timeout``, ``unreachable``, or
    ``error: <text>``.
    """
    out = [dict(t) for t in targets]

    def one(t: dict) -> None:
        t["result"] = _connect_one(t["address"], int(t["port"]), float(wait))

    threads = [threading.Thread(target=one, args=(t,), daemon=True) for t in out]
    for th in threads:
        th.start()
    for th in threads:
        th.join(float(wait) + 5)
    for t in out:
        t.setdefault("result", "timeout")
    return out


def _connect_one(address, port, timeout) -> str:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect((address, port))
        return "ok"
    except TimeoutError:
        return "timeout"
    except OSError as e:
        if e.errno == errno.ECONNREFUSED:
            return "refused"
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return "unreachable"
        if e.errno == errno.ETIMEDOUT:
            return "timeout"
        return "error: %s" % (e.strerror or e)
    finally:
        s.close()


# --------------------------------------------------------------------------
# SSH mesh


#: ssh logins a node runs at once in the mesh check (see ssh_check).
MESH_PARALLEL = 4


def ssh_check(targets, connect_timeout=5) -> list:
    """``ssh -o BatchMode=yes <peer> true`` to every target, in parallel.

    ``targets``: ``[{"name", "port", "user"}]``; adds ``"result"`` (``ok``,
    ``unknown-host-key``, ``changed-host-key``, ``permission-denied``,
    ``refused``, ``closed``, ``timeout``, ``unresolved``, ``unreachable``,
    ``no-ssh``, ``error``) and ``"detail"`` (ssh's last line) to each.
    """
    exe = shutil.which("ssh")
    out = [dict(t) for t in targets]
    if exe is None:
        for t in out:
            t.update(result="no-ssh", detail="no ssh client on this node")
        return out

    def one(t: dict) -> None:
        argv = [exe, "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(connect_timeout)}"]
        if t.get("port"):
            argv += ["-p", str(t["port"])]
        if t.get("user"):
            argv += ["-l", t["user"]]
        argv += [t["name"], "echo", _SSH_OK]
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, check=False,
                                  timeout=int(connect_timeout) + 10)
        except subprocess.TimeoutExpired:
            t.update(result="timeout", detail="ssh did not finish")
            return
        # Success is the remote echo, not the exit status: the agent reaps
        # zombie children, which can leave subprocess with a made-up 0.
        ok = _SSH_OK in proc.stdout.decode(errors="replace")
        stderr = proc.stderr.decode(errors="replace").strip()
        t["result"] = "ok" if ok else classify_ssh(stderr)
        t["detail"] = "" if ok else (stderr.splitlines()[-1] if stderr else "no output")

    # A few at a time, in the order given (the head starts each node's list
    # at a different peer): every node logging in to every other at once
    # would hand each sshd N-1 unauthenticated connections together, and
    # sshd's default MaxStartups (10:30:100) drops some of them on more than
    # ten nodes -- a false failure.  One retry for a login dropped that way.
    todo = list(out)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not todo:
                    return
                t = todo.pop(0)
            one(t)
            if t.get("result") == "closed":
                time.sleep(0.5 + random.random())
                one(t)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(MESH_PARALLEL, len(out)))]
    for th in threads:
        th.start()
    rounds = (len(out) + MESH_PARALLEL - 1) // MESH_PARALLEL
    deadline = time.monotonic() + rounds * (2 * int(connect_timeout) + 12) + 15
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    for t in out:
        t.setdefault("result", "timeout")
        t.setdefault("detail", "")
    return out



def classify_ssh(stderr) -> str:
    text = stderr.lower()
    if "remote host identification has changed" in text:
        return "changed-host-key"
    if "host key verification failed" in text or "no host key is known" in text:
        return "unknown-host-key"
    if "permission denied" in text:
        return "permission-denied"
    if "could not resolve hostname" in text or "name or service not known" in text:
        return "unresolved"
    if "connection refused" in text:
        return "refused"
    if "timed out" in text:
        return "timeout"
    if "no route to host" in text or "network is unreachable" in text:
        return "unreachable"
    if ("kex_exchange_identification" in text or "connection closed by" in text
            or "connection reset by" in text):
        return "closed"  # by the peer's sshd before any login: MaxStartups, DenyUsers, hosts.deny
    return "error"


# --------------------------------------------------------------------------
# bandwidth: built-in sender and receiver


def sink_start(omit=0.5, seconds=600.0) -> dict:
    """A TCP receiver on a free port: counts what each sender sends.

    When a sender shuts down its side, the sink answers with the bytes it
    received after ``omit`` seconds (TCP slow start) and for how long, then
    closes.  One sender at a time per measurement; several are fine.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 0))
    s.listen(16)

    def drain(conn: socket.socket) -> None:
        threading.Thread(target=_drain, args=(conn, float(omit)), daemon=True).start()

    return {"port": _serve("sink", s, seconds, drain)}


def _drain(conn, omit) -> None:
    buf = bytearray(_CHUNK)
    counted, start, last = 0, None, None
    first = None
    try:
        conn.settimeout(30.0)
        while True:
            n = conn.recv_into(buf)
            if not n:
                break
            now = time.monotonic()
            if first is None:
                first = now
            if now - first >= omit:
                if start is None:
                    start = now
                else:
                    counted += n
                last = now
        elapsed = (last - start) if (start is not None and last is not None) else 0.0
        conn.sendall(struct.pack("!Qd", counted, elapsed))
    except OSError:
        pass
    finally:
        conn.close()


def sink_stop(port) -> bool:
    with _lock:
        entry = _servers.pop(("sink", int(port)), None)
    if entry is None:
        return False
    entry[0].set()
    return True


def send(address, port, seconds=2.0, omit=0.5) -> dict:
    """Send to a sink for ``omit + seconds``; the sink's count is the result."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.settimeout(5.0)
    payload = b"\0" * _CHUNK
    try:
        s.connect((address, int(port)))
        s.settimeout(15.0)
        end = time.monotonic() + float(omit) + float(seconds)
        while time.monotonic() < end:
            s.sendall(payload)
        s.shutdown(socket.SHUT_WR)
        reply = b""
        while len(reply) < 16:
            chunk = s.recv(16 - len(reply))
            if not chunk:
                break
            reply += chunk
    except OSError as e:
        return {"bps": None, "error": _net_error(e)}
    finally:
        s.close()
    if len(reply) < 16:
        return {"bps": None, "error": "the receiver closed without a count"}
    counted, elapsed = struct.unpack("!Qd", reply)
    if elapsed <= 0:
        return {"bps": None, "error": "too little data to measure"}
    return {"bps": counted * 8 / elapsed, "seconds": elapsed, "bytes": counted, "error": None}


def _net_error(e) -> str:
    if isinstance(e, socket.timeout):
        return "timeout"
    if getattr(e, "errno", None) == errno.ECONNREFUSED:
        return "refused"
    return e.strerror or str(e)


# --------------------------------------------------------------------------
# bandwidth: iperf3


def iperf3_start() -> dict:
    """Start ``iperf3 -s`` on a free port; stopped by ``iperf3_stop`` or agent exit."""
    exe = shutil.which("iperf3")
    if exe is None:
        return {"port": None, "error": "iperf3 is not installed"}
    for _ in range(5):
        port = free_port()
        proc = subprocess.Popen([exe, "-s", "-p", str(port)], stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and proc.poll() is None:
            if _connect_one("127.0.0.1", port, 0.2) == "ok":
                with _lock:
                    _servers[("iperf3", port)] = proc
                return {"port": port, "error": None}
            time.sleep(0.05)
        _kill(proc)
    return {"port": None, "error": "iperf3 -s did not start"}


def iperf3_stop(port) -> bool:
    with _lock:
        proc = _servers.pop(("iperf3", int(port)), None)
    if proc is None:
        return False
    _kill(proc)
    return True


def iperf3_send(address, port, seconds=2.0, omit=1) -> dict:
    """``iperf3 -c`` for ``seconds`` after ``omit``; the receiver's rate is the result."""
    exe = shutil.which("iperf3")
    if exe is None:
        return {"bps": None, "error": "iperf3 is not installed"}
    argv = [exe, "-c", address, "-p", str(port), "-t", str(max(1, round(float(seconds)))),
            "-O", str(int(omit)), "--json"]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, check=False,
                              timeout=float(seconds) + float(omit) + 30)
    except subprocess.TimeoutExpired:
        return {"bps": None, "error": "iperf3 -c did not finish"}
    try:
        report = json.loads(proc.stdout.decode(errors="replace") or "{}")
    except ValueError:
        report = {}
    if report.get("error"):
        return {"bps": None, "error": report["error"]}
    received = (report.get("end") or {}).get("sum_received") or {}
    if "bits_per_second" not in received:
        tail = proc.stderr.decode(errors="replace").strip()
        return {"bps": None, "error": tail or f"iperf3 gave no result (exit {proc.returncode})"}
    return {"bps": float(received["bits_per_second"]), "seconds": received.get("seconds"),
            "bytes": received.get("bytes"), "error": None}


def _kill(proc) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=3)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=3)


# --------------------------------------------------------------------------
# scratch files for the smoke test and the benchmark scripts


def scratch_write(files) -> str:
    """Write ``{name: text}`` into a new private temporary directory; return it."""
    path = tempfile.mkdtemp(prefix="corral-scratch-")
    for name, text in files.items():
        if os.sep in name or name.startswith("."):
            raise ValueError(f"scratch file names must be plain names, got {name!r}")
        with open(os.path.join(path, name), "w") as f:
            f.write(text)
    return path


def scratch_remove(path) -> bool:
    """Remove a directory made by ``scratch_write`` (and nothing else)."""
    base = os.path.basename(os.path.normpath(path))
    if not base.startswith("corral-scratch-") or os.path.dirname(os.path.normpath(path)) != tempfile.gettempdir():
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True
