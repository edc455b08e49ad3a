"""Small node-side checks run by the agent before a launch (stdlib only).

Called through the agent's ``call`` op as ``probes.<function>``; arguments
and results are JSON.  Everything here is read-only except the short-lived
listening sockets used to prove that peers can reach the rendezvous address.
"""

from __future__ import annotations

import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time

_listeners: dict = {}

#: Interface name prefixes that never carry traffic between nodes.
_NOT_BETWEEN_NODES = ("lo", "docker", "veth", "virbr", "br-", "cni", "flannel", "cali", "kube-ipvs")


def interfaces() -> list:
    """IPv4 address of each interface: [{"name", "address", "prefix"}]."""
    out = []
    try:
        import fcntl

        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for _, name in socket.if_nameindex():
                packed = struct.pack("256s", name.encode()[:15])
                try:
                    addr = fcntl.ioctl(sock.fileno(), 0x8915, packed)  # SIOCGIFADDR
                    mask = fcntl.ioctl(sock.fileno(), 0x891B, packed)  # SIOCGIFNETMASK
                except OSError:
                    continue  # no IPv4 address on this interface
                address = socket.inet_ntoa(addr[20:24])
                prefix = bin(struct.unpack("!I", mask[20:24])[0]).count("1")
                out.append({"name": name, "address": address, "prefix": prefix})
        finally:
            sock.close()
    except (ImportError, OSError, AttributeError):
        pass
    return out


def routable_addresses() -> list:
    """Addresses that may reach other nodes (not loopback/docker/veth...)."""
    return [i for i in interfaces() if not i["name"].startswith(_NOT_BETWEEN_NODES)]


def gpu_table():
    """``[(index, uuid), ...]`` of nvidia-smi's list (``nvidia-smi -L``); None
    when there is no nvidia-smi (or it fails)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        res = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    table = []
    for line in res.stdout.splitlines():
        if line.startswith("GPU "):
            uuid = line.rsplit("UUID: ", 1)[1].rstrip(")").strip() if "UUID: " in line else ""
            table.append((str(len(table)), uuid))
    return table


def gpu_count(visible=None, table=False):
    """GPUs a job here sees: nvidia-smi's list cut by CUDA_VISIBLE_DEVICES (the
    job's own ``visible`` when it sets one, else this process's); None when
    there is no nvidia-smi.  ``table``: ``gpu_table()``'s answer, when known."""
    listed = gpu_table() if table is False else table
    if listed is None:
        return None
    return visible_count(len(listed), os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible)


def visible_entries(table, visible):
    """The GPUs a job sees, as nvidia-smi indices (strings) where they can be
    told, else as named (a UUID nvidia-smi does not list, or no nvidia-smi).
    ``visible``: its CUDA_VISIBLE_DEVICES (None: unset, every listed GPU)."""
    if visible is None:
        return [i for i, _ in table or ()]
    by_uuid = {u: i for i, u in table or () if u}
    out = []
    for entry in visible.split(","):
        entry = entry.strip()
        ok = entry.isdigit() and (table is None or int(entry) < len(table))
        if not ok and not entry.startswith(("GPU-", "MIG-")):
            break  # where CUDA stops reading the list
        out.append(str(int(entry)) if entry.isdigit() else by_uuid.get(entry, entry))
    return out


def busy_gpus(entries, table, mine=()):
    """Processes on the GPUs ``entries`` that no corral job of this user
    started (``mine``: the live holders' agent pids): ``[{"gpu", "pid",
    "name", "mib"}]``, from ``nvidia-smi --query-compute-apps``; [] where it
    cannot say."""
    exe = shutil.which("nvidia-smi")
    if exe is None or not entries or not table:
        return []
    try:
        res = subprocess.run([exe, "--query-compute-apps=gpu_uuid,pid,process_name,used_memory",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if res.returncode != 0:
        return []
    index = {u: i for i, u in table if u}
    keep = set(entries)
    parents = None
    out = []
    for line in res.stdout.splitlines()[:4096]:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4 or not parts[1].isdigit():
            continue
        gpu = index.get(parts[0])
        if gpu is None or gpu not in keep:
            continue
        pid = int(parts[1])
        if parents is None:
            parents = _parents()
        if _below(pid, set(mine) | {os.getpid()}, parents):
            continue
        mib = int(parts[3]) if parts[3].isdigit() else None
        out.append({"gpu": gpu, "pid": pid, "name": os.path.basename(parts[2])[:60], "mib": mib})
    return out


def _parents():
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open("/proc/%s/stat" % name, "rb") as f:
                    data = f.read()
                out[int(name)] = int(data[data.rfind(b")") + 2:].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def _below(pid, roots, parents):
    """Whether ``pid`` is one of ``roots`` or descends from one."""
    seen = 0
    while pid > 1 and seen < 4096:
        if pid in roots:
            return True
        pid = parents.get(pid, 0)
        seen += 1
    return False


def visible_count(listed, visible):
    """GPUs a CUDA program sees when nvidia-smi lists ``listed`` and
    CUDA_VISIBLE_DEVICES is ``visible`` (None: unset).

    CUDA reads the list in order and stops at the first entry that names no
    device (``-1``, an index past the last GPU, a typo): ``0,2,-1,1`` is two
    GPUs, ``""`` and ``-1`` none.  Entries are indices or ``GPU-``/``MIG-`` UUIDs.
    """
    if visible is None:
        return listed
    n = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.isdigit():
            if int(entry) >= listed:
                break
        elif not entry.startswith(("GPU-", "MIG-")):
            break
        n += 1
    return min(n, listed)


def free_port() -> int:
    """A TCP port that is free on this host right now (the kernel's pick)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind(("", 0))
        return s.getsockname()[1]
    finally:
        s.close()


def hostname_addresses(hostname=None) -> list:
    """What this node's host name resolves to, in getaddrinfo's order: gloo
    advertises the first address to the other ranks unless GLOO_SOCKET_IFNAME
    names an interface."""
    try:
        infos = socket.getaddrinfo(hostname or socket.gethostname(), None, 0, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def advertises_loopback(resolved):
    """Whether gloo, given what a node's host name resolves to (in order),
    would tell the other nodes to connect to a loopback address: it takes the
    first one, and 127.0.0.1 when there is none (Debian's ``127.0.1.1 host``)."""
    import ipaddress

    return not resolved or ipaddress.ip_address(resolved[0].split("%")[0]).is_loopback


def _hostname_addresses_quickly(seconds=2.0):
    """``hostname_addresses()``, or None when the resolver takes longer (a DNS
    server that does not answer): preflight must not wait on it."""
    out = []
    worker = threading.Thread(target=lambda: out.append(hostname_addresses()), daemon=True)
    worker.start()
    worker.join(seconds)
    return out[0] if out else None


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _differs(path, size, sha256) -> bool:
    """Whether the file at ``path`` is not ``size`` bytes with this sha256 (hashed only when the size matches)."""
    import hashlib

    try:
        if os.path.getsize(path) != size:
            return True
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest() != sha256
    except OSError:
        return False  # missing or unreadable: reported (or not) as such, not as different


def accelerate_config_mode(path):
    """``distributed_type`` an accelerate config file (YAML or JSON) sets, upper-cased, or None."""
    import re

    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(1 << 20)
    except (OSError, ValueError):
        return None
    m = re.search(r'(?:^|[{,])\s*"?distributed_type"?\s*:\s*["\']?(\w+)', text, re.MULTILINE)
    return m.group(1).upper() if m else None


def accelerate_default_path():
    """Where accelerate looks for its default config on this node (``~`` kept for showing)."""
    if os.environ.get("HF_HOME"):
        return os.path.join(os.environ["HF_HOME"], "accelerate", "default_config.yaml")
    if os.environ.get("XDG_CACHE_HOME"):
        return os.path.join(os.environ["XDG_CACHE_HOME"], "huggingface", "accelerate", "default_config.yaml")
    return "~/.cache/huggingface/accelerate/default_config.yaml"


def accelerate_default_config(limit=64 << 10):
    """``[path, text]`` of this node's accelerate default config, if it has one
    (the head parses and checks it: accelerate reads it on this node)."""
    path = accelerate_default_path()
    try:
        with open(os.path.expanduser(path), "rb") as f:
            data = f.read(limit + 1)
    except (OSError, ValueError):
        return None
    if len(data) > limit:
        return None
    return [path, data.decode("utf-8", "replace")]


def accelerate_default_mode():
    """``distributed_type`` of this node's accelerate default config, if it has one.

    accelerate reads ``$HF_HOME/accelerate/default_config.yaml`` (HF_HOME
    defaults to ``$XDG_CACHE_HOME/huggingface``, i.e. ``~/.cache/huggingface``)
    when no ``--config_file`` is given, but only when no mode flag is."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    return accelerate_config_mode(os.path.join(home, "accelerate", "default_config.yaml"))


def fstype(path, mountinfo="/proc/self/mountinfo"):
    """The type of the file system ``path`` is on (``ext4``, ``nfs4``,
    ``lustre``...), from the longest mount point above it; None if unknown."""
    try:
        real = os.path.realpath(path)
        with open(mountinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    best, kind = "", None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields = left.split()
        if not sep or len(fields) < 5 or not right.split():
            continue
        point = fields[4].replace("\\040", " ")
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, right.split()[0]
    return kind


def dir_identity(path):
    """[kernel boot id, st_dev, st_ino]: two nodes with the same one see the
    very same directory (containers on one machine sharing a volume)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        st = os.stat(path)
    except OSError:
        return None
    return [boot, st.st_dev, st.st_ino]


def machine_identity():
    """[kernel boot id, network namespace]: two hosts of a cluster file with the
    same one are one machine reached under two names (an IP address and a
    name), not two nodes."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return [boot, os.stat("/proc/self/ns/net").st_ino]
    except OSError:
        return None


def preflight(workdir=None, paths=(), modules=(), want_port=False, env_names=(), compare=None,
              accelerate=False, cuda_visible_devices=None, hold=None) -> dict:
    """Everything the head needs to plan a launch, in one round trip.

    ``compare`` is ``{path: [size, sha256]}`` of the head's copies of files in
    ``paths``; the ones whose copy here differs are listed in ``differs``.
    ``cuda_visible_devices`` is the job's own, when it sets one (cluster file,
    --env): the GPUs counted are the ones its ranks will see.  ``hold``
    (``{"run_id", "head", "gpus", "port"}``): hold the job's GPUs (and, on
    node 0, its port) in this node's registry, see ``hold_for_job``."""
    table = gpu_table()
    result = {
        "hostname": socket.gethostname(),
        "hostname_addresses": _hostname_addresses_quickly(),
        "machine": machine_identity(),
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "addresses": routable_addresses(),
        "gpus": gpu_count(cuda_visible_devices, table),
        "cpus": os.cpu_count(),
        "workdir": None,
        "missing": [],
        "modules": {m: _importable(m) for m in modules},
        "env": {k: os.environ[k] for k in env_names if k in os.environ},
        "differs": [],
    }
    if accelerate:
        result["accelerate_mode"] = accelerate_default_mode()
        result["accelerate_config"] = accelerate_default_config()
    base = None
    if workdir:
        workdir = os.path.expanduser(workdir)  # `~/proj`: this node's home
        exists = os.path.isdir(workdir)
        result["workdir"] = {"path": workdir, "exists": exists, "writable": exists and os.access(workdir, os.W_OK),
                             "fstype": fstype(workdir) if exists else None,
                             "identity": dir_identity(workdir) if exists else None}
        if not exists and os.path.islink(workdir):
            result["workdir"]["link_to"] = os.readlink(workdir)  # a link to a directory that is gone
        base = workdir if exists else None
    for p in paths:
        full = p if os.path.isabs(p) or base is None else os.path.join(base, p)
        if not os.path.exists(full):
            result["missing"].append(p)
        elif compare and p in compare and _differs(full, *compare[p]):
            result["differs"].append(p)
    if hold is not None:
        result["hold"] = hold_for_job(hold, table, cuda_visible_devices, want_port)
        if want_port:
            result["port"] = result["hold"].get("port")
    elif want_port:
        result["port"] = free_port()
    return result


def hold_for_job(hold, table, visible, want_port) -> dict:
    """Hold the GPUs the job will use here, and its port on node 0 (see
    ``corral_agent_holds``): ``hold["gpus"]`` (``--gpus``), else those its
    CUDA_VISIBLE_DEVICES shows, else every GPU nvidia-smi lists.  Answers
    ``missing`` (asked-for GPUs this node does not have), or ``holds.claim``'s
    answer with the ``gpus`` held and ``busy`` (processes on them that no
    corral job of this user started)."""
    try:
        from corral_agent_holds import claim, holdings
    except ImportError:
        from corral.agent.holds import claim, holdings
    asked = hold.get("gpus")
    if asked is not None:
        missing = [g for g in asked if table is not None and int(g) >= len(table)]
        if missing or table == []:
            return {"missing": missing or list(asked), "listed": len(table)}
        entries = [str(int(g)) for g in asked]
    else:
        if visible is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        entries = visible_entries(table, visible) if table is not None or visible is not None else []
    try:
        got = claim(str(hold["run_id"]), head=str(hold.get("head") or ""), gpus=entries,
                    port=hold.get("port"), want_port=want_port)
    except Exception as e:  # an unsafe registry dir (UnsafePlace), no space: named by the head
        unsafe = type(e).__name__ == "UnsafePlace"
        return {"error": str(e) if unsafe else "%s: %s" % (type(e).__name__, e), "unsafe": unsafe}
    got["gpus"] = entries
    if "held_by" not in got and "port_held_by" not in got and entries and table:
        got["busy"] = busy_gpus(entries, table, mine=[h["pid"] for h in holdings() if h["pid"]])
    return got


def listen_start(addresses, port, seconds=10.0) -> dict:
    """Listen on ``port`` at each address until ``listen_stop`` (or timeout).

    Peers then ``connect`` to prove the rendezvous address is reachable from
    every node (firewalls, wrong interfaces) before torchrun is started.
    """
    bound, errors = [], {}
    socks = []
    for addr in addresses:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
            s.listen(64)
            s.settimeout(0.2)
            socks.append(s)
            bound.append(addr)
        except OSError as e:
            errors[addr] = str(e)
            s.close()
    stop = threading.Event()
    _listeners[port] = (stop, socks)

    def serve() -> None:
        deadline = time.monotonic() + float(seconds)
        while not stop.is_set() and time.monotonic() < deadline:
            for s in socks:
                try:
                    conn, _ = s.accept()
                except (socket.timeout, OSError):
                    continue
                # Let the client close first, so TIME_WAIT stays on its side
                # and torchrun can bind this port right after.
                conn.settimeout(2.0)
                try:
                    conn.recv(1)
                except OSError:
                    pass
                conn.close()
        for s in socks:
            s.close()

    threading.Thread(target=serve, daemon=True).start()
    return {"bound": bound, "errors": errors}


def listen_stop(port) -> bool:
    """Stop listening on ``port``: closed before this returns, so the job's
    launcher can bind it the moment the head goes on (the serving thread may
    take up to 2 s to notice; a socket it still held made a fast job's bind
    fail with EADDRINUSE)."""
    entry = _listeners.pop(port, None)
    if entry is None:
        return False
    stop, socks = entry
    stop.set()
    for s in socks:
        try:
            s.shutdown(socket.SHUT_RDWR)  # wakes an accept() of the serving thread
        except OSError:
            pass
        s.close()
    return True


def connect(addresses, port, timeout=3.0, each_s=None) -> dict:
    """Try a TCP connection to each address; {address: "ok" | reason}.
    ``each_s``: seconds per address (the head's name for ``timeout``, which
    its call's own timeout would shadow)."""
    out = {}
    for addr in addresses:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(float(each_s if each_s is not None else timeout))
        try:
            s.connect((addr, port))
            out[addr] = "ok"
        except OSError as e:
            out[addr] = str(e) or type(e).__name__
        finally:
            s.close()
    return out


def dir_facts(path, base=None) -> dict:
    """Where a directory the job writes to (``--checkpoint-dir``) lives: its
    file system and identity, read from the nearest directory that exists
    (a checkpoint directory the script has not created yet is judged by the
    one it will be created in).  ``base``: the work dir, for a relative path."""
    path = os.path.expanduser(str(path))
    if base and not os.path.isabs(path):
        path = os.path.join(os.path.expanduser(str(base)), path)
    near = path
    while not os.path.isdir(near) and os.path.dirname(near) != near:
        near = os.path.dirname(near)
    return {"path": path, "exists": os.path.isdir(path), "fstype": fstype(near),
            "identity": dir_identity(near)}
