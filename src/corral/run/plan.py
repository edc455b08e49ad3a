"""From a cluster and a ``corral run`` request to what each node runs.

Pure functions over frozen data: ``build_plan`` takes the cluster, the
request (``RunSpec``) and what preflight learned about each node
(``NodeFacts``) and returns a ``LaunchPlan`` with every node's argv, env and
working directory.  ``--dry-run`` prints exactly this.

The environment contract every node gets (documented in docs/run.md):

    MASTER_ADDR, MASTER_PORT    rendezvous on node rank 0, chosen by corral
    NODE_RANK, NNODES           this node's rank (host order) and node count
    WORLD_SIZE                  total processes (torchrun sets per-rank values)
    CORRAL_RUN_ID               the job id that names logs and temp files
    CORRAL_ATTEMPT, CORRAL_MAX_RESTARTS   set per attempt by the runner (runner.py), with
    CORRAL_CHECKPOINT_DIR, CORRAL_RESUME_DIR, CORRAL_PREVIOUS_ATTEMPT,
    CORRAL_PREVIOUS_WORLD_SIZE, CORRAL_EXCLUDED_HOSTS   (run/recovery.py)
    CORRAL_NODE_RANK, CORRAL_NNODES, CORRAL_NPROC_PER_NODE
    CORRAL_HOSTS                host names in node-rank order (comma list)
    CORRAL_NODE_IPS             the address of each node that corral verified

Only named or allow-listed variables travel from the head (``env_from_head``).
"""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from corral.errors import UsageError
from corral.interop.dsconfig import check_run
from corral.interop.dsenv import DsEnv, Part
from corral.model import Cluster, Host, format_gpus
from corral.run.launchers import MULTI_PROCESS, PLANNERS, REQUIRES, NodeContext
from corral.run.scriptcheck import LightningShape, script_lightning_shape

#: Head variables that travel to every node without being named: settings
#: that tune the stack, never secrets (see ``is_secret_name``) and never per-machine
#: values (CUDA_VISIBLE_DEVICES is per host: set it in the cluster file).
ENV_ALLOW_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "TORCHINDUCTOR_", "PYTORCH_", "CUDA_", "KMP_")
ENV_ALLOW_NAMES = frozenset({
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE",
    "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER",
    # the experiment trackers' off switches, set on the command line like the
    # offline ones above (`WANDB_MODE=offline torchrun ...`): left behind, a
    # rank calls W&B's servers and, with no key and no terminal, fails
    "WANDB_MODE", "WANDB_DISABLED",
    # InfiniBand's partition key index: a setting whose name ends in KEY
    "NCCL_IB_PKEY",
})
ENV_NEVER = frozenset({"CUDA_VISIBLE_DEVICES"})
#: Never forwarded unless named with --env (HF_TOKEN, AWS_SECRET_ACCESS_KEY, ...),
#: whatever allow-listed prefix they carry (NCCL_AUTH, TORCH_PRIVATEKEY).  Judged
#: word by word (words split at '_'): TOKENIZERS_PARALLELISM is a setting, not a
#: token; any word ending in KEY (APIKEY, PRIVATEKEY) or starting with AUTH,
#: PASS, PRIVATE or CRED is one.
_SECRET_WORD = re.compile(
    r"\w*TOKEN|AUTH\w*|PASS\w*|PRIVATE\w*|CRED\w*|COOKIE\w*|\w*KEY"
    r"|\w*SECRET\w*|\w*PASSW\w*|\w*CREDENTIAL\w*",
    re.I,
)


def is_secret_name(key: str) -> bool:
    """Whether an environment variable's name says it holds a secret."""
    return any(_SECRET_WORD.fullmatch(word) for word in key.split("_") if word)


#: Set by corral; a user --env for these is refused (use the dedicated flags).
CONTRACT = frozenset({"MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES", "WORLD_SIZE"})

#: Signal the rank hook registers a faulthandler stack dump on (SIGRTMIN+3):
#: realtime, so it never collides with SIGUSR1/2 that frameworks use.
STACK_SIGNAL = 37


def new_run_id() -> str:
    """``20261123-101530-a3f9c2``: sortable, unique enough, safe in paths.

    Six hex digits: a sweep that starts a hundred runs in the same second
    into one runs directory would see two share an id (their run directory,
    control socket and the nodes' job directories) about once in 3,000
    sweeps with four (1 in 1,700,000 with six)."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    """What the user asked ``corral run`` for."""

    program: str
    args: tuple[str, ...] = ()
    module: bool = False
    launcher: str = "torchrun"
    #: Processes per node; None = the hosts' slots, else GPUs, else 1.
    nproc_per_node: int | None = None
    #: ``--env`` values, already resolved (``--env K`` copied from the head).
    env: Mapping[str, str] = field(default_factory=dict)
    #: Working directory on every node; None = each host's, else the caller's cwd.
    workdir: str | None = None
    master_port: int | None = None
    launcher_args: tuple[str, ...] = ()
    #: Fork the ranks from an interpreter that has imported torch
    #: (docs/run.md, "Preloaded ranks"); torchrun and accelerate only.
    preload: bool = True
    #: ``.deepspeed_env`` as DeepSpeed's runner reads it (``--launcher deepspeed``):
    #: above the head's allow-listed variables, below the cluster file's and --env.
    ds_env: DsEnv | None = None
    #: DeepSpeed JSON configs named by another config (an accelerate config's
    #: ``deepspeed_config_file``), checked with those the arguments name.
    ds_configs: tuple[str, ...] = ()
    #: ``--gpus 0-3``: the GPUs the job uses on every node (None: the cluster
    #: file's ``gpus`` for the host, else all); one process per GPU.
    gpus: tuple[int, ...] | None = None
    run_id: str = field(default_factory=new_run_id)

    def __post_init__(self) -> None:
        if self.launcher not in PLANNERS:
            raise UsageError(
                f"--launcher {self.launcher!r} is not one of {', '.join(PLANNERS)}",
                hint="pick one of the launchers listed in `corral run --help`",
            )
        if self.nproc_per_node is not None and self.nproc_per_node < 1:
            raise UsageError(f"--nproc-per-node must be at least 1, got {self.nproc_per_node}")
        bad = sorted(CONTRACT & set(self.env))
        if bad:
            raise UsageError(
                f"--env {bad[0]} is set by corral for every node",
                hint="use --master-port to choose the port; ranks and sizes follow the cluster",
            )
        if self.gpus is not None and "CUDA_VISIBLE_DEVICES" in self.env:
            raise UsageError("--gpus and --env CUDA_VISIBLE_DEVICES both say which GPUs the job uses",
                             hint="give one of them (--gpus sets CUDA_VISIBLE_DEVICES on every node)")


@dataclass(frozen=True, kw_only=True)
class NodeFacts:
    """What preflight learned about one node (from the agent's probe)."""

    gpus: int | None = None
    address: str | None = None
    #: distributed_type of the node's accelerate default_config.yaml, if any.
    accelerate_mode: str | None = None
    #: (path, text) of that file, checked against the cluster (run/imports.py).
    accelerate_config: tuple[str, str] | None = None
    #: GLOO_SOCKET_IFNAME for a node whose host name resolves to loopback
    #: (unless the job sets one).
    gloo_ifname: str | None = None
    #: The GPUs the job holds on this node (nvidia-smi indices, or as
    #: CUDA_VISIBLE_DEVICES names them), from the node's registry.
    held_gpus: tuple[str, ...] | None = None


@dataclass(frozen=True, kw_only=True)
class NodePlan:
    host: Host
    node_rank: int
    nproc: int
    first_rank: int
    argv: tuple[str, ...]
    #: What corral sets on this node, on top of the node's own environment.
    env: Mapping[str, str]
    cwd: str
    #: Rank whose output is the launcher process's own (None: process manager).
    pipe_rank: int | None
    #: Python module the node must import for this launcher (preflight checks it).
    requires: str | None
    #: Variables whose value names the node's own variables (``.deepspeed_env``'s
    #: ``LD_LIBRARY_PATH=/opt/x:$LD_LIBRARY_PATH``): the agent fills them in, in order.
    env_refs: tuple[tuple[str, tuple[Part, ...]], ...] = ()
    #: GPUs the job holds there (``NodeFacts.held_gpus``), for run.json.
    gpus: tuple[str, ...] | None = None

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.nproc)


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    run_id: str
    launcher: str
    master_addr: str
    master_port: int
    nodes: tuple[NodePlan, ...]

    @property
    def world_size(self) -> int:
        return sum(n.nproc for n in self.nodes)

    def node_of_rank(self, rank: int) -> NodePlan | None:
        for n in self.nodes:
            if rank in n.ranks:
                return n
        return None


def env_from_head(environ: Mapping[str, str]) -> dict[str, str]:
    """The allow-listed part of the head's environment (documented list)."""
    out = {}
    for key, value in environ.items():
        if key in ENV_ALLOW_NAMES:  # curated settings, whatever their names contain
            out[key] = value
        elif key in ENV_NEVER or is_secret_name(key):
            continue
        elif key.startswith(ENV_ALLOW_PREFIXES):
            out[key] = value
    return out


#: Variables of the contract that may be written as $NAME or ${NAME} in the
#: script's arguments: older launch scripts (detectron2, mmdet, mp.spawn ones)
#: take `--dist-url tcp://$MASTER_ADDR:$MASTER_PORT --machine-rank $NODE_RANK`,
#: which a shell on the node would have expanded.  Nothing else is expanded.
CONTRACT_VARS = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "NNODES", "WORLD_SIZE", "CORRAL_RUN_ID",
                 "CORRAL_NODE_RANK", "CORRAL_NNODES", "CORRAL_NPROC_PER_NODE", "CORRAL_HOSTS",
                 "CORRAL_NODE_IPS")
_CONTRACT_REF = re.compile(r"(\\?)\$(?:\{(%s)\}|(%s)\b)" % ("|".join(CONTRACT_VARS), "|".join(CONTRACT_VARS)))


def expand_contract(argv: tuple[str, ...], env: Mapping[str, str]) -> tuple[str, ...]:
    """``$MASTER_ADDR``, ``${NODE_RANK}``... in an argument become this node's values."""
    def one(arg: str) -> str:
        if "$" not in arg:
            return arg
        def value(m: re.Match) -> str:
            name = m.group(2) or m.group(3)
            if m.group(1):  # \$NAME: the literal text, as a shell would leave it
                return m.group(0)[1:]
            return env.get(name, m.group(0))

        return _CONTRACT_REF.sub(value, arg)

    return tuple(one(a) for a in argv)


def parse_env_flags(flags: tuple[str, ...], environ: Mapping[str, str]) -> dict[str, str]:
    """``--env K=V`` sets a value; ``--env K`` copies the head's value of K."""
    out: dict[str, str] = {}
    for flag in flags:
        key, sep, value = flag.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise UsageError(f"--env {flag!r}: {key!r} is not a valid variable name",
                             hint="use --env NAME=VALUE or --env NAME")
        if not sep:
            if key not in environ:
                raise UsageError(f"--env {key}: {key} is not set on this machine",
                                 hint=f"export {key}=... first, or give the value: --env {key}=VALUE")
            value = environ[key]
        out[key] = value
    return out


def gpus_for(spec: RunSpec, host: Host) -> tuple[int, ...] | None:
    """The GPU subset the job runs on at ``host``: --gpus, else the host's
    ``gpus`` in the cluster file; None for all."""
    return spec.gpus if spec.gpus is not None else host.gpus


def nproc_for(spec: RunSpec, host: Host, facts: NodeFacts, lightning: LightningShape | None = None) -> int:
    """Processes on a node: --nproc-per-node, else the GPU subset's size
    (--gpus, the host's ``gpus``), else slots, else GPUs, else 1.

    With Lightning, the script's ``Trainer(devices=...)`` starts the
    processes, whatever the host's slots: its count when the script says it
    (``lightning``), one per GPU (one on a CPU node) for ``auto``.
    """
    if spec.launcher not in MULTI_PROCESS:
        return 1
    if lightning is not None and lightning.devices is not None:
        return lightning.devices
    if lightning is not None and lightning.auto and spec.nproc_per_node is None:
        return 1 if lightning.cpu else (facts.gpus or 1)
    if spec.nproc_per_node is not None:
        return spec.nproc_per_node
    subset = gpus_for(spec, host)
    if subset is not None:  # --gpus / `gpus`: one per GPU of the subset, whatever the slots
        return len(subset)
    if host.slots is not None:
        return host.slots
    if facts.gpus:
        return facts.gpus
    return 1


def lightning_trainer(spec: RunSpec, head_cwd: str, nnodes: int) -> LightningShape | None:
    """What the Lightning script's Trainer says about its processes (read
    where corral runs), checked against the cluster and ``-n``: ranks labelled
    from the host's slots were wrong (``slots=2`` and ``Trainer(devices=1)``:
    ranks r0, r2, r4, WORLD_SIZE=6, "6 ranks" for a 3-process job)."""
    if spec.launcher != "lightning" or spec.module:
        return None
    shape = script_lightning_shape(spec.program, Path(head_cwd), spec.args)
    if shape is None:
        return None
    where = f"{spec.program}:{shape.line} {shape.call}"
    if shape.num_nodes is not None and shape.num_nodes != nnodes:
        raise UsageError(
            f"{where}(num_nodes={shape.num_nodes}) but the cluster has {nnodes} node(s): Lightning would "
            "wait for nodes that never join, or give two nodes one node rank",
            hint=f"make the Trainer's num_nodes {nnodes} (corral sets NODE_RANK on each node), or run on "
                 f"{shape.num_nodes} host(s)")
    if (shape.devices is not None and spec.nproc_per_node is not None
            and shape.devices != spec.nproc_per_node):
        raise UsageError(
            f"--nproc-per-node {spec.nproc_per_node}, but {where}(devices={shape.devices}) starts "
            f"{shape.devices} process(es) per node",
            hint=f"leave -n out with --launcher lightning (the Trainer's devices decide), or make devices "
                 f"{spec.nproc_per_node}")
    return shape


def job_sets(name: str, cluster: Cluster, spec: RunSpec, host: Host, head_env: Mapping[str, str]) -> bool:
    """Whether the job's environment on ``host`` (what travels from here, the
    cluster file's, --env) sets ``name``."""
    return name in spec.env or name in cluster.env_for(host) or name in env_from_head(head_env)


def ds_config_notes(spec: RunSpec, head_cwd: str, world_size: int | None) -> list[str]:
    """Every DeepSpeed JSON config the run names, checked before launch
    (interop/dsconfig.py): raises for a misspelled key or batch arithmetic
    that cannot hold, returns notes."""
    more = [(os.path.join(head_cwd, os.path.expanduser(f)), f) for f in spec.ds_configs]
    return check_run(spec.args, spec.launcher_args, head_cwd, world_size, more=more)


def known_world_size(cluster: Cluster, spec: RunSpec) -> int | None:
    """The job's ranks when known before connecting (-n, or the hosts' slots)."""
    if spec.launcher not in MULTI_PROCESS:
        return len(cluster.hosts)
    if spec.launcher == "lightning":
        return None  # the script's Trainer decides
    slots = {h.slots for h in cluster.hosts}
    nproc = spec.nproc_per_node or (slots.pop() if len(slots) == 1 else None)
    return None if nproc is None else nproc * len(cluster.hosts)


def _apply_ds_env(env: dict[str, str], ds_env: DsEnv | None) -> list[tuple[str, tuple[Part, ...]]]:
    """``.deepspeed_env`` over the head's allow-listed variables (DeepSpeed's
    runner, too, exports its file after the head's NCCL_*/PYTHON* ones): literal
    values into ``env``; those naming the node's variables returned, in order."""
    refs = []
    for v in ds_env.values if ds_env else ():
        value = v.literal
        if value is None:
            env.pop(v.name, None)
            refs.append((v.name, v.parts))
        else:
            env[v.name] = value
    return refs


def build_plan(
    cluster: Cluster,
    spec: RunSpec,
    facts: Mapping[str, NodeFacts],
    *,
    master_addr: str,
    master_port: int,
    head_env: Mapping[str, str],
    head_cwd: str,
) -> LaunchPlan:
    """Every node's argv/env/cwd for this run (pure)."""
    hosts = cluster.hosts
    lightning = lightning_trainer(spec, head_cwd, len(hosts))
    nprocs = [nproc_for(spec, h, facts.get(h.name, NodeFacts()), lightning) for h in hosts]
    if len(set(nprocs)) > 1:
        detail = ", ".join(f"{h.name}={n}" for h, n in zip(hosts, nprocs))
        raise UsageError(
            f"every node must run the same number of processes, got {detail}",
            hint="set the same `slots` on every host, or pass --nproc-per-node",
        )
    nproc = nprocs[0]
    names = tuple(h.name for h in hosts)
    ips = ",".join(facts.get(h.name, NodeFacts()).address or h.connect_address for h in hosts)
    travelling = env_from_head(head_env)
    nodes = []
    for rank, host in enumerate(hosts):
        nf = facts.get(host.name, NodeFacts())
        ctx = NodeContext(
            python=host.python, program=spec.program, args=spec.args, module=spec.module,
            node_rank=rank, nnodes=len(hosts), nproc=nproc, master_addr=master_addr,
            master_port=master_port, hostnames=names, gpus=nf.gpus,
            launcher_args=spec.launcher_args, local_dir=head_cwd, accelerate_mode=nf.accelerate_mode,
        )
        cmd = PLANNERS[spec.launcher](ctx)
        env: dict[str, str] = {}
        env.update(travelling)
        refs = _apply_ds_env(env, spec.ds_env)
        env.update(cluster.env_for(host))
        env.update(spec.env)
        if nf.gloo_ifname and "GLOO_SOCKET_IFNAME" not in env:
            env["GLOO_SOCKET_IFNAME"] = nf.gloo_ifname
        env.update({
            "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port),
            "NODE_RANK": str(rank),
            "NNODES": str(len(hosts)),
            "WORLD_SIZE": str(ctx.world_size),
            "CORRAL_RUN_ID": spec.run_id,
            "CORRAL_NODE_RANK": str(rank),
            "CORRAL_NNODES": str(len(hosts)),
            "CORRAL_NPROC_PER_NODE": str(nproc),
            "CORRAL_HOSTS": ",".join(names),
            "CORRAL_NODE_IPS": ips,
            "CORRAL_STACK_SIGNAL": str(STACK_SIGNAL),
        })
        subset = gpus_for(spec, host)
        if subset is not None:  # indices as nvidia-smi numbers them (PCI order, not CUDA's fastest-first)
            env["CUDA_VISIBLE_DEVICES"] = format_gpus(subset)
            env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        env.update(cmd.env)
        for key, value in cmd.env_defaults.items():
            env.setdefault(key, value)
        node_refs = tuple((k, parts) for k, parts in refs if k not in env)  # unless set above it
        cwd = spec.workdir or cluster.workdir_for(host) or head_cwd
        nodes.append(NodePlan(
            host=host, node_rank=rank, nproc=nproc, first_rank=ctx.first_rank,
            argv=expand_contract(cmd.argv, env), env=env, cwd=cwd, pipe_rank=cmd.pipe_rank, requires=REQUIRES[spec.launcher],
            env_refs=node_refs,
            gpus=nf.held_gpus,
        ))
    return LaunchPlan(run_id=spec.run_id, launcher=spec.launcher, master_addr=master_addr,
                      master_port=master_port, nodes=tuple(nodes))

