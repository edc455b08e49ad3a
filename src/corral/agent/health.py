"""GPU and node health, read on the node (stdlib only, Python 3.8+).

Shipped to nodes as ``corral_agent_health``.  On a failure or a hang (and
for ``corral doctor`` before launch) the head asks each node for what its
GPUs and kernel say; the node sends the tools' raw text, bounded, and the
head parses it (``corral.diagnose.gpuhealth``), so a parser fix never needs
a new agent:

- the kernel's ``NVRM: Xid`` lines since a time (``journalctl -k``, else
  ``dmesg``), with the reason when the kernel log may not be read
  (``kernel.dmesg_restrict``, no journal group);
- ``nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER``: ECC counters,
  retired pages and remapped rows;
- NCCL's RAS status (NCCL >= 2.24): the ``ncclras`` client, else its
  documented text protocol on ``localhost:28028``, when a NCCL job runs there.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time

#: Longest text of one tool sent to the head (bytes).
MAX_TEXT = 256 * 1024
#: Kernel Xid lines kept (the newest).
MAX_XID_LINES = 200
#: NCCL's RAS client port (NCCL_RAS_ADDR changes it).
RAS_PORT = 28028
_TIMEOUT_S = 20.0


def _run(argv, timeout=_TIMEOUT_S):
    """(exit code, stdout, stderr) of ``argv``; (None, "", why) when it cannot run."""
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           timeout=timeout, env=dict(os.environ, LC_ALL="C"))
    except FileNotFoundError:
        return None, "", "%s: not installed" % argv[0]
    except (OSError, subprocess.SubprocessError) as e:
        return None, "", "%s: %s" % (argv[0], e)
    return (p.returncode, p.stdout[-MAX_TEXT:].decode("utf-8", "replace"),
            p.stderr[-4096:].decode("utf-8", "replace"))


def kernel_xids(since=None) -> dict:
    """``NVRM: Xid`` lines of the kernel log since ``since`` (epoch seconds;
    None: since boot).  {"lines": [...], "source": tool, "error": why or None}."""
    argv = ["journalctl", "-k", "-o", "short-unix", "-q", "--no-pager"]
    if since:
        argv += ["--since", "@%d" % int(since)]
    code, out, err = _run(argv)
    lines = [ln for ln in out.splitlines() if "NVRM: Xid" in ln]
    if code == 0 and (out.strip() or not _journal_denied(err)):
        return {"lines": lines[-MAX_XID_LINES:], "source": "journalctl -k", "error": None}
    journal_error = (err.strip().splitlines() or ["exit %s" % code])[0]
    code, out, err = _run(["dmesg"])
    if code != 0:
        why = (err.strip().splitlines() or ["exit %s" % code])[0]
        if "not permitted" in why.lower() or "permission" in why.lower():
            why += (" (kernel.dmesg_restrict=1: run as root, give the user CAP_SYSLOG, or set "
                    "kernel.dmesg_restrict=0)")
        return {"lines": [], "source": None, "error": "journalctl -k: %s; dmesg: %s" % (journal_error, why)}
    boot = _boot_time()
    keep = []
    for ln in out.splitlines():
        if "NVRM: Xid" not in ln:
            continue
        secs = _dmesg_seconds(ln)
        if since and boot is not None and secs is not None and boot + secs < since:
            continue
        keep.append(ln)
    return {"lines": keep[-MAX_XID_LINES:], "source": "dmesg", "error": None, "boot": boot}


def _journal_denied(err: str) -> bool:
    low = err.lower()
    return "insufficient permissions" in low or "no journal files" in low


def _boot_time():
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("btime "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _dmesg_seconds(line: str):
    """``[ 1234.567890] ...`` -> 1234.56789 (seconds since boot)."""
    if line.startswith("[") and "]" in line:
        try:
            return float(line[1:line.index("]")].strip())
        except ValueError:
            return None
    return None


def nvidia_smi_q() -> dict:
    """ECC, retired pages and remapped rows of every GPU (``nvidia-smi -q``)."""
    code, out, err = _run(["nvidia-smi", "-q", "-d", "ECC,PAGE_RETIREMENT,ROW_REMAPPER"])
    if code is None:
        return {"text": "", "error": err}
    if code != 0:
        said = (err.strip() or out.strip()).splitlines()
        return {"text": out, "error": said[-1] if said else "exit %d" % code}
    return {"text": out, "error": None}


def ncclras(port: int = RAS_PORT) -> dict:
    """NCCL's RAS status of the job on this node, as text; the ``ncclras``
    client when installed, else the same text protocol over the socket."""
    if shutil.which("ncclras"):
        code, out, err = _run(["ncclras", "-p", str(port), "-t", "5"], timeout=30)
        if code == 0:
            return {"text": out, "error": None, "source": "ncclras"}
        return {"text": out, "error": (err.strip().splitlines() or ["exit %s" % code])[-1], "source": "ncclras"}
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.settimeout(_TIMEOUT_S)
            s.sendall(b"CLIENT PROTOCOL 2\n")
            s.recv(4096)  # "SERVER PROTOCOL <n>"
            s.sendall(b"STATUS\n")
            chunks, total, deadline = [], 0, time.monotonic() + _TIMEOUT_S
            while total < MAX_TEXT and time.monotonic() < deadline:
                data = s.recv(65536)
                if not data:
                    break
                chunks.append(data)
                total += len(data)
    except ConnectionRefusedError:
        return {"text": "", "error": None, "source": None}  # no NCCL >= 2.24 job listening here
    except OSError as e:
        return {"text": "", "error": "localhost:%d: %s" % (port, e), "source": "socket"}
    return {"text": b"".join(chunks).decode("utf-8", "replace")[:MAX_TEXT], "error": None, "source": "socket"}


def health(since=None) -> dict:
    """Everything above for a node with NVIDIA GPUs; {"gpu": False} elsewhere
    (no ``nvidia-smi``: nothing to say about GPUs, and no Xids to read)."""
    if not shutil.which("nvidia-smi"):
        return {"gpu": False}
    return {"gpu": True, "xid": kernel_xids(since), "smi": nvidia_smi_q(), "ras": ncclras()}
