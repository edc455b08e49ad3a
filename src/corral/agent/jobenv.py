"""What a job's environment and command get on the node (stdlib only, Python 3.8+).

Node-side, shipped with the agent: where torchrun's elastic agent writes its
files (inside the job's own temporary directory, so nothing is left behind),
and the configured interpreter first on ``PATH``.
"""

import os

#: torchrun's elastic agent (also inside ``accelerate launch``) writes its
#: workers' error files under ``--log-dir``; without one it takes a fresh
#: ``mkdtemp("torchelastic_")`` and never removes it.  The option each
#: launcher module takes:
ELASTIC_LOG_DIR_FLAGS = {
    "torch.distributed.run": "--log-dir",
    "accelerate.commands.launch": "--log_dir",
}


def _accelerate_has_log_dir() -> bool:
    """Whether this node's accelerate launch takes ``--log_dir`` (0.31+).

    Read from its source without importing it (that would import torch)."""
    try:
        import importlib.util

        spec = importlib.util.find_spec("accelerate")
        if spec is None or not spec.origin:
            return False
        with open(os.path.join(os.path.dirname(spec.origin), "commands", "launch.py")) as f:
            return '"--log_dir"' in f.read()
    except (ImportError, OSError, ValueError):
        return False


def elastic_log_dir(argv: list, env: dict, path: str) -> list:
    """``argv`` with torchrun's log directory in the job's temporary directory.

    The option goes right after the module, so a ``--log-dir`` the user gave
    (``--launcher-arg``) comes later and wins; a ``PET_LOG_DIR`` in the job's
    environment is kept too.  For an accelerate without ``--log_dir`` (older
    than 0.31, which passes torchrun's defaults through), ``PET_LOG_DIR``.
    """
    module = argv[2] if len(argv) > 2 and argv[1] == "-m" else None
    flag = ELASTIC_LOG_DIR_FLAGS.get(module)
    if flag is None or env.get("PET_LOG_DIR"):
        return argv
    if module == "accelerate.commands.launch" and not _accelerate_has_log_dir():
        env["PET_LOG_DIR"] = path
        return argv
    return argv[:3] + ["%s=%s" % (flag, path)] + argv[3:]


def activate_python(env: dict) -> None:
    """Put the configured interpreter's directory first on ``PATH``, as activating its venv would.

    ``CORRAL_PYTHON`` is the host's ``python`` from the cluster file; a bare
    name (``python3``) or a directory already on ``PATH`` changes nothing.
    """
    python = env.get("CORRAL_PYTHON") or ""
    if not os.path.isabs(python):
        return
    bindir = os.path.dirname(python)
    path = env.get("PATH") or os.defpath
    parts = [p.rstrip("/") or "/" for p in path.split(os.pathsep)]
    if bindir.rstrip("/") in parts:
        return
    env["PATH"] = bindir + os.pathsep + path
