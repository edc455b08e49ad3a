"""accelerate config files (``accelerate config``'s YAML or JSON), read and
checked against the cluster before anything starts.

corral starts ``accelerate launch --config_file F`` on every node and gives
each node its ``--machine_rank``, ``--num_machines``, ``--num_processes`` and
the rendezvous (``--main_process_ip/port``); accelerate lets those flags win
over the file.  So a file that disagrees with the cluster would be overruled
without a word; here it is named instead (file, line, key, fix), and what
the file says that corral can follow is followed: ``num_processes`` (a total
across machines) gives the processes per node, ``main_process_port`` the
rendezvous port, ``gpu_ids`` is applied by accelerate on every node (it sets
``CUDA_VISIBLE_DEVICES``), DeepSpeed's ``pdsh`` launcher is replaced by one
launch per node, and a rendezvous backend other than ``static`` by
``static`` (node ranks follow the host order).

The file is parsed with PyYAML (a corral dependency), which keeps each key's
line; JSON is YAML.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import yaml

from corral.errors import ForeignConfigError
from corral.model import Host

MAX_BYTES = 1 << 20
#: accelerate's PrecisionType values.
PRECISIONS = ("no", "fp16", "bf16", "fp8")
#: accelerate's DeepSpeed launcher that starts one node's processes.
PER_NODE_LAUNCHER = "standard"


@dataclass(frozen=True, kw_only=True)
class AccelerateConfig:
    """The file's settings, with the line of every key (``deepspeed_config.zero_stage``)."""

    path: str
    values: Mapping[str, Any]
    lines: Mapping[str, int] = field(default_factory=dict)

    def get(self, key: str) -> Any:
        node: Any = self.values
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                return None
            node = node[part]
        return node

    def error(self, key: str, message: str, hint: str) -> ForeignConfigError:
        return ForeignConfigError(f"{key}: {message}", path=self.path, line=self.lines.get(key), key=key, hint=hint)


def parse(text: str, path: str) -> AccelerateConfig:
    """The settings and their lines, or an error naming the line YAML stopped at."""
    try:
        # anchors and aliases: no accelerate config has them, and a node's file
        # could use them to expand a few bytes into gigabytes
        alias = next((e for e in yaml.parse(text, Loader=yaml.SafeLoader) if isinstance(e, yaml.AliasEvent)), None)
        if alias is not None:
            raise ForeignConfigError("uses a YAML alias (*name), which accelerate configs never do", path=path,
                                     line=alias.start_mark.line + 1, hint="write the value out")
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        values = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        raise ForeignConfigError(f"is not valid YAML: {getattr(e, 'problem', None) or e}", path=path,
                                 line=mark.line + 1 if mark else None,
                                 hint="fix it there, or write it again with `accelerate config`") from None
    if values is None:
        values = {}
    if not isinstance(values, dict):
        raise ForeignConfigError("is not an accelerate config (a mapping of settings)", path=path,
                                 hint="write it with `accelerate config --config_file FILE`")
    lines: dict[str, int] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = prefix + str(key.value)
                lines.setdefault(name, key.start_mark.line + 1)
                walk(value, name + ".")

    walk(root, "")
    return AccelerateConfig(path=path, values=values, lines=lines)


def read(path: str, shown: str) -> AccelerateConfig | None:
    """The file, or None when it is not here (it may be on the nodes only, under --workdir)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ForeignConfigError(f"cannot read the accelerate config ({e.strerror})", path=shown,
                                 hint="give an existing file (it is read here, and by accelerate on every "
                                      "node from its working directory)") from None
    if len(data) > MAX_BYTES:
        raise ForeignConfigError("is too large for an accelerate config", path=shown)
    return parse(data.decode("utf-8", errors="replace"), shown)


@dataclass(frozen=True, kw_only=True)
class Followed:
    """What corral takes from the file for this run."""

    #: processes per node, from num_processes (or gpu_ids) when -n and slots say nothing
    nproc_per_node: int | None = None
    #: the rendezvous port, from main_process_port when --master-port says nothing
    master_port: int | None = None
    #: a DeepSpeed JSON config the file names (deepspeed_config.deepspeed_config_file)
    deepspeed_config_file: str | None = None
    #: the file's DeepSpeed multi-node launcher is pdsh (or another fan-out one)
    fans_out: bool = False
    notes: tuple[str, ...] = ()


def _int(cfg: AccelerateConfig, key: str, minimum: int = 0) -> int | None:
    value = cfg.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise cfg.error(key, f"{value!r} is not a whole number of at least {minimum}",
                        hint=f"write {key}: N")
    return value


def host_index(address: str, hosts: Sequence[Host]) -> int | None:
    """Which host ``address`` names: by name, by address, or by what this machine resolves them to."""
    for i, h in enumerate(hosts):
        if address in {h.name, h.address, h.connect_address}:
            return i
    wanted = _resolve(address)
    for i, h in enumerate(hosts):
        if wanted & (_resolve(h.connect_address) | _resolve(h.name)):
            return i
    return None


def _resolve(name: str | None) -> set[str]:
    if not name:
        return set()
    try:
        return {info[4][0] for info in socket.getaddrinfo(name, None)}
    except (OSError, UnicodeError):
        return set()


def follow(cfg: AccelerateConfig, *, hosts: Sequence[Host], nproc_per_node: int | None,
           master_port: int | None) -> Followed:
    """Check the file against the cluster and this run's flags; return what corral follows.

    ``nproc_per_node``: processes per node that -n or the hosts' slots fix (None: not fixed)."""
    notes: list[str] = []
    per_node = _processes(cfg, len(hosts), nproc_per_node, notes)
    port = _port(cfg, hosts, master_port)
    _main_process_ip(cfg, hosts, notes)
    rank = _int(cfg, "machine_rank", 0)
    if rank is not None and len(hosts) > 1:
        notes.append(f"machine_rank {rank} is one node's: corral gives each node its own (host order)")
    precision = cfg.get("mixed_precision")
    if precision is not None and str(precision) not in PRECISIONS:
        raise cfg.error("mixed_precision", f"{precision!r} is not one of {', '.join(PRECISIONS)}",
                        hint="write one of those (accelerate stops on any other)")
    backend = cfg.get("rdzv_backend")
    if backend not in (None, "static") and len(hosts) > 1:  # the planner passes --rdzv_backend static
        notes.append(f"rdzv_backend {backend} -> static: corral gives every node its rank in host order")
    kind = str(cfg.get("distributed_type") or "").upper()
    launcher = cfg.get("deepspeed_config.deepspeed_multinode_launcher")
    fans_out = kind == "DEEPSPEED" and len(hosts) > 1 and (launcher or "pdsh") != PER_NODE_LAUNCHER
    if fans_out:
        notes.append(f"deepspeed_multinode_launcher {launcher or 'pdsh (its default)'}: corral starts each node's "
                     "own processes instead (no pdsh fan-out from every node)")
    if cfg.get("fsdp_config") and kind != "FSDP":
        notes.append("fsdp_config is set but distributed_type is not FSDP: accelerate ignores it")
    ds_file = cfg.get("deepspeed_config.deepspeed_config_file")
    return Followed(nproc_per_node=per_node if nproc_per_node is None else None,
                    master_port=port if master_port is None else None,
                    deepspeed_config_file=str(ds_file) if ds_file else None, fans_out=fans_out, notes=tuple(notes))


def _processes(cfg: AccelerateConfig, nnodes: int, nproc_per_node: int | None, notes: list[str]) -> int | None:
    """num_machines, num_processes (a total) and gpu_ids against the cluster: the processes per node they give."""
    machines = _int(cfg, "num_machines", 1)
    if machines is not None and machines != nnodes:
        raise cfg.error("num_machines", f"{machines}, but the cluster has {nnodes} host(s)",
                        hint=f"set num_machines: {nnodes}, or run on {machines} host(s) (corral passes "
                             "--num_machines itself, so the file and the cluster must agree)")
    procs = _int(cfg, "num_processes", 1)
    per_node = None
    if procs is not None:
        if procs % nnodes:
            raise cfg.error("num_processes", f"{procs} processes (a total across machines) do not divide "
                                             f"among {nnodes} host(s)",
                            hint=f"set num_processes to a multiple of {nnodes} (accelerate counts every "
                                 "machine's processes), e.g. "
                                 f"{nnodes * (nproc_per_node or max(1, procs // nnodes))}")
        per_node = procs // nnodes
        if nproc_per_node is not None and nproc_per_node != per_node:
            raise cfg.error("num_processes", f"{procs} is {per_node} per node on {nnodes} host(s), but this run "
                                             f"starts {nproc_per_node} per node ({nproc_per_node * nnodes} in all)",
                            hint=f"set num_processes: {nproc_per_node * nnodes} (the total across machines), "
                                 f"or -n {per_node}")
    gpu_ids = cfg.get("gpu_ids")
    if gpu_ids in (None, "all"):
        return per_node
    ids = [g for g in str(gpu_ids).split(",") if g.strip()]
    want = per_node or nproc_per_node
    if want is not None and want != len(ids):
        raise cfg.error("gpu_ids", f"{gpu_ids} is {len(ids)} GPU(s), but each node starts {want} process(es)",
                        hint=f"list {want} GPU ids, or make num_processes {len(ids) * nnodes}")
    notes.append(f"gpu_ids {gpu_ids}: accelerate sets CUDA_VISIBLE_DEVICES={gpu_ids} on every node")
    return per_node or len(ids)


def _port(cfg: AccelerateConfig, hosts: Sequence[Host], master_port: int | None) -> int | None:
    port = _int(cfg, "main_process_port", 1)
    if port is None:
        return None
    ssh_ports = {22} | {h.port for h in hosts if h.port}
    if port in ssh_ports or port > 65535:
        raise cfg.error("main_process_port", f"{port} is {'an ssh port' if port in ssh_ports else 'no port'}: "
                                             "the rendezvous would collide with sshd on node 0",
                        hint="remove main_process_port (corral picks a free port on node 0), or choose a "
                             "free one such as 29500")
    if master_port is not None and master_port != port:
        raise cfg.error("main_process_port", f"{port}, but --master-port is {master_port}", hint="drop one of them")
    return port


def _main_process_ip(cfg: AccelerateConfig, hosts: Sequence[Host], notes: list[str]) -> None:
    ip = cfg.get("main_process_ip")
    if ip in (None, "") or len(hosts) < 2:
        return
    index = host_index(str(ip), hosts)
    if index is None:
        notes.append(f"main_process_ip {ip} is not a name or address of the first host {hosts[0].name} known "
                     "here: corral uses node 0's address that every node reaches")
    elif index != 0:
        raise cfg.error("main_process_ip", f"{ip} is {hosts[index].name}, node {index}, not the first host "
                                           f"{hosts[0].name}: corral's rendezvous is on node 0",
                        hint=f"list {hosts[index].name} first in the cluster file, or remove main_process_ip "
                             "(corral uses the address of node 0 that every node reaches)")


def summary(cfg: AccelerateConfig, followed: Followed) -> str:
    """The one line a run prints about the file."""
    said = [f"{k} {cfg.get(k)}" for k in ("distributed_type", "num_machines", "num_processes", "mixed_precision")
            if cfg.get(k) is not None]
    line = f"accelerate config {cfg.path}: " + (", ".join(said) or "no multi-node settings")
    if followed.nproc_per_node:
        line += f" -> {followed.nproc_per_node} process(es) per node"
    if followed.master_port:
        line += f", rendezvous port {followed.master_port}"
    return "; ".join([line, *followed.notes])
