"""What a node's GPUs and kernel say after a failure or a hang (and before launch).

The node agent sends raw text (``agent/health.py``): the kernel's
``NVRM: Xid`` lines, ``nvidia-smi -q`` (ECC, retired pages, remapped rows)
and NCCL's RAS status.  All of it is untrusted text; it is only matched by
patterns here, never evaluated.  Each Xid is explained with NVIDIA's meaning
and its immediate action, summarised from NVIDIA's Xid catalogue
("Resolution Bucket (Immediate Action)": RESTART_APP, RESET_GPU, RESTART_BM,
IGNORE; https://docs.nvidia.com/deploy/xid-errors/) into what to do:
restart the app, reset the GPU, or drain the node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RESTART_APP = "restart the job (an application or driver error; the GPU is fine)"
RESET_GPU = "reset the GPU (`nvidia-smi -r` with nothing running on it) before the next run"
DRAIN = "drain the node: reboot it, and have the GPU checked if it comes back"
IGNORE = "nothing to do (informational)"

#: Xid -> (NVIDIA's meaning, what to do).  Codes not here: see NVIDIA's catalogue.
XIDS: dict[int, tuple[str, str]] = {
    8: ("GPU stopped processing (channel idle timeout)", RESTART_APP),
    13: ("Graphics engine exception (often an out-of-range access in a kernel)", RESTART_APP),
    31: ("GPU memory page fault (an illegal address in a kernel or driver)", RESTART_APP),
    32: ("Invalid or corrupted push buffer stream", RESTART_APP),
    38: ("Driver firmware error", RESET_GPU),
    43: ("GPU stopped processing (the faulting application's channel was torn down)", RESTART_APP),
    45: ("Preemptive cleanup after an earlier error (follows another Xid)", IGNORE),
    48: ("Double-bit ECC error (DBE): uncorrectable memory error", RESET_GPU),
    61: ("Internal micro-controller breakpoint/warning", RESET_GPU),
    62: ("Internal micro-controller halt", RESET_GPU),
    63: ("ECC page retirement or row remapping recorded (applied at the next GPU reset)", RESET_GPU),
    64: ("ECC page retirement or row remapping failed", DRAIN),
    68: ("Video processor (NVDEC) exception", RESTART_APP),
    69: ("Graphics engine class error", RESTART_APP),
    74: ("NVLink error", RESET_GPU),
    79: ("GPU has fallen off the bus (no longer reachable over PCIe)", DRAIN),
    92: ("High single-bit ECC error rate", IGNORE),
    94: ("Contained uncorrectable ECC error (the application using the memory was stopped)", RESTART_APP),
    95: ("Uncontained uncorrectable ECC error (other applications may be affected)", RESET_GPU),
    109: ("Context switch timeout", RESTART_APP),
    119: ("GSP RPC timeout (the GPU's firmware stopped answering)", RESET_GPU),
    120: ("GSP error (GPU firmware)", RESET_GPU),
    121: ("C2C link corrected error", IGNORE),
    140: ("Unrecovered ECC error", RESET_GPU),
    143: ("GPU initialization failure", DRAIN),
    154: ("GPU recovery action changed (the line names the action the GPU now needs)", RESET_GPU),
}
#: Xid 154's own words -> what to do.
_RECOVERY = (("node reboot", DRAIN), ("drain", DRAIN), ("gpu reset", RESET_GPU), ("none", IGNORE))
_SEVERITY = {IGNORE: 0, RESTART_APP: 1, RESET_GPU: 2, DRAIN: 3}

_XID = re.compile(r"NVRM: Xid \((?P<where>[^)]*)\): (?P<code>\d+)(?:, (?P<rest>.*))?")
_PID = re.compile(r"pid=(?P<pid>'?[^,']*'?), name=(?P<name>[^,]*)")


@dataclass(frozen=True, kw_only=True)
class Xid:
    """One ``NVRM: Xid`` kernel message."""

    code: int
    #: ``PCI:0000:3b:00`` (the GPU's bus id), as the driver printed it.
    device: str
    text: str
    pid: str | None = None
    process: str | None = None

    @property
    def meaning(self) -> str:
        return XIDS.get(self.code, ("not in corral's table: see NVIDIA's Xid catalogue", RESTART_APP))[0]

    @property
    def action(self) -> str:
        if self.code == 154:  # "... changed from 0x0 (None) to 0x2 (Node Reboot Required)"
            low = self.text.lower().rsplit(" to ", 1)[-1]
            return next((a for words, a in _RECOVERY if words in low), RESET_GPU)
        return XIDS.get(self.code, ("", RESTART_APP))[1]

    def line(self) -> str:
        who = f" (pid {self.pid}, {self.process})" if self.pid and self.pid.strip("'") not in ("", "N/A", "<unknown>") \
            and self.process else ""
        return f"Xid {self.code} on {self.device}{who}: {self.meaning}; {self.action}"


def parse_xids(lines: list[str] | tuple[str, ...]) -> list[Xid]:
    """Kernel log lines (journalctl or dmesg, any timestamp format) -> their Xids."""
    out = []
    for line in lines:
        m = _XID.search(line)
        if not m:
            continue
        rest = m.group("rest") or ""
        p = _PID.search(rest)
        out.append(Xid(code=int(m.group("code")), device=m.group("where").strip(), text=rest.strip()[:500],
                       pid=p.group("pid") if p else None, process=p.group("name").strip() if p else None))
    return out


# -- nvidia-smi -q ---------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GpuMemory:
    """One GPU's memory error counters from ``nvidia-smi -q``."""

    gpu: str
    #: Uncorrectable ECC errors since the driver loaded / over the GPU's life.
    volatile_uncorrectable: int = 0
    aggregate_uncorrectable: int = 0
    #: Pages retired for double-bit errors, and whether a retirement waits for a reset (pre-Ampere).
    retired_dbe: int = 0
    retirement_pending: bool = False
    #: Rows remapped for uncorrectable errors; a remap waiting for a reset; a remap that failed (Ampere+).
    remapped_uncorrectable: int = 0
    remap_pending: bool = False
    remap_failure: bool = False

    def problems(self) -> list[str]:
        out = []
        if self.remap_failure:
            out.append(f"GPU {self.gpu}: row remapping failed; {DRAIN}")
        if self.remap_pending or self.retirement_pending:
            out.append(f"GPU {self.gpu}: a memory row/page retirement is pending; {RESET_GPU}")
        if self.volatile_uncorrectable:
            out.append(f"GPU {self.gpu}: {self.volatile_uncorrectable} uncorrectable ECC error(s) since the driver "
                       f"loaded; {RESET_GPU}")
        if self.remapped_uncorrectable >= 8 or self.retired_dbe >= 32:  # close to the spare rows/pages
            out.append(f"GPU {self.gpu}: {self.remapped_uncorrectable or self.retired_dbe} rows/pages already "
                       f"remapped or retired for uncorrectable errors; {DRAIN}")
        return out


_GPU_HEADER = re.compile(r"^GPU (?P<bus>[0-9A-Fa-f:.]+)\s*$")


def parse_smi_q(text: str) -> list[GpuMemory]:
    """``nvidia-smi -q -d ECC,PAGE_RETIREMENT,ROW_REMAPPER`` -> per GPU counters.

    The output is indented sections (``ECC Errors`` > ``Volatile`` > ...);
    the path of section titles says which counter a ``Name : value`` line is."""
    gpus: list[dict[str, Any]] = []
    path: list[tuple[int, str]] = []
    for raw in text.splitlines():
        if not raw.strip():
            continue
        m = _GPU_HEADER.match(raw)
        if m:
            gpus.append({"gpu": m.group("bus")})
            path = []
            continue
        if not gpus:
            continue
        indent = len(raw) - len(raw.lstrip())
        while path and path[-1][0] >= indent:
            path.pop()
        key, sep, value = raw.strip().partition(":")
        key, value = key.strip().lower(), value.strip()
        if not sep or not value:
            path.append((indent, key))
            continue
        where = " / ".join(p for _, p in path) + " / " + key
        _take(gpus[-1], where, value)
    return [GpuMemory(**g) for g in gpus]


def _int(value: str) -> int:
    return int(value) if value.isdigit() else 0


def _take(gpu: dict[str, Any], where: str, value: str) -> None:
    """One ``Name : value`` line, by its section path (``ecc errors / volatile /
    dram uncorrectable``; before driver 510: ``... / volatile / double bit / total``)."""
    for kind in ("volatile", "aggregate"):
        if f"ecc errors / {kind} /" in where and (where.endswith("double bit / total") or (
                "uncorrectable" in where.rsplit(" / ", 1)[-1])):
            field = f"{kind}_uncorrectable"
            gpu[field] = gpu.get(field, 0) + _int(value)
            return
    yes = value.lower() == "yes"
    if where.endswith("retired pages / double bit ecc"):
        gpu["retired_dbe"] = _int(value)
    elif where.endswith("retired pages / pending page blacklist") or where.endswith(
            "retired pages / pending page retirement"):
        gpu["retirement_pending"] = yes
    elif where.endswith("remapped rows / uncorrectable error"):
        gpu["remapped_uncorrectable"] = _int(value)
    elif where.endswith("remapped rows / pending"):
        gpu["remap_pending"] = yes
    elif where.endswith("remapped rows / remapping failure occurred"):
        gpu["remap_failure"] = yes


# -- NCCL RAS --------------------------------------------------------------------


def parse_ras(text: str) -> list[str]:
    """NCCL's RAS status text -> its Errors and Warnings, one line per item
    (``DEAD: 1 job process is considered dead ...; Process 3487984 on node
    172.16.64.213 managing GPU 5``); empty when the job is healthy."""
    out: list[str] = []
    section = None
    item: list[str] = []

    def flush() -> None:
        if item:
            out.append(f"NCCL RAS {section.lower()}: {item[0]}: " + "; ".join(item[1:]))
            item.clear()

    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.strip() in ("Errors", "Warnings") and i + 1 < len(lines) and set(lines[i + 1].strip()) == {"="}:
            flush()
            section = line.strip()
            continue
        if section is None or set(line.strip()) == {"="}:
            continue
        if not line.strip():
            flush()
            continue
        item.append(line.strip())  # the item's title, then its indented details
    flush()
    return out[:20]


# -- a node ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class NodeHealth:
    """What one node's GPUs and kernel say."""

    host: str
    xids: tuple[Xid, ...] = ()
    memory: tuple[GpuMemory, ...] = ()
    ras: tuple[str, ...] = ()
    #: What could not be read, and why (a permission, a missing tool).
    unread: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """One line per finding; the same Xid on the same GPU said once, with its count."""
        seen: dict[str, int] = {}
        for x in self.xids:
            seen[x.line()] = seen.get(x.line(), 0) + 1
        out = [f"{self.host}: {line}" + (f" (x{n})" if n > 1 else "") for line, n in seen.items()]
        out += [f"{self.host}: {p}" for m in self.memory for p in m.problems()]
        out += [f"{self.host}: {r}" for r in self.ras]
        return out

    @property
    def worst(self) -> str | None:
        actions = [x.action for x in self.xids]
        return max(actions, key=lambda a: _SEVERITY.get(a, 1)) if actions else None


def node_health(host: str, raw: Mapping[str, Any]) -> NodeHealth | None:
    """The agent's ``health`` answer -> NodeHealth; None for a node without GPUs."""
    if not isinstance(raw, Mapping) or not raw.get("gpu"):
        return None
    unread = []
    xid = raw.get("xid") if isinstance(raw.get("xid"), Mapping) else {}
    lines = [ln for ln in xid.get("lines", []) if isinstance(ln, str)][-200:]
    if isinstance(xid.get("error"), str):
        unread.append(f"kernel log not read: {xid['error'][:300]}")
    smi = raw.get("smi") if isinstance(raw.get("smi"), Mapping) else {}
    if isinstance(smi.get("error"), str):
        unread.append(f"nvidia-smi -q: {smi['error'][:300]}")
    ras = raw.get("ras") if isinstance(raw.get("ras"), Mapping) else {}
    if isinstance(ras.get("error"), str):
        unread.append(f"NCCL RAS: {ras['error'][:300]}")
    text = smi.get("text") if isinstance(smi.get("text"), str) else ""
    ras_text = ras.get("text") if isinstance(ras.get("text"), str) else ""
    return NodeHealth(host=host, xids=tuple(parse_xids(lines)), memory=tuple(parse_smi_q(text)),
                      ras=tuple(parse_ras(ras_text)), unread=tuple(unread))
