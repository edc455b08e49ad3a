"""Whether a rank may be forked from the preloaded interpreter (see ``preload.py``).

A forked rank cannot differ from a fresh one in anything decided while
Python started or torch was imported.  This module says what that is: the
environment variables read then (``env_mismatch``), the thread pools sized
then (``blas_pools``), and a script that changes either before it imports
torch (``script_blocker``, a static look at its top level and the modules
next to it that it imports first).

Stdlib only.  The node agent imports it (as ``corral_agent_prescan``) to
decide whether its prewarmed torchrun fits the job; the prewarmed torchrun
runs it next to ``preload.py``.
"""

import os

#: Environment read while Python starts or torch is imported: a difference
#: here between the zygote and a rank means the rank would not be the same.
SENSITIVE_PREFIXES = (
    "PYTHON", "LD_", "LANG", "LC_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO_", "BLIS_",
    "NPY_", "TORCH", "PYTORCH", "CUDA_MODULE_LOADING",
)
#: ... except these, read only later (at process-group or CUDA set-up), and the
#: ones torchrun itself sets per worker.  ``PYTORCH_NVML_BASED_CUDA_CHECK`` is
#: read by each ``torch.cuda.is_available()`` call; importing Lightning sets it
#: in its process, and so in the environment of everything that process
#: starts (a head that imported Lightning forwarded it, and its ranks were
#: never preloaded).
INSENSITIVE_PREFIXES = (
    "TORCHELASTIC_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_DEBUG", "TORCH_HOME", "PYTORCH_NVML_BASED_CUDA_CHECK",
)
#: Fixed up: in the rank itself (torchrun sets OMP_NUM_THREADS to 1 for several
#: ranks per node), or in the prewarmed torchrun before the zygote is forked
#: (prewarm.py: PREWARM_FIXUPS), or moot (torchrun runs ranks with ``-u``).
FIXED_UP = ("OMP_NUM_THREADS", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE")
#: Importing these imports torch: the script's top level is only looked at up to them.
TORCH_IMPORTERS = frozenset((
    "torch", "torchvision", "torchaudio", "torchtext", "transformers", "accelerate",
    "deepspeed", "lightning", "pytorch_lightning", "timm", "diffusers", "peft", "trl",
    "fairscale", "apex", "megatron", "torchmetrics", "xformers", "flash_attn",
))


def _sensitive(key):
    return key.startswith(SENSITIVE_PREFIXES) and not key.startswith(INSENSITIVE_PREFIXES)


def env_mismatch(base, env, hook_dir=None, skip=(), prefixes=None):
    """The first start-up-sensitive variable that differs, or None.

    ``PYTHONPATH`` may differ by corral's hook directory in front (the agent
    adds it for the workload).  ``prefixes`` narrows what counts (default:
    everything read at Python's start or torch's import).
    """
    def counts(key):
        return _sensitive(key) and (prefixes is None or key.startswith(prefixes))

    keys = {k for k in base if counts(k)} | {k for k in env if counts(k)}
    for key in sorted(keys):
        if key in skip:
            continue
        a, b = base.get(key), env.get(key)
        if key == "PYTHONPATH" and hook_dir and b is not None:
            parts = b.split(os.pathsep)
            if parts and parts[0] == hook_dir:
                rest = os.pathsep.join(parts[1:])
                b = rest if rest else None
        if a != b:
            return key
    return None


# --------------------------------------------------------------------------
# Thread pools sized while torch was imported

#: Setters of OpenBLAS's thread count (numpy's wheels rename the library and
#: its symbols).
_OPENBLAS_SETTERS = (
    "openblas_set_num_threads", "openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
)
#: Other thread-pool libraries whose size a forked rank could not correct.
_UNFIXABLE_POOLS = ("mkl_rt", "libmkl", "iomp5", "blis", "flexiblas")


def blas_pools():
    """([OpenBLAS setter functions], problem or None) for the libraries loaded here.

    numpy's OpenBLAS sizes its thread pool from ``OMP_NUM_THREADS`` when it is
    loaded (with torch, here in the zygote): a rank that gets another value
    from torchrun has its pool resized through OpenBLAS's own setter.
    """
    import ctypes

    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and parts[5].startswith("/") and parts[5] not in paths:
                    paths.append(parts[5])
    except OSError:
        return [], "cannot read /proc/self/maps"
    setters = []
    for path in paths:
        base = os.path.basename(path).lower()
        if "openblas" in base:
            lib = ctypes.CDLL(path)
            fn = next((getattr(lib, n) for n in _OPENBLAS_SETTERS if hasattr(lib, n)), None)
            if fn is None:
                return [], "%s has no thread-count setter" % os.path.basename(path)
            setters.append(fn)
        elif any(k in base for k in _UNFIXABLE_POOLS):
            return [], "%s sized its thread pool at import" % os.path.basename(path)
    return setters, None


def omp_threads(env):
    """The count OpenMP (and OpenBLAS) would read from ``OMP_NUM_THREADS``; 0 if none."""
    try:
        n = int((env.get("OMP_NUM_THREADS") or "").split(",")[0])
    except ValueError:
        return 0
    return n if n > 0 else 0


# --------------------------------------------------------------------------
# The script's top level, before it imports torch


def _env_target(node):
    """A literal key for os.environ[...], '' for anything else (dynamic)."""
    import ast

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return ""


def _is_env(node):
    import ast

    # os.environ / environ
    if isinstance(node, ast.Attribute) and node.attr == "environ":
        return True
    return isinstance(node, ast.Name) and node.id == "environ"


def _is_sys_attr(node, names):
    import ast

    return (isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name)
            and node.value.id == "sys")


def _mutation(stmt):
    """Why this top-level statement changes start-up state, or None."""
    import ast

    for node in ast.walk(stmt):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]
            for t in targets:
                if isinstance(t, ast.Subscript) and _is_env(t.value):
                    key = _env_target(t.slice)
                    if not key or _sensitive(key):
                        return "sets %s before importing torch" % ("os.environ[%r]" % key if key else "os.environ")
                if _is_sys_attr(t, ("path", "meta_path", "path_hooks")):
                    return "changes sys.%s before importing torch" % t.attr
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if _is_env(f.value) and f.attr in ("update", "setdefault", "__setitem__"):
                key = _env_target(node.args[0]) if node.args and f.attr != "update" else ""
                if not key or _sensitive(key):
                    return "sets os.environ%s before importing torch" % (
                        "[%r]" % key if key else "." + f.attr)
            if f.attr == "putenv" and isinstance(f.value, ast.Name) and f.value.id == "os":
                return "calls os.putenv before importing torch"
            if _is_sys_attr(f.value, ("path", "meta_path", "path_hooks")) and f.attr in (
                    "insert", "append", "extend", "__setitem__"):
                return "changes sys.%s before importing torch" % f.value.attr
    return None


def _imports(stmt, here):
    """(imports a torch library, [files of modules next to the script it imports])."""
    import ast

    torch_lib, local = False, []
    for node in ast.walk(stmt):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.ImportFrom):
            torch_lib = True  # a relative import: the package may import anything
        for name in names:
            top = name.split(".")[0]
            if top in TORCH_IMPORTERS:
                torch_lib = True
            for candidate in (os.path.join(here, top + ".py"), os.path.join(here, top, "__init__.py")):
                if os.path.isfile(candidate):
                    local.append(candidate)
                    break
    return torch_lib, local


def _scan(path, here, seen, depth):
    """(why start-up would differ, or None; whether torch got imported) for one file."""
    import ast

    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return None, True  # the rank reports it, as a fresh interpreter would; stop looking
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        why = _mutation(stmt)
        torch_lib, local = _imports(stmt, here)
        if why:  # (in a compound statement with a torch import too: assume it came first)
            return ("%s: %s" % (os.path.relpath(path, here), why)) if depth else why, False
        for module in local:
            if module in seen:
                continue
            seen.add(module)
            if depth >= 3:
                return None, True  # deep enough: assume it imports torch
            inner, imported = _scan(module, here, seen, depth + 1)
            if inner:
                return inner, False
            if imported:
                return None, True
        if torch_lib:
            return None, True
    return None, False


def script_blocker(path):
    """Why this script's start-up would differ if torch were already imported; None if it would not.

    Looks at module-level statements in order (not inside functions or
    classes) until the first one that imports torch or a library built on
    it, following imports of modules next to the script (three deep).
    """
    path = os.path.abspath(path)
    return _scan(path, os.path.dirname(path), {path}, 0)[0]
