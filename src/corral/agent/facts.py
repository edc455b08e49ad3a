"""Facts about one node, for ``corral doctor`` and ``corral bench`` (stdlib only).

Called through the agent's ``call`` op as ``facts.collect``: one round trip
per node returns everything the head-side checks (``corral.doctor.checks``) reason
about.  Collecting never raises: what cannot be read is ``None`` (or empty)
and the reason goes to ``errors``, so one odd node never hides the others.

Heavy packages are not imported into the agent: versions come from package
metadata, and torch (whose CUDA build and NCCL version only an import can
tell) is imported in a child process of the node's own interpreter, with a
timeout, so a broken or hanging torch is a fact about the node, not a dead
agent.

Runs on the node's Python (3.8+); never imports corral.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import time

try:  # on a node, modules are installed under their wire names
    from corral_agent_health import health as gpu_health
    from corral_agent_probes import hostname_addresses
except ImportError:  # imported as part of the corral package (tests, head)
    from corral.agent.health import health as gpu_health
    from corral.agent.probes import hostname_addresses

#: Distributions reported under ``packages`` (name in the facts -> dist names tried).
PACKAGES = {
    "torch": ("torch",),
    "deepspeed": ("deepspeed",),
    "accelerate": ("accelerate",),
    "transformers": ("transformers",),
    "lightning": ("lightning", "pytorch-lightning"),
    "numpy": ("numpy",),
}
#: Environment variables worth reporting (never secrets: see ``_SECRET``).
ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "CUDA_", "MASTER_", "UCX_", "FI_", "TP_SOCKET_", "OMP_")
ENV_NAMES = ("LD_LIBRARY_PATH", "PYTHONPATH", "VIRTUAL_ENV", "CONDA_PREFIX")
_SECRET = re.compile(r"TOKEN|SECRET|PASSW|_KEY$|APIKEY|CREDENTIAL", re.IGNORECASE)

#: Child process that imports torch and says what it was built with.
_TORCH_PROBE = r"""
import json, sys, time
t0 = time.time()
out = {}
try:
    import torch
    out["version"] = torch.__version__
    out["cuda"] = getattr(torch.version, "cuda", None)
    out["hip"] = getattr(torch.version, "hip", None)
    out["file"] = torch.__file__
    try:
        out["cuda_available"] = bool(torch.cuda.is_available())
        out["device_count"] = torch.cuda.device_count() if out["cuda_available"] else 0
    except Exception as e:
        out["cuda_error"] = "%s: %s" % (type(e).__name__, e)
    try:
        import torch.distributed as dist
        out["nccl_available"] = bool(dist.is_available() and dist.is_nccl_available())
        out["gloo_available"] = bool(dist.is_available() and dist.is_gloo_available())
    except Exception:
        pass
    if out.get("cuda"):
        try:
            v = torch.cuda.nccl.version()
            out["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
        except Exception as e:
            out["nccl_error"] = "%s: %s" % (type(e).__name__, e)
    out["ok"] = True
except BaseException as e:
    out["ok"] = False
    out["error"] = "%s: %s" % (type(e).__name__, e)
out["seconds"] = round(time.time() - t0, 3)
sys.stdout.write("CORRAL_TORCH " + json.dumps(out) + "\n")
"""


def clock() -> float:
    """This node's wall clock; the head brackets the call to estimate the offset."""
    return time.time()


def collect(workdir=None, peers=(), torch=True, torch_timeout=90.0, tmpdir=None) -> dict:
    """Everything doctor needs about this node, in one call.

    ``peers``: ``[{"name": ..., "address": ...}]`` for every host of the
    cluster, as the head knows them; each name is resolved here, and the
    interface the kernel would use to reach each address is recorded.
    ``torch``: import torch in a child process (CUDA build, NCCL version,
    and whether it imports at all).
    """
    errors = []
    facts = {
        "host": None,  # the head fills in the cluster's name for this node
        "hostname": socket.gethostname(),
        "shell": os.environ.get("SHELL"),  # the login shell: where start-up files are
        "fqdn": _quiet(socket.getfqdn, errors, "fqdn"),
        "os": _os_release(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "python": {"path": sys.executable, "version": platform.python_version()},
        "cpus": os.cpu_count(),
        "clock": time.time(),
        "tools": {t: shutil.which(t) for t in ("nvidia-smi", "ip", "ssh", "iperf3", "ibstat")},
    }
    facts["packages"] = _packages(errors)
    facts["torch_import"] = _torch_import(torch_timeout, errors) if torch else None
    _merge_torch(facts["packages"], facts["torch_import"])
    facts.update(_nvidia(facts["tools"]["nvidia-smi"], errors))
    facts["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    # Xids since boot, ECC, retired pages / remapped rows, NCCL RAS (GPU nodes only)
    facts["gpu_health"] = _quiet(gpu_health, errors, "gpu health") if facts["tools"]["nvidia-smi"] else None
    facts["interfaces"] = _interfaces(facts["tools"]["ip"], errors)
    facts["infiniband"] = _infiniband(errors)
    facts["shm_bytes"] = _fs_size("/dev/shm", errors)
    facts.update(_workdir(workdir, errors))
    facts.update(_tmp(errors, tmpdir))
    facts["memlock"] = _memlock()
    facts["env"] = _env()
    names = [p.get("name") for p in peers if p.get("name")]
    names.append(facts["hostname"])
    facts["resolve"] = {name: _resolve(name) for name in dict.fromkeys(names)}
    facts["hostname_addresses"] = hostname_addresses()  # in order: gloo takes the first
    addresses = [p.get("address") for p in peers if p.get("address")]
    for resolved in facts["resolve"].values():
        addresses.extend(resolved)
    facts["routes"] = {a: _route_source(a) for a in dict.fromkeys(addresses)}
    facts["errors"] = errors
    return facts


def _quiet(fn, errors, what):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a fact we could not read is a fact, not a crash
        errors.append(f"{what}: {e}")
        return None


# --------------------------------------------------------------------------
# system


def _os_release() -> str:
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        pass
    return platform.platform()


def _fs_size(path, errors):
    try:
        st = os.statvfs(path)
    except OSError as e:
        errors.append(f"{path}: {e.strerror or e}")
        return None
    return st.f_blocks * st.f_frsize


def _workdir(workdir, errors) -> dict:
    """Free space where the job will write; the nearest existing parent if missing."""
    out = {"workdir": workdir, "workdir_exists": None, "disk_free_bytes": None}
    if not workdir:
        return out
    workdir = os.path.expanduser(workdir)  # `~/proj`: this node's home
    out["workdir_exists"] = os.path.isdir(workdir)
    if out["workdir_exists"]:
        # access(2) answers EROFS for a read-only mount, and the login
        # user's permissions otherwise: what the job will meet.
        out["workdir_writable"] = os.access(workdir, os.W_OK)
    probe = workdir
    while probe and not os.path.isdir(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    try:
        st = os.statvfs(probe or "/")
        out["disk_free_bytes"] = st.f_bavail * st.f_frsize
    except OSError as e:
        errors.append(f"disk free in {probe}: {e.strerror or e}")
    return out


def _tmp(errors, tmpdir=None) -> dict:
    """Where a job's temporary files go (corral's job directory, the ranks'
    output files, torch's): ``tmpdir`` (the job's TMPDIR from the cluster
    file) when given, else the first of $TMPDIR, $TEMP, $TMP, /tmp that
    Python finds writable -- and when none is, Python falls back to
    /var/tmp, /usr/tmp, then the current directory, without a word."""
    import tempfile

    out = {"tmp_wanted": None, "tmp_dir": None, "tmp_free_bytes": None}
    try:
        if tmpdir:
            out["tmp_wanted"] = tmpdir
            out["tmp_dir"] = tmpdir if os.path.isdir(tmpdir) and os.access(tmpdir, os.W_OK) else None
            if out["tmp_dir"] is None:
                out["tmp_dir"] = "(nothing: it is missing or not writable)"
                return out
        else:
            out["tmp_wanted"] = tempfile._candidate_tempdir_list()[0]
            out["tmp_dir"] = tempfile._get_default_tempdir()  # uncached: what a new process picks
    except (AttributeError, IndexError, OSError) as e:
        errors.append(f"temporary directory: {e}")
        return out
    try:
        st = os.statvfs(out["tmp_dir"])
        out["tmp_free_bytes"] = st.f_bavail * st.f_frsize
    except OSError as e:
        errors.append(f"disk free in {out['tmp_dir']}: {e.strerror or e}")
    return out


def _memlock():
    """Soft RLIMIT_MEMLOCK in bytes, or "unlimited" (RDMA pins memory)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, OSError, ValueError, AttributeError):
        return None
    return "unlimited" if soft == resource.RLIM_INFINITY else soft


def _env() -> dict:
    out = {}
    for key, value in os.environ.items():
        if _SECRET.search(key):
            continue
        if key.startswith(ENV_PREFIXES) or key in ENV_NAMES:
            out[key] = value
    return out


def _resolve(name) -> list:
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    return sorted({info[4][0] for info in infos})


def _route_source(address):
    """The local address the kernel would use to reach ``address`` (UDP connect, no packet)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect((address, 9))
        return s.getsockname()[0]
    except (OSError, UnicodeError):
        return None
    finally:
        s.close()


# --------------------------------------------------------------------------
# Python packages


def _packages(errors) -> dict:
    out = {"torch": None, "torch_cuda": None, "nccl": None}
    try:
        from importlib import metadata
    except ImportError:  # pragma: no cover - Python 3.8 has it
        errors.append("importlib.metadata is unavailable")
        return out
    for key, dists in PACKAGES.items():
        out[key] = None
        for dist in dists:
            try:
                out[key] = metadata.version(dist)
                break
            except metadata.PackageNotFoundError:
                continue
            except Exception as e:  # noqa: BLE001 - a broken dist-info
                errors.append(f"metadata of {dist}: {e}")
    # The NCCL wheel torch depends on (pip installs); the import tells the truth.
    for dist in ("nvidia-nccl-cu12", "nvidia-nccl-cu11", "nvidia-nccl-cu13"):
        try:
            out["nccl"] = metadata.version(dist)
            break
        except Exception:  # noqa: BLE001,S112 - not installed, or a broken dist-info
            continue
    out["torch_cuda"] = _torch_cuda_from_file()
    return out


def _torch_cuda_from_file():
    """``torch.version.cuda`` read from torch/version.py without importing torch."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for base in spec.submodule_search_locations:
        try:
            with open(os.path.join(base, "version.py")) as f:
                text = f.read()
        except OSError:
            continue
        m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
        return m.group(1) if m else None
    return None


def _torch_import(timeout, errors):
    """Import torch in a child of this interpreter; never hang or crash the agent."""
    if _find_spec("torch") is None:
        return {"ok": False, "error": f"torch is not installed for {sys.executable}"}
    argv = [sys.executable, "-c", _TORCH_PROBE]
    try:
        proc = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, check=False,
                              timeout=float(timeout), cwd="/")
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"import torch did not finish within {float(timeout):.0f}s"}
    except OSError as e:
        return {"ok": False, "error": f"cannot run {sys.executable}: {e}"}
    for line in proc.stdout.decode(errors="replace").splitlines():
        if line.startswith("CORRAL_TORCH "):
            try:
                return json.loads(line[len("CORRAL_TORCH "):])
            except ValueError:
                break
    tail = proc.stderr.decode(errors="replace").strip().splitlines()[-3:]
    detail = " | ".join(tail) or f"exit code {proc.returncode}"
    errors.append(f"import torch: {detail}")
    return {"ok": False, "error": f"import torch crashed: {detail}"}


def _find_spec(name):
    try:
        import importlib.util

        return importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None


def _merge_torch(packages, probe) -> None:
    """What the import says wins over metadata: it is what a job will run."""
    if not probe or not probe.get("ok"):
        return
    packages["torch"] = probe.get("version") or packages.get("torch")
    packages["torch_cuda"] = probe.get("cuda")
    if probe.get("nccl"):
        packages["nccl"] = probe["nccl"]


# --------------------------------------------------------------------------
# GPUs


def _nvidia(exe, errors) -> dict:
    out = {"driver": None, "cuda_driver": None, "gpus": []}
    if not exe:
        return out
    query = "index,name,memory.total,uuid,driver_version"
    try:
        res = subprocess.run([exe, "--query-gpu=" + query, "--format=csv,noheader,nounits"],
                             capture_output=True, check=False, timeout=30)
        head = subprocess.run([exe], capture_output=True, check=False, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        errors.append(f"nvidia-smi: {e}")
        return out
    if not res.stdout.strip():
        msg = res.stderr.decode(errors="replace").strip().splitlines()
        errors.append("nvidia-smi failed: %s" % (msg[0] if msg else "no output"))
        return out
    for line in res.stdout.decode(errors="replace").splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue
        try:
            memory = int(float(parts[2]))
        except ValueError:
            memory = None
        out["gpus"].append({"index": int(parts[0]) if parts[0].isdigit() else parts[0],
                            "name": parts[1], "memory_mib": memory, "uuid": parts[3]})
        out["driver"] = parts[4]
    m = re.search(r"CUDA Version:\s*([\d.]+)", head.stdout.decode(errors="replace"))
    out["cuda_driver"] = m.group(1) if m else None
    return out


# --------------------------------------------------------------------------
# network


def _interfaces(ip_exe, errors) -> list:
    """Every interface with its IPv4/IPv6 addresses, state, speed, MTU and kind."""
    raw = None
    if ip_exe:
        try:
            res = subprocess.run([ip_exe, "-j", "-d", "addr", "show"], capture_output=True, check=False,
                                 timeout=15)
            # Judge by the output, not the exit status: the agent reaps zombie
            # children, which can leave subprocess with a made-up 0.
            if res.stdout.strip():
                raw = json.loads(res.stdout.decode())
        except (OSError, ValueError, subprocess.TimeoutExpired) as e:
            errors.append(f"ip -j addr: {e}")
    if raw is None:
        raw = _interfaces_from_sys()
    out = []
    for entry in raw:
        name = entry.get("ifname")
        if not name:
            continue
        flags = entry.get("flags") or []
        addresses = ["{}/{}".format(a["local"], a["prefixlen"]) for a in entry.get("addr_info", [])
                     if a.get("family") in ("inet", "inet6") and "local" in a]
        info_kind = (entry.get("linkinfo") or {}).get("info_kind", "")
        out.append({
            "name": name,
            "addresses": addresses,
            "state": (entry.get("operstate") or "unknown").lower(),
            "up": "UP" in flags,
            "carrier": "LOWER_UP" in flags,
            "speed_mbps": _speed(name),
            "mtu": entry.get("mtu"),
            "kind": interface_kind(name, entry.get("link_type", ""), info_kind,
                                   os.path.isdir(f"/sys/class/net/{name}/bridge"),
                                   os.path.exists(f"/sys/class/net/{name}/device")),
            "driver": info_kind or None,
        })
    return out


def interface_kind(name, link_type, info_kind, is_bridge, has_device) -> str:
    """ethernet|infiniband|bridge|veth|docker|loopback|virtual|other."""
    if link_type == "loopback" or name == "lo":
        return "loopback"
    if link_type == "infiniband":
        return "infiniband"
    if name.startswith("docker") or re.match(r"^br-[0-9a-f]{12}$", name):
        return "docker"
    if info_kind == "veth" or (not info_kind and name.startswith("veth")):
        return "veth"
    if info_kind == "bridge" or is_bridge:
        return "bridge"
    if info_kind in ("bond", "team", "vlan", "macvlan", "ipvlan") or has_device:
        return "ethernet" if link_type in ("ether", "") else "other"
    if info_kind or link_type in ("none", "ipip", "sit", "gre"):
        return "virtual"
    return "other"


def _speed(name):
    try:
        with open(f"/sys/class/net/{name}/speed") as f:
            value = int(f.read().strip())
    except (OSError, ValueError):
        return None  # virtual links and links that are down have none
    return value if value > 0 else None


def _interfaces_from_sys() -> list:
    """Fallback without iproute2: names and IPv4 addresses (ioctl), kinds from /sys."""
    out = []
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        names = []
    v4 = {}
    try:
        import fcntl
        import struct

        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            for name in names:
                packed = struct.pack("256s", name.encode()[:15])
                try:
                    addr = fcntl.ioctl(sock.fileno(), 0x8915, packed)  # SIOCGIFADDR
                    mask = fcntl.ioctl(sock.fileno(), 0x891B, packed)  # SIOCGIFNETMASK
                except OSError:
                    continue
                prefix = bin(struct.unpack("!I", mask[20:24])[0]).count("1")  # noqa: FURB161 (3.8)
                v4[name] = f"{socket.inet_ntoa(addr[20:24])}/{prefix}"
        finally:
            sock.close()
    except (ImportError, OSError):
        pass
    for name in names:
        base = f"/sys/class/net/{name}/"
        state = _read(base + "operstate") or "unknown"
        arptype = _read(base + "type")
        link_type = {"1": "ether", "32": "infiniband", "772": "loopback"}.get(arptype or "", "")
        mtu = _read(base + "mtu")
        flags = int(_read(base + "flags") or "0", 16)
        out.append({
            "ifname": name, "operstate": state.upper(), "mtu": int(mtu) if mtu else None,
            "link_type": link_type,
            "flags": (["UP"] if flags & 1 else []) + (["LOWER_UP"] if _read(base + "carrier") == "1" else []),
            "addr_info": [{"family": "inet", "local": v4[name].split("/")[0],
                           "prefixlen": int(v4[name].split("/")[1])}] if name in v4 else [],
        })
    return out


def _read(path):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _infiniband(errors) -> list:
    """Ports of /sys/class/infiniband (IB and RoCE), with the netdevs of each device."""
    base = "/sys/class/infiniband"
    out = []
    if not os.path.isdir(base):
        return out
    try:
        devices = sorted(os.listdir(base))
    except OSError as e:
        errors.append(f"{base}: {e}")
        return out
    for dev in devices:
        ports_dir = os.path.join(base, dev, "ports")
        try:
            netdevs = sorted(os.listdir(os.path.join(base, dev, "device", "net")))
        except OSError:
            netdevs = []
        try:
            ports = sorted(os.listdir(ports_dir), key=lambda p: int(p) if p.isdigit() else 0)
        except OSError:
            ports = []
        for port in ports:
            p = os.path.join(ports_dir, port)
            out.append({
                "device": dev,
                "port": int(port) if port.isdigit() else port,
                "state": _strip_code(_read(os.path.join(p, "state"))),
                "phys_state": _strip_code(_read(os.path.join(p, "phys_state"))),
                "rate": _read(os.path.join(p, "rate")),
                "link_layer": _read(os.path.join(p, "link_layer")),
                "netdevs": netdevs,
            })
    return out


def _strip_code(value):
    """``"4: ACTIVE"`` -> ``"ACTIVE"``."""
    if value is None:
        return None
    return value.split(":", 1)[1].strip() if ":" in value else value
