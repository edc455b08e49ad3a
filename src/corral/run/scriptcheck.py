"""What a script's own source says about how it must be launched.

Read on the head before anything starts, so a script written for another
way of launching is named before it hangs or fails on every rank.  A
script that starts its own worker processes (``mp.spawn``, detectron2's
``launch``) and never asks the environment for its rank, run under a
launcher that already starts several processes per node: each of those
processes would start a full set of workers of its own, all of them
waiting on one rendezvous address (the PyTorch DDP tutorial's
``localhost:12355``) for a world size that never fills up: a silent hang.
And a module of a package (``from .data import X``) run as a file, which
Python refuses on every rank: it must be run with ``-m``.

A static look (``ast``), never an import: the head needs no torch, and the
script is not run.  It errs towards silence: any sign that the script reads
its rank from the environment (a ``"RANK"`` / ``"LOCAL_RANK"`` string, an
argparse ``--local_rank``, an ``init_process_group`` that reads ``env://``,
a framework that does it: accelerate, Lightning, DeepSpeed, transformers)
and nothing is said.

One more way of launching is refused outright, since it fails silently: a
script written for ``torch.distributed.launch``, which takes its local rank
from an argparse ``--local_rank`` and from nothing else.  torchrun (and
accelerate, built on it) set ``LOCAL_RANK`` in the environment and pass no
such argument, so every process keeps the argument's default, trains on its
own, and the run reports success.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

#: Strings whose presence means the script reads its rank from the environment.
_ENV_READS = frozenset({"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                        "CORRAL_NODE_RANK", "SLURM_PROCID", "SLURM_NODEID", "OMPI_COMM_WORLD_RANK"})
#: torch.distributed.launch's argument for the local rank.
_LOCAL_RANK_ARGS = frozenset({"--local_rank", "--local-rank"})
#: ... and either means the script reads its rank as a launcher gives it.
_ENV_AWARE = _ENV_READS | _LOCAL_RANK_ARGS
#: Launchers that set LOCAL_RANK in the environment and pass no --local_rank.
_ENV_ONLY_LAUNCHERS = ("torchrun", "accelerate")
#: A node rank handed to the script on its command line (corral expands these).
_NODE_RANK_ARGS = ("$NODE_RANK", "${NODE_RANK}", "$CORRAL_NODE_RANK", "${CORRAL_NODE_RANK}", "$RANK", "${RANK}")
#: Frameworks that read the launcher's environment themselves.
_ENV_FRAMEWORKS = frozenset({"accelerate", "lightning", "pytorch_lightning", "deepspeed", "transformers",
                             "composer", "ignite", "colossalai", "megatron", "torchtitan"})
#: Modules whose ``spawn`` / ``start_processes`` start one process per worker.
_SPAWN_MODULES = frozenset({"torch.multiprocessing", "torch_xla.distributed.xla_multiprocessing"})
#: Functions that start the workers themselves: (module, name).
_LAUNCH_FUNCTIONS = frozenset({("detectron2.engine", "launch"), ("detectron2.engine.launch", "launch"),
                               ("torch.multiprocessing", "spawn"), ("torch.multiprocessing", "start_processes")})


@dataclass(frozen=True, kw_only=True)
class SelfLaunch:
    """A script that starts its own workers: where, and with what."""

    line: int
    call: str  # as written, e.g. "mp.spawn"


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _env_init(call: ast.Call) -> bool:
    """``init_process_group`` that takes rank and world size from ``env://``:
    no ``rank``/``world_size`` given and no other ``init_method`` (a
    ``tcp://`` or ``file://`` one, or a ``store``)."""
    name = _dotted(call.func) or ""
    if name.rpartition(".")[2] != "init_process_group":
        return False
    given = {k.arg for k in call.keywords}
    if given & {"rank", "world_size", "store"} or len(call.args) > 2:
        return False
    method = next((k.value for k in call.keywords if k.arg == "init_method"),
                  call.args[1] if len(call.args) > 1 else None)
    return method is None or (isinstance(method, ast.Constant) and method.value in (None, "env://"))


def self_launch(source: str) -> SelfLaunch | None:
    """The first call that starts worker processes, in a script that never
    reads its rank from the environment; None otherwise (or when the source
    does not parse: Python will say why soon enough)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    modules: dict[str, str] = {}  # local name -> module it stands for
    functions: dict[str, tuple[str, str]] = {}  # local name -> (module, function)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in _ENV_FRAMEWORKS:
                    return None
                modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.split(".")[0] in _ENV_FRAMEWORKS:
                return None
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                modules[alias.asname or alias.name] = full
                functions[alias.asname or alias.name] = (node.module, alias.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in _ENV_AWARE:
            return None
        elif isinstance(node, ast.Call) and _env_init(node):
            return None  # its helpers may be spawned, the script itself is a rank
    found: SelfLaunch | None = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func)
        if name is None:
            continue
        head, _, attr = name.rpartition(".")
        if head:
            first, _, rest = head.partition(".")
            module = modules.get(first, first) + (f".{rest}" if rest else "")
            hit = module in _SPAWN_MODULES and attr in ("spawn", "start_processes")
        else:
            hit = functions.get(name) in _LAUNCH_FUNCTIONS
        if hit and (found is None or node.lineno < found.line):
            found = SelfLaunch(line=node.lineno, call=name)
    return found


def _mentions_local_rank(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Attribute) and n.attr == "local_rank")
               or (isinstance(n, ast.Name) and n.id == "local_rank") for n in ast.walk(node))


def _unguarded_env_init(node: ast.AST, guarded: bool = False) -> bool:
    """An env:// ``init_process_group`` the script reaches without asking
    ``local_rank`` first: it joins the job whatever --local_rank says."""
    if isinstance(node, ast.Call) and _env_init(node) and not guarded:
        return True
    if isinstance(node, (ast.If, ast.IfExp, ast.While)):
        inner = guarded or _mentions_local_rank(node.test)
        return any(_unguarded_env_init(child, inner) for child in ast.iter_child_nodes(node))
    return any(_unguarded_env_init(child, guarded) for child in ast.iter_child_nodes(node))


def local_rank_only(source: str) -> int | None:
    """The line of ``add_argument("--local_rank")`` in a script that takes
    its rank from that argument and from nothing else: no rank variable read
    from the environment, no framework that reads them, no env://
    ``init_process_group`` outside an ``if`` on ``local_rank``.  None
    otherwise, or when the source does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    line = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if any(n.split(".")[0] in _ENV_FRAMEWORKS for n in names):
                return None
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in _ENV_READS:
            return None
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "add_argument"
              and any(isinstance(a, ast.Constant) and a.value in _LOCAL_RANK_ARGS for a in node.args)):
            line = node.lineno if line is None else min(line, node.lineno)
    if line is None or _unguarded_env_init(tree):
        return None
    return line


def local_rank_problem(program: str, workdir: Path, *, launcher: str, world_size: int,
                       args: tuple[str, ...] = ()) -> tuple[str, str] | None:
    """(message, hint) for a ``--local_rank``-only script under a launcher
    that sets LOCAL_RANK in the environment and passes no such argument, with
    more than one process: every process would train alone and the run would
    report success.  None otherwise."""
    if launcher not in _ENV_ONLY_LAUNCHERS or world_size < 2 or not program.endswith(".py"):
        return None
    path = Path(program) if Path(program).is_absolute() else workdir / program
    try:
        line = local_rank_only(path.read_text(errors="replace"))
    except OSError:
        return None
    if line is None:
        return None
    rest = " ".join([program, *args])
    return (f"{program}:{line} takes its rank only from a --local_rank argument (the torch.distributed.launch "
            f"style), which {launcher} does not pass: each of the {world_size} processes would keep the "
            "argument's default and train alone, not distributed, and the run would report success; "
            "nothing was started",
            "read the rank from the environment as torchrun sets it, e.g. "
            "`args.local_rank = int(os.environ.get(\"LOCAL_RANK\", args.local_rank))` (and init_process_group "
            f"with env://), or run it with `corral run --launcher deepspeed {rest}`, which passes --local_rank "
            "to every process (DeepSpeed must be installed on the nodes)")


# --------------------------------------------------------------------------
# Lightning: how many processes the Trainer starts on each node

#: The Lightning classes whose ``devices`` / ``num_nodes`` decide the processes.
_LIGHTNING_CLASSES = frozenset({"Trainer", "Fabric"})


@dataclass(frozen=True, kw_only=True)
class LightningShape:
    """What a script's ``Trainer(...)`` says about the processes Lightning starts."""

    line: int
    call: str
    #: Processes per node; None with ``auto``, or when corral cannot tell.
    devices: int | None
    #: ``devices`` left out, ``"auto"`` or ``-1``: one per GPU (one on a CPU node).
    auto: bool
    #: ``num_nodes``, when the script says it (None: cannot tell; 1 if left out).
    num_nodes: int | None
    #: ``accelerator="cpu"``: one process per node with ``auto``, GPUs or not.
    cpu: bool = False


def _argparse_values(tree: ast.AST, args: tuple[str, ...]) -> dict[str, object]:
    """``args.X`` for each ``add_argument("--x", default=...)``: the value on
    the command line ``args``, else the default literal (absent: missing)."""
    found: dict[str, object] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        longs = [f for f in flags if f.startswith("--")]
        kw = {k.arg: k.value for k in node.keywords}
        dest = kw["dest"].value if isinstance(kw.get("dest"), ast.Constant) else (
            longs[0][2:].replace("-", "_") if longs else None)
        if not dest:
            continue
        value: object = None
        if isinstance(kw.get("default"), ast.Constant):
            value = kw["default"].value
        for i, arg in enumerate(args):
            name, eq, given = arg.partition("=")
            if name in flags:
                value = given if eq else (args[i + 1] if i + 1 < len(args) else None)
        found[dest] = value
    return found


def _literal(node: ast.AST | None, options: dict[str, object]) -> object:
    """The value of a keyword: a literal, or ``args.X`` of an argparse option."""
    if node is None:
        return None
    if isinstance(node, ast.Attribute) and node.attr in options:
        return options[node.attr]
    try:
        return ast.literal_eval(node)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return _UNKNOWN


_UNKNOWN = object()


def _count(value: object) -> int | None | object:
    """Processes for a ``devices`` value: an int, None for "auto", _UNKNOWN."""
    if isinstance(value, str):
        value = value.strip()
        if value == "auto" or value == "-1":
            return None
        if value.isdigit():
            return int(value)
        if "," in value:  # "0,1": these GPUs
            return len([v for v in value.split(",") if v.strip()])
        return _UNKNOWN
    if isinstance(value, bool):
        return _UNKNOWN
    if isinstance(value, int):
        return None if value == -1 else value
    if isinstance(value, (list, tuple)):
        return len(value)
    return _UNKNOWN


def lightning_shape(source: str, args: tuple[str, ...] = ()) -> LightningShape | None:
    """The first ``Trainer(...)`` / ``Fabric(...)`` call of the script and
    what its ``devices`` and ``num_nodes`` come to (literals, or argparse
    options as ``args`` gives them or by their defaults); None when the
    script has no such call or does not parse."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and (_dotted(n.func) or "").rpartition(".")[2] in _LIGHTNING_CLASSES]
    if not calls:
        return None
    call = min(calls, key=lambda n: (n.lineno, n.col_offset))
    options = _argparse_values(tree, args)
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    devices = _count(_literal(kw["devices"], options)) if "devices" in kw else None
    nodes = _literal(kw["num_nodes"], options) if "num_nodes" in kw else 1
    if isinstance(nodes, str) and nodes.isdigit():
        nodes = int(nodes)
    accelerator = _literal(kw.get("accelerator"), options)
    return LightningShape(
        line=call.lineno, call=_dotted(call.func) or "Trainer",
        devices=devices if isinstance(devices, int) else None, auto=devices is None,
        num_nodes=nodes if isinstance(nodes, int) and not isinstance(nodes, bool) else None,
        cpu=accelerator == "cpu")


def script_lightning_shape(program: str, workdir: Path, args: tuple[str, ...]) -> LightningShape | None:
    """``lightning_shape`` of the script file (None when it cannot be read here)."""
    if not program.endswith(".py"):
        return None
    path = Path(program) if Path(program).is_absolute() else workdir / program
    try:
        return lightning_shape(path.read_text(errors="replace"), args)
    except OSError:
        return None


def lightning_note(program: str, workdir: Path, *, args: tuple[str, ...], nproc: int,
                   told: bool) -> str | None:
    """The notice for a Lightning script whose Trainer's ``devices`` corral
    cannot read (and ``-n`` did not say): the rank labels and WORLD_SIZE
    assume ``nproc`` processes per node."""
    shape = script_lightning_shape(program, workdir, args)
    if told or shape is None or shape.devices is not None or shape.auto:
        return None
    return (f"{program}:{shape.line} {shape.call}(devices=...) is not a number corral can read: it counts "
            f"{nproc} process(es) per node (the hosts' slots or GPUs); if the Trainer starts another number, "
            "ranks are labelled wrong and WORLD_SIZE is wrong. Pass -n with the Trainer's devices to say")


def script_checks(program: str, workdir: Path, *, launcher: str, args: tuple[str, ...], nproc: int,
                  nnodes: int, told: bool) -> tuple[tuple[str, str] | None, list[str]]:
    """Everything the script's source says about this launch, once the
    processes per node are known: the (message, hint) of a launch that
    would go silently wrong (refused), and the notices to show."""
    problem = local_rank_problem(program, workdir, launcher=launcher, world_size=nproc * nnodes, args=args)
    notes = [self_launch_note(program, workdir, launcher=launcher, nproc=nproc, nnodes=nnodes, args=args)]
    if launcher == "lightning":
        notes.insert(0, lightning_note(program, workdir, args=args, nproc=nproc, told=told))
    return problem, [n for n in notes if n]


def relative_import_line(source: str) -> int | None:
    """The line of a relative import (``from .data import X``) the script runs
    at its top level: run as a file (``python pkg/train.py``) it cannot work,
    Python fails with "attempted relative import with no known parent
    package"; only ``python -m pkg.train`` can.  Imports under ``try``/``if``
    or in functions are left alone (the script may handle both ways)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:
            return node.lineno
    return None


def module_for(path: Path, base: Path) -> tuple[str, Path] | None:
    """``pkg/train.py`` as the module ``-m`` runs (``pkg.train``) and the
    directory it must be run from: ``base`` when the file is under it by a
    path of names Python can import, else the directory above the file's
    outermost package (``__init__.py``)."""
    path = path.resolve()
    try:
        parts = path.relative_to(base.resolve()).with_suffix("").parts
        if all(p.isidentifier() for p in parts):
            return ".".join(parts), base
    except ValueError:
        pass
    top = path.parent
    while (top / "__init__.py").is_file() and top.parent != top:
        top = top.parent
    parts = path.relative_to(top).with_suffix("").parts
    if top == path.parent or not all(p.isidentifier() for p in parts):
        return None
    return ".".join(parts), top


def script_and_args(launcher: str, program: str, args: tuple[str, ...]) -> tuple[str, tuple[str, ...]]:
    """The Python script a run starts, and its arguments: the program itself,
    or for ``--launcher command python train_net.py ...`` the first argument."""
    if launcher == "command" and re.fullmatch(r"python[0-9.]*", Path(program).name) and args \
            and args[0].endswith(".py"):
        return args[0], tuple(args[1:])
    return program, tuple(args)


def self_launch_note(program: str, workdir: Path, *, launcher: str, nproc: int, nnodes: int = 1,
                     args: tuple[str, ...] = ()) -> str | None:
    """The notice for a self-launching script where it will not do what its
    author meant: under a launcher that starts ``nproc`` > 1 processes per
    node, or as one process per node on several nodes without being told
    its node rank (each node would train on its own); None otherwise."""
    program, args = script_and_args(launcher, program, args)
    several_per_node = launcher in ("torchrun", "accelerate", "deepspeed") and nproc > 1
    alone_per_node = (launcher == "command" and nnodes > 1
                      and not any(m in a for a in args for m in _NODE_RANK_ARGS))
    if not (several_per_node or alone_per_node) or not program.endswith(".py"):
        return None
    path = Path(program) if Path(program).is_absolute() else workdir / program
    try:
        found = self_launch(path.read_text(errors="replace"))
    except OSError:
        return None
    if found is None:
        return None
    if several_per_node:
        return (f"{program}:{found.line} starts its own worker processes ({found.call}) and never reads RANK or "
                f"LOCAL_RANK: under {launcher} each of the {nproc} processes per node would start a set of its "
                "own, all waiting on one rendezvous that never fills up. Run it once per node instead: "
                f"`corral run --launcher command {program} ...` (NODE_RANK, NNODES, MASTER_ADDR and MASTER_PORT "
                "are set for it), or make it read RANK/LOCAL_RANK/WORLD_SIZE as torchrun sets them")
    return (f"{program}:{found.line} starts its own worker processes ({found.call}) and is given no node rank "
            f"(it reads no NODE_RANK or RANK, and no '$NODE_RANK' is among its arguments): on {nnodes} nodes "
            "each node would start a job of its own. Hand it the node's place in the cluster, as its options "
            "name them, e.g. --num-machines '$NNODES' --machine-rank '$NODE_RANK' "
            "--dist-url 'tcp://$MASTER_ADDR:$MASTER_PORT' (corral expands these on each node)")
