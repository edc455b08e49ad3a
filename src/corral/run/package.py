"""What a detached job's supervisor needs on node 0, packed on the head.

A node has nothing of corral's installed, only Python.  The supervisor is
corral's own run loop, so it needs corral's package and its pure-Python
dependencies (click, rich, tomlkit): they are zipped here from this
machine's installed files (never from a registry), named by the sha256 of
the zip, and sent once per node and version over the ssh channel
(``corral.agent.jobs.op_put`` unpacks it into a private cache there).

The node-side operations themselves (``corral.agent.jobs``, stdlib only)
travel as the ``python3 -c`` source of each call, as the agent does.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import zipfile
import zlib
from functools import lru_cache
from importlib import resources
from pathlib import Path

#: Packages the supervisor imports (or may): corral and its pure-Python dependencies.
PACKAGES = ("corral", "click", "rich", "tomlkit")
#: A fixed time stamp: the same files make the same zip, hence the same hash.
_EPOCH = (2020, 1, 1, 0, 0, 0)


def _files(package: str) -> list[tuple[str, Path]]:
    """(name in the zip, file here) of an installed package, without caches."""
    module = __import__(package)
    root = Path(module.__file__).parent
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith((".pyc", ".pyo")):
                continue
            path = Path(dirpath, name)
            out.append((f"{package}/{path.relative_to(root).as_posix()}", path))
    return out


@lru_cache(maxsize=1)
def supervisor_package() -> tuple[bytes, str]:
    """(zip bytes, sha256 hex) of what the supervisor runs from.

    Zipping takes about a second; the zip is kept in this user's private
    cache (``~/.cache/corral/pkg/``), named after the files' names, sizes
    and modification times, so a detached start pays it once per version."""
    files = [(name, path, path.stat()) for package in PACKAGES for name, path in _files(package)]
    key = hashlib.sha256(repr([(n, st.st_size, st.st_mtime_ns) for n, _, st in files]).encode()).hexdigest()
    cached = _cache_dir()
    zpath = cached / f"head-{key[:32]}.zip" if cached else None
    if zpath is not None and zpath.is_file() and not zpath.is_symlink():
        data = zpath.read_bytes()
        return data, hashlib.sha256(data).hexdigest()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as z:
        for name, path, _ in files:
            info = zipfile.ZipInfo(name, date_time=_EPOCH)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o600 << 16
            z.writestr(info, path.read_bytes())
    data = buf.getvalue()
    if zpath is not None:
        for old in cached.glob("head-*.zip"):  # an older version's
            old.unlink(missing_ok=True)
        tmp = zpath.with_name(f".{zpath.name}.{os.getpid()}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, zpath)
        except OSError:
            tmp.unlink(missing_ok=True)  # a cache only: the next start zips again
    return data, hashlib.sha256(data).hexdigest()


def _cache_dir() -> Path | None:
    """This user's private cache directory for the zip, or None (no cache)."""
    from corral.agent.private import UnsafePlace, private_dir

    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    path = base / "corral" / "pkg"
    try:
        private_dir(str(path), str(Path.home()) if str(path).startswith(str(Path.home()) + "/") else str(base))
    except (UnsafePlace, OSError, ValueError):
        return None
    return path


#: Runs the node-side module: its source, ``private``'s and ``holds``' come packed in argv.
_BOOT = ("import sys,json,zlib,base64,types;"
         "_s=json.loads(zlib.decompress(base64.b64decode('{blob}')));"
         "_p=types.ModuleType('corral_agent_private');sys.modules['corral_agent_private']=_p;"
         "exec(_s[0],_p.__dict__);"
         "_h=types.ModuleType('corral_agent_holds');sys.modules['corral_agent_holds']=_h;"
         "exec(_s[1],_h.__dict__);"
         "_g={{'__name__':'corral_agent_jobs'}};exec(_s[2],_g);"
         "raise SystemExit(_g['main'](sys.argv[1:]))")


@lru_cache(maxsize=1)
def jobs_program() -> str:
    """``python -c`` source that runs one ``corral.agent.jobs`` operation
    (argv: op, args); shell-safe (base64), a few kilobytes.  ``holds`` comes
    along: `corral ps` also lists the attended jobs holding GPUs and ports."""
    pkg = resources.files("corral.agent")
    sources = [pkg.joinpath(name).read_text() for name in ("private.py", "holds.py", "jobs.py")]
    blob = base64.b64encode(zlib.compress(json.dumps(sources).encode(), 9)).decode()
    return _BOOT.format(blob=blob)
