"""Shared test fixtures.

The autouse fixture keeps tests away from the developer's own setup: HOME is
a fresh temporary directory, run directories go to the test's own
``tmp_path/runs`` ($CORRAL_RUNS_DIR; never the checkout's ./runs) and launcher variables (MASTER_*, NCCL_*, PET_*,
torchrun's and Slurm's) are stripped, so a test never inherits a rendezvous
address or an NCCL setting from the shell it was started in.  Tests not
marked ``gpu`` see no GPU (``CUDA_VISIBLE_DEVICES=""``): they test the CPU
paths the same way on a GPU machine as in CI.  ``OMP_NUM_THREADS=1``: the
sandbox's nodes share the head's cores (see the fixture).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False

_STRIP_PREFIXES = (
    "MASTER_",
    "NCCL_",
    "PET_",
    "TORCHELASTIC_",
    "SLURM_",
    "CORRAL_",
    "GLOO_",
    "ACCELERATE_",
)
_STRIP_NAMES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK", "GROUP_RANK")


@pytest.fixture(autouse=True)
def isolated_env(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch,
                 request: pytest.FixtureRequest, tmp_path: Path):
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # ssh control sockets stay per test
    for key in list(os.environ):
        if key.startswith(_STRIP_PREFIXES) or key in _STRIP_NAMES:
            monkeypatch.delenv(key, raising=False)
    # A run a test makes goes to its own tmp_path/runs, wherever the test runs
    # it from: never the checkout's ./runs, where `corral diagnose` with no
    # argument would explain a planted failure instead of the user's own.
    # (A test of the ./runs default deletes it.)
    monkeypatch.setenv("CORRAL_RUNS_DIR", str(tmp_path / "runs"))
    # One OpenMP thread per process (corral forwards it to every node, as a
    # user's own setting).  The sandbox's nodes share the head's cores, so a
    # rank alone on its "node" would size its pool to all of them: three such
    # ranks on 2 cores spend half their time in OpenMP's spin-wait (a 3-node
    # recipe launch took 17-20 s, 7-10 s with one thread).  It also fixes
    # the thread count a tensor sum is split by: a run compared bit for bit
    # with another must not depend on how many CPUs the machine gave a
    # process at that moment (a recipe's exact-resume test failed in CI so).
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    if request.node.get_closest_marker("gpu") is None:
        # Tests not marked `gpu` test the CPU paths (gloo, 2 processes), on a
        # GPU machine too: a 1-GPU machine would otherwise run their 2 ranks
        # with NCCL on cuda:0 and cuda:1.
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    yield home


#: Python lines for a child process that measures its own peak memory.
#: ``ru_maxrss`` survives execve: a child started from a big pytest process
#: reports the parent's peak (280 MB late in the suite), so the child resets
#: its peak first (``clear_refs`` 5) and reads ``VmHWM`` at the end.
RESET_PEAK_RSS = "open('/proc/self/clear_refs', 'w').write('5')"
PEAK_RSS_KIB = ("int([ln for ln in open('/proc/self/status') if ln.startswith('VmHWM')][0].split()[1])")


@pytest.fixture
def torch_extensions(request: pytest.FixtureRequest) -> Path:
    """Where DeepSpeed's CPU tests JIT-compile its shared-memory comm op (~1 min):
    the checkout's pytest cache, shared by those tests and by the sandbox
    nodes.  A build killed half-way (a timed-out test) leaves torch's ``lock``
    file behind, and every later build waits on it for ever: this session is
    the only builder there, so a lock found before it starts is stale."""
    path = request.config.cache.mkdir("torch_extensions")
    for lock in path.glob("*/*/lock"):
        lock.unlink(missing_ok=True)
    return path


def ninja_path(path: str | None = None) -> str:
    """``path`` (default: this process's PATH) with the venv's bin directory first.

    torch JIT-builds DeepSpeed's CPU op with whichever ``ninja`` is on PATH.
    Under ``corral run`` that is the venv's (pip's ninja 1.13: the agent puts
    the interpreter's directory first, as an activated venv does); a launcher
    started without corral found the system's (1.11).  The two hash a
    command differently in the shared cache's build log, so each saw the
    other's entries as changed commands and rebuilt the op (~30 s).
    DeepSpeed's tests started without corral use this PATH."""
    bindir = str(Path(sys.executable).parent)
    return bindir + os.pathsep + (path if path is not None else os.environ.get("PATH", os.defpath))


@pytest.fixture
def python_exe() -> str:
    """The interpreter running the tests (has torch installed for run tests)."""
    return sys.executable


# ---------------------------------------------------------------------------
# The multi-node sandbox (tests marked `sandbox`; see docs/sandbox.md)

#: Nodes in the shared session sandbox.
SANDBOX_NODES = 4


@pytest.fixture(scope="session")
def sandbox(tmp_path_factory: pytest.TempPathFactory):
    """A 4-node sandbox (real sshd per node, head key authorized), shared by the session.

    Its name and node prefix carry this pytest process's pid (nodes
    ``t<pid>n1``..``t<pid>n4``), so test sessions running side by side never
    collide.  Use ``sandbox.cluster_file`` for ``corral run --cluster``,
    ``sandbox.ssh_config`` for ``ssh -F``, ``sandbox.exec(node, argv)`` to
    look inside a node.  Tests that inject faults must undo them
    (``heal``; ``up()`` restarts stopped nodes).  Torn down at session end,
    also after failures and Ctrl-C.  Skipped only when not root (CI is root).
    """
    if os.geteuid() != 0:
        pytest.skip("the sandbox needs root (network/PID/mount namespaces); CI runs as root")
    from corral.sandbox import Sandbox

    _remove_sandboxes_of_dead_sessions()
    tag = f"t{os.getpid()}"
    sb = Sandbox(name=tag, prefix=f"{tag}n", state_dir=tmp_path_factory.mktemp("sandbox") / "state")
    try:
        # Tests run the repository's examples on the nodes without syncing them:
        # a checkout under /tmp (CI) is mounted through like an NFS project.
        sb.up(SANDBOX_NODES, with_keys=True, share=[str(REPO)])
        yield sb
    finally:
        sb.down()


def first_nodes_cluster(sandbox, n: int, path: Path) -> Path:
    """A cluster file of the sandbox's first ``n`` nodes (the same settings):
    for tests that need several nodes but not all four (each rank costs CPU
    time on CI's two cores)."""
    import tomllib

    import tomlkit

    doc = tomllib.loads(sandbox.cluster_file.read_text())
    doc["hosts"] = doc["hosts"][:n]
    path.write_text(tomlkit.dumps(doc))
    return path


def _remove_sandboxes_of_dead_sessions() -> None:
    """Test sandboxes are named after their pytest's pid (``t<pid>``, ``u<pid>r``...);
    one whose session was killed (SIGKILL, CI timeout) is removed here."""
    import re
    import warnings

    from corral.errors import CorralError
    from corral.sandbox import Sandbox, present_sandboxes

    for name in present_sandboxes():
        match = re.fullmatch(r"[tuv](\d+)[a-z]?", name)
        if match and not os.path.exists(f"/proc/{match.group(1)}"):
            try:
                Sandbox(name=name).down()
            except CorralError as err:  # another session may be removing it right now
                warnings.warn(f"stale test sandbox {name}: {err}", stacklevel=1)


# ---------------------------------------------------------------------------
# GPU tests (marked `gpu`): run only where a CUDA GPU is visible.


def _has_cuda_gpu() -> bool:
    import shutil
    import subprocess

    exe = shutil.which("nvidia-smi")
    if not exe:
        return False
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "GPU " in out


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _has_cuda_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA GPU (nvidia-smi lists none here); CI has no GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
