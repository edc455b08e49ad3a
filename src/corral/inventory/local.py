"""The default cluster: this machine.

``corral run train.py`` with no hostfile runs on the machine it is typed on,
one process per GPU, or two CPU processes when there is no GPU -- enough to
exercise ``torch.distributed`` (gloo) before renting a cluster.  GPUs are
counted with ``nvidia-smi -L`` because the head must not need torch.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys

from corral.agent.probes import visible_count
from corral.model import Cluster, Host

log = logging.getLogger(__name__)

#: Processes on a machine without GPUs: two, so the run is really distributed.
CPU_SLOTS = 2
_NVIDIA_SMI_TIMEOUT_S = 20.0


def count_gpus() -> int | None:
    """NVIDIA GPUs this machine's jobs may use (nvidia-smi's list, cut by
    CUDA_VISIBLE_DEVICES), or None when there are none or no usable nvidia-smi."""
    listed = _listed_gpus()
    # What torchrun's ranks will see: `CUDA_VISIBLE_DEVICES=0,1 corral run`
    # on an 8-GPU machine is two processes, as `--nproc-per-node gpu` would be.
    return visible_count(listed or 0, os.environ.get("CUDA_VISIBLE_DEVICES")) or None


def _listed_gpus() -> int | None:
    """GPUs ``nvidia-smi -L`` lists, or None without a usable nvidia-smi.

    A driver that is installed but broken (``nvidia-smi`` fails) counts as
    no GPU here; ``corral doctor`` is where such a machine is diagnosed.
    """
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, "-L"], stdin=subprocess.DEVNULL, capture_output=True, text=True,
            timeout=_NVIDIA_SMI_TIMEOUT_S, check=False,
        )
    except (subprocess.TimeoutExpired, OSError) as err:
        log.warning("nvidia-smi -L failed (%s); treating this machine as having no GPU", err)
        return None
    if proc.returncode != 0:
        log.warning("nvidia-smi -L exited %d: %s", proc.returncode, proc.stderr.strip())
        return None
    return sum(1 for line in proc.stdout.splitlines() if line.startswith("GPU "))


def local_cluster(*, gpus: int | None = None, detect: bool = True) -> Cluster:
    """One host: this machine, reached without ssh.

    ``gpus`` overrides detection (tests, or a caller that already counted).
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hidden = False
    if gpus is None and detect:
        listed = _listed_gpus() or 0
        gpus = visible_count(listed, visible) or None
        hidden = listed > 0 and gpus is None
    name = socket.gethostname() or "localhost"
    # The interpreter running corral: in a virtual environment that is the one
    # with the user's torch, which a bare `python3` on PATH may not be.
    host = Host(name=name, address="127.0.0.1", local=True, slots=gpus or CPU_SLOTS,
                python=sys.executable or "python3")
    if gpus:
        what = f"{gpus} GPU process(es)" + (f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "")
    elif hidden:
        what = f"{CPU_SLOTS} CPU processes, no GPU visible with CUDA_VISIBLE_DEVICES={visible!r}"
    else:
        what = f"{CPU_SLOTS} CPU processes, no GPU found"
    return Cluster(hosts=(host,), source=f"this machine ({name}: {what})")
