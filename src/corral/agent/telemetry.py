"""Live telemetry of one node while its job runs (stdlib only).

Shipped to nodes as ``corral_agent_telemetry``.  Once a second the agent
sends one compact ``tm`` event: per GPU of the node its utilisation, memory,
power, temperature, SM clock and throttle reasons (one long-running
``nvidia-smi --query-gpu ... -l 1``, so a sample costs a line read, not a
process start); per rank of the job its CPU% and RSS (the rank's process and
everything it started, from /proc) and its progress (lines written since the
last sample, and the rate of its last progress bar); per network interface
its bytes/s (``/proc/net/dev``; InfiniBand ports from their counters in
``/sys/class/infiniband``, which count 4-byte words).

The head checks every field (``corral.frames``) and writes the samples to
``runs/<id>/telemetry/<host>.jsonl`` (``corral.run.telemetry``).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import threading
import time

try:  # on a node, modules are installed under their wire names
    from corral_agent_proctree import _ppid_map, libc_prctl
except ImportError:  # imported as part of the corral package (tests, head)
    from corral.agent.proctree import _ppid_map, libc_prctl

#: Seconds between samples.
SAMPLE_S = 1.0
#: What nvidia-smi is asked per GPU, in the order of a ``gpu`` row.  Drivers
#: from 535 on call the throttle reasons "clocks_event_reasons"; older ones
#: know only the first name.
GPU_QUERIES = (
    "index,utilization.gpu,memory.used,memory.total,power.draw,temperature.gpu,clocks.sm,"
    "clocks_throttle_reasons.active",
    "index,utilization.gpu,memory.used,memory.total,power.draw,temperature.gpu,clocks.sm,"
    "clocks_event_reasons.active",
)
#: Most GPUs, ranks and interfaces one sample carries (the head's bounds).
MAX_GPUS = 64
MAX_NICS = 16
#: Interface names the head accepts (``mlx5_0/1``: an InfiniBand device's port).
NIC_NAME = re.compile(r"^[A-Za-z0-9_.:@/-]{1,64}$")
#: A progress bar's rate: ``12.3it/s``, ``1.5kB/s``, ``4.20s/it`` (tqdm's forms).
_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*([kMGT]?)([A-Za-z]{1,12})/s\b")
_INV_RATE = re.compile(r"(\d+(?:\.\d+)?)\s*s/([A-Za-z]{1,12})\b")
_SCALE = {"": 1.0, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


# -- GPUs ----------------------------------------------------------------------


def gpu_value(text: str):
    """One nvidia-smi CSV field as a number (throttle reasons are hex); None
    for ``[N/A]``, ``[Not Supported]`` and anything else unreadable."""
    text = text.strip()
    try:
        if text.lower().startswith("0x"):
            return int(text, 16)
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else value


def parse_gpu_line(line: str):
    """A ``gpu`` row ``[index, util %, mem MiB, mem total MiB, power W, temp C,
    SM MHz, throttle bits]`` from one line of the query; None if not one."""
    fields = line.split(",")
    if len(fields) != 8:
        return None
    row = [gpu_value(f) for f in fields]
    if type(row[0]) is not int or not 0 <= row[0] < MAX_GPUS:
        return None
    if row[7] is not None and type(row[7]) is not int:
        row[7] = None
    return row


class GpuReader(threading.Thread):
    """Keeps the latest row per GPU from one ``nvidia-smi ... -l 1``."""

    def __init__(self, smi: str):
        super().__init__(name="telemetry-gpu", daemon=True)
        self.smi = smi
        self.latest: dict = {}
        self.proc = None
        self.stopped = threading.Event()
        self._prctl = libc_prctl()

    def _die_with_reader(self) -> None:  # pragma: no cover - runs between fork and exec
        """nvidia-smi ends with this thread (PR_SET_PDEATHSIG), even when the
        agent is killed with SIGKILL: it must never outlive the job."""
        if self._prctl is not None:
            self._prctl(1, signal.SIGKILL, 0, 0, 0)

    def run(self) -> None:
        for query in GPU_QUERIES:
            if self.stopped.is_set():
                return
            try:
                self.proc = subprocess.Popen(
                    [self.smi, "--query-gpu=" + query, "--format=csv,noheader,nounits", "-l", "1"],
                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                    close_fds=True, preexec_fn=self._die_with_reader)  # noqa: PLW1509 - only a prctl call
            except OSError:
                return
            got = False
            for raw in self.proc.stdout:
                row = parse_gpu_line(raw.decode("utf-8", "replace"))
                if row is not None:
                    got = True
                    self.latest[row[0]] = row
            self.proc.wait()
            if got or self.stopped.is_set():
                return  # (an older driver refuses the second query's name: it had the first)

    def stop(self) -> None:
        self.stopped.set()
        proc = self.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


# -- processes -----------------------------------------------------------------

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def proc_usage(pid: int):
    """(CPU seconds used, resident bytes) of one process; None when gone."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            stat = f.read()
    except OSError:
        return None
    rest = stat[stat.rfind(b")") + 2:].split()
    if len(rest) < 22 or rest[0] == b"Z":
        return None
    # fields after the name: 11 utime, 12 stime (ticks), 21 rss (pages)
    return (int(rest[11]) + int(rest[12])) / _TICK, int(rest[21]) * _PAGE


def tree_usage(pid: int, children):
    """(CPU seconds, resident bytes) of ``pid`` and every process under it
    (a rank's DataLoader workers count as the rank's); ``children(pid)``
    lists a process's children."""
    total_cpu = total_rss = 0
    found = False
    stack = [pid]
    seen = set()
    while stack:
        p = stack.pop()
        if p in seen:
            continue
        seen.add(p)
        usage = proc_usage(p)
        if usage is not None:
            found = True
            total_cpu += usage[0]
            total_rss += usage[1]
            stack.extend(children(p))
    return (total_cpu, total_rss) if found else None


def proc_children(pid: int) -> list:
    """The children of ``pid``'s main thread (``/proc/PID/task/PID/children``:
    a few reads per rank, not a scan of every process of the node); None where
    the kernel has no such file (CONFIG_PROC_CHILDREN off)."""
    try:
        with open("/proc/%d/task/%d/children" % (pid, pid)) as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return []


def children_lookup():
    """A ``children(pid)`` function: the kernel's own lists where it keeps
    them, else one scan of /proc per sample."""
    if proc_children(os.getpid()) is not None:
        return lambda pid: proc_children(pid) or []
    table: dict = {}
    for pid, ppid in _ppid_map().items():
        table.setdefault(ppid, []).append(pid)
    return lambda pid: table.get(pid, ())


# -- network -------------------------------------------------------------------


def parse_net_dev(text: str) -> dict:
    """``/proc/net/dev``: interface -> (bytes received, bytes sent), without ``lo``."""
    out = {}
    for line in text.splitlines()[2:]:
        name, sep, rest = line.partition(":")
        fields = rest.split()
        name = name.strip()
        if not sep or len(fields) < 9 or name == "lo":
            continue
        try:
            out[name] = (int(fields[0]), int(fields[8]))
        except ValueError:
            continue
    return out


def ib_counters(root: str = "/sys/class/infiniband") -> dict:
    """``dev/port`` -> (bytes received, bytes sent) of every InfiniBand port
    (``port_rcv_data`` and ``port_xmit_data`` count 4-byte words)."""
    out = {}
    try:
        devices = sorted(os.listdir(root))
    except OSError:
        return out
    for dev in devices:
        ports = os.path.join(root, dev, "ports")
        try:
            names = sorted(os.listdir(ports))
        except OSError:
            continue
        for port in names:
            counters = os.path.join(ports, port, "counters")
            try:
                with open(os.path.join(counters, "port_rcv_data")) as f:
                    rcv = int(f.read().strip())
                with open(os.path.join(counters, "port_xmit_data")) as f:
                    xmit = int(f.read().strip())
            except (OSError, ValueError):
                continue
            out["%s/%s" % (dev, port)] = (rcv * 4, xmit * 4)
    return out


def link_speed(name: str, ib_root: str = "/sys/class/infiniband", net_root: str = "/sys/class/net"):
    """The link's speed in Mbit/s (None when the interface does not say:
    virtual links, a link that is down)."""
    try:
        if "/" in name:
            dev, port = name.split("/", 1)
            with open(os.path.join(ib_root, dev, "ports", port, "rate")) as f:
                gbits = float(f.read().split()[0])  # "200 Gb/sec (4X HDR)"
            return int(gbits * 1000)
        with open(os.path.join(net_root, name, "speed")) as f:
            mbits = int(f.read().strip())
    except (OSError, ValueError, IndexError):
        return None
    return mbits if mbits > 0 else None


def net_counters() -> dict:
    try:
        with open("/proc/net/dev") as f:
            counters = parse_net_dev(f.read())
    except OSError:
        counters = {}
    counters.update(ib_counters())
    return {k: v for k, v in counters.items() if NIC_NAME.match(k)}


# -- progress ------------------------------------------------------------------


def parse_rate(text: str):
    """(rate per second, unit) of the last progress bar rate in ``text``
    (tqdm's ``12.3it/s``, ``1.2kB/s``, ``4.20s/it``); None without one."""
    best = None
    for m in _RATE.finditer(text):
        best = (m.end(), float(m.group(1)) * _SCALE[m.group(2)], m.group(3))
    for m in _INV_RATE.finditer(text):
        if best is None or m.end() > best[0]:
            value = float(m.group(1))
            best = (m.end(), 1.0 / value if value > 0 else 0.0, m.group(2))
    if best is None:
        return None
    return round(best[1], 4), best[2]


class CountingChannel:
    """The agent's channel, counting each rank's lines and keeping its last
    progress-bar text on the way through (one dict update per line)."""

    def __init__(self, chan):
        self.chan = chan
        self.lines: dict = {}
        self.status: dict = {}

    @property
    def broken(self) -> bool:
        return self.chan.broken

    def send(self, **event) -> None:
        kind = event.get("ev")
        rank = event.get("r")
        if rank is not None:
            if kind in ("line", "lines"):
                self.lines[rank] = self.lines.get(rank, 0) + (len(event.get("ts") or ()) if kind == "lines" else 1)
            elif kind == "status":
                self.status[rank] = event.get("t")
        self.chan.send(**event)


# -- the sampler ----------------------------------------------------------------


class Telemetry(threading.Thread):
    """Samples the node every ``every_s`` seconds (once a second, less often
    on hundreds of nodes: the head's ``limits.telemetry_interval``) and sends
    a ``tm`` event.

    ``pids`` is called for the job's ranks (rank -> main pid) at each
    sample: the rank tailer learns them as ranks start."""

    def __init__(self, chan, smi=None, every_s=SAMPLE_S):
        super().__init__(name="telemetry", daemon=True)
        self.every_s = float(every_s)
        self.chan = CountingChannel(chan)
        self.pids = dict
        self.stopped = threading.Event()
        smi = smi if smi is not None else shutil.which("nvidia-smi")
        self.gpus = GpuReader(smi) if smi else None
        self._cpu: dict = {}
        self._net: dict = {}
        self._speed: dict = {}
        self._lines: dict = {}
        self._last = None

    def begin(self, pids) -> None:
        self.pids = pids
        if self.gpus is not None:
            self.gpus.start()
        self.start()

    def run(self) -> None:
        while not self.stopped.wait(self.every_s):
            try:
                self.chan.chan.send(ev="tm", **self.sample())
            except Exception:  # noqa: BLE001 - telemetry never takes the agent down
                pass

    def stop(self) -> None:
        self.stopped.set()
        if self.gpus is not None:
            self.gpus.stop()

    def sample(self) -> dict:
        now = time.monotonic()
        dt = (now - self._last) if self._last is not None else None
        self._last = now
        out = {"t": round(time.time(), 3)}
        if self.gpus is not None and self.gpus.latest:
            out["gpu"] = [self.gpus.latest[i] for i in sorted(self.gpus.latest)][:MAX_GPUS]
        ranks = self.rank_rows(dt)
        if ranks:
            out["rank"] = ranks
        nics = self.nic_rows(dt)
        if nics:
            out["nic"] = nics
        return out

    def rank_rows(self, dt) -> list:
        """``[rank, CPU %, RSS MiB, lines/s, bar rate, bar unit]`` per rank."""
        for _ in range(3):  # the tailer adds ranks as they start, from its own thread
            try:
                pids = dict(self.pids())
                break
            except RuntimeError:
                pids = {}
        children = children_lookup() if pids else None
        rows = []
        for rank in sorted(set(pids) | set(self.chan.lines)):
            usage = tree_usage(pids[rank], children) if rank in pids else None
            cpu = rss = None
            if usage is not None:
                before = self._cpu.get(rank)
                self._cpu[rank] = usage[0]
                if before is not None and dt:
                    cpu = round(max(usage[0] - before, 0.0) / dt * 100, 1)
                rss = round(usage[1] / 2**20, 1)
            count = self.chan.lines.get(rank, 0)
            lps = round((count - self._lines.get(rank, 0)) / dt, 2) if dt else None
            self._lines[rank] = count
            bar = parse_rate(self.chan.status.get(rank) or "")
            rows.append([rank, cpu, rss, lps, bar[0] if bar else None, bar[1] if bar else None])
        return rows

    def nic_rows(self, dt) -> list:
        """``[name, received B/s, sent B/s, link Mbit/s]`` per interface, the
        busiest first (at most ``MAX_NICS``)."""
        counters = net_counters()
        rows = []
        for name, (rx, tx) in counters.items():
            before = self._net.get(name)
            if before is not None and dt:
                if name not in self._speed:
                    self._speed[name] = link_speed(name)
                rows.append([name, round(max(rx - before[0], 0) / dt), round(max(tx - before[1], 0) / dt),
                             self._speed[name]])
        self._net = counters
        rows.sort(key=lambda r: (-(r[1] + r[2]), r[0]))
        return sorted(rows[:MAX_NICS], key=lambda r: r[0])
