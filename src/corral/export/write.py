"""Writing an export: every file atomically, nothing overwritten without --force.

All files are first written beside their destination under temporary names
(created 0600 by ``mkstemp``, so a file that holds environment values is
never readable by others, not even for a moment), then renamed into place:
an interrupted export leaves the old files, never half of a new one.  The
rename replaces a symlink at the destination rather than writing through it.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from corral.errors import UsageError
from corral.export import Export

PUBLIC_MODE = 0o644
PRIVATE_MODE = 0o600


def destinations(export: Export, target: Path) -> dict[str, Path]:
    """Where each file goes: ``target`` itself for a one-file format (unless
    it is a directory), else files inside the directory ``target``."""
    if len(export.files) == 1 and not target.is_dir() and not str(target).endswith(os.sep):
        return {export.files[0].name: target}
    return {f.name: target / f.name for f in export.files}


def _directory(path: Path, *, private: bool) -> None:
    """Create the output directory (0700 when it will hold private files),
    or check the one that is there: a directory of someone else's in a
    shared place (/tmp) is refused, as a link to one is."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        path.mkdir(mode=0o700 if private else 0o755, parents=True)
        return
    if stat.S_ISLNK(st.st_mode) and not path.is_dir():
        raise UsageError(f"-o {path}: a link to something that is not a directory",
                         hint="give a directory, or a new path")
    if not path.is_dir():
        raise UsageError(f"-o {path}: not a directory (this format writes several files)",
                         hint="give a directory (created if missing)")
    owner = path.stat().st_uid
    if private and owner not in (os.geteuid(), 0):
        raise UsageError(f"-o {path}: the directory belongs to uid {owner}, not you, and the export holds "
                         "the job's environment", hint="give a directory of your own")


def write_export(export: Export, target: Path, *, force: bool) -> list[Path]:
    """Write every file of ``export`` at ``target``; return their paths."""
    where = destinations(export, target)
    private = any(f.private for f in export.files)
    parents = {p.parent for p in where.values()}
    existing = [p for p in where.values() if os.path.lexists(p)]
    if existing and not force:
        names = ", ".join(str(p) for p in existing)
        raise UsageError(f"{names}: already there (nothing was written)",
                         hint="give --force to replace, or another -o")
    for parent in sorted(parents):
        _directory(parent, private=private)
    staged: list[tuple[str, Path]] = []
    try:
        for f in export.files:
            dest = where[f.name]
            if os.path.isdir(dest) and not os.path.islink(dest):
                raise UsageError(f"{dest}: a directory is in the way", hint="remove it or give another -o")
            fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
            staged.append((tmp, dest))
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                out.write(f.text)
                out.flush()
                os.fchmod(out.fileno(), PRIVATE_MODE if f.private else PUBLIC_MODE)
                os.fsync(out.fileno())
        for tmp, dest in staged:
            os.replace(tmp, dest)
    except BaseException:
        for tmp, _ in staged:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise
    return list(where.values())
