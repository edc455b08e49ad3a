"""`corral export FORMAT`: a cluster corral can read, written as another tool's files.

Nobody is locked in: the hosts (and, for a launcher, the job: ranks,
rendezvous, environment) go out as a DeepSpeed hostfile and
``.deepspeed_env``, accelerate configs, torchrun or mpirun command lines, a
pdsh host list or an ssh_config, each of which launches the same job with
its own tool.  The launch formats reuse ``run.plan.build_plan``, so the
environment they carry is exactly the one ``corral run`` would send.

A format is one entry of ``FORMATS``: a name, a one-line summary, whether it
takes the job's PROGRAM, and ``module:function`` of its builder, a pure
function ``ExportRequest -> Export``.  Builders never write: ``write.py``
does, atomically, for every format alike.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from corral.errors import UsageError
from corral.model import Cluster
from corral.run.plan import RunSpec


@dataclass(frozen=True, kw_only=True)
class ExportFile:
    """One file of an export, named relative to the output directory."""

    name: str
    text: str
    #: Holds environment values (which may be tokens): written 0600.
    private: bool = False


@dataclass(frozen=True, kw_only=True)
class Export:
    """What a format produced: its files, and how to use them."""

    format: str
    files: tuple[ExportFile, ...]
    #: Command lines that use the files, one per line (per node where the tool needs one).
    commands: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: Format-specific values for ``--json`` (the pdsh -w list, ...).
    data: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class ExportRequest:
    """What ``corral export`` was asked for."""

    cluster: Cluster
    #: The job, for the launch formats; its program is None-like ("") when not given.
    spec: RunSpec
    #: Whether PROGRAM was given (launch lines without one name a placeholder).
    has_program: bool
    master_port: int
    #: The nodes have no GPUs: CPU training over gloo.
    cpu: bool
    #: Absolute directory the files will be in (command lines name them there).
    outdir: Path
    head_env: Mapping[str, str]
    head_cwd: str
    #: A one-file format written to a file named with -o: its path.
    single_file: Path | None = None

    def path_of(self, name: str) -> Path:
        """Where the file ``name`` of the export will be (command lines name it)."""
        return self.single_file or self.outdir / name


@dataclass(frozen=True, kw_only=True)
class Format:
    name: str
    summary: str
    #: ``module:function`` of the builder (imported only when used).
    builder: str
    #: The job's PROGRAM: "required", "optional" (command lines name a
    #: placeholder without it) or "none" (the format is about hosts only).
    program: str = "optional"
    #: Writes one file: ``-o`` may name the file itself.
    one_file: bool = False

    def build(self, request: ExportRequest) -> Export:
        module, _, func = self.builder.partition(":")
        build: Callable[[ExportRequest], Export] = getattr(importlib.import_module(module), func)
        return build(request)


_LAUNCH = "corral.export.launch"
_REMOTE = "corral.export.remote"

#: Every format ``corral export`` writes.  A new one is one line here.
FORMATS: dict[str, Format] = {f.name: f for f in (
    Format(name="accelerate", builder=f"{_LAUNCH}:accelerate",
           summary="one accelerate config per node (accelerate launch --config_file)"),
    Format(name="deepspeed", builder=f"{_LAUNCH}:deepspeed",
           summary="hostfile + .deepspeed_env + ssh_config for `deepspeed --hostfile`"),
    Format(name="torchrun", builder=f"{_LAUNCH}:torchrun", program="required", one_file=True,
           summary="one torchrun command line per node"),
    Format(name="mpi", builder=f"{_LAUNCH}:mpi", program="required",
           summary="an OpenMPI hostfile and the mpirun line (one torchrun per node)"),
    Format(name="pdsh", builder=f"{_REMOTE}:pdsh", program="none",
           summary="the folded -w list and PDSH_SSH_ARGS_APPEND (with an ssh_config)"),
    Format(name="ssh-config", builder=f"{_REMOTE}:ssh_config", program="none", one_file=True,
           summary="Host blocks for every node: resolved address, user, port, key, ProxyJump"),
    # `corral export sbatch` is not a cluster export: it asks for the Slurm
    # job's own shape (--nodes, --gpus-per-node, --time...), so it is its own
    # subcommand (corral.cli.export_sbatch, corral.slurm.sbatch).
)}


def get_format(name: str) -> Format:
    try:
        return FORMATS[name]
    except KeyError:
        raise UsageError(f"no export format {name!r}",
                         hint=f"pick one of {', '.join(FORMATS)}") from None


__all__ = ["FORMATS", "Export", "ExportFile", "ExportRequest", "Format", "get_format"]
