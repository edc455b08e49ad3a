"""Another local user, for the tests of directories in shared places.

``nobody`` (uid 65534) prepares what an attacker would in a world-writable,
sticky directory like /tmp: a directory corral will look for, made first and
left writable, or a symbolic link to a directory of its own.  The tests run
as root (the sandbox needs it), so they can act as nobody for real.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

NOBODY = 65534


def as_nobody(script: str) -> None:
    """Run ``script`` (sh) as nobody; it must succeed."""
    if os.geteuid() != 0:
        pytest.skip("acting as another user needs root")
    subprocess.run(["sh", "-ec", script], user=NOBODY, group=NOBODY, extra_groups=[], check=True,
                   env={"PATH": "/usr/bin:/bin"}, cwd="/")


@contextmanager
def shared_place() -> Iterator[Path]:
    """A new directory like /tmp (mode 1777, in /tmp: short, and nobody can
    reach it, unlike pytest's tmp_path); removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="cs", dir="/tmp"))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def prepare(kind: str, path: Path) -> None:
    """What nobody leaves at ``path`` before corral comes: ``open`` (a
    directory anyone can write in), ``link`` (a symbolic link to a directory
    of nobody's) or ``foreign`` (a directory of nobody's, 0700)."""
    target = f"{path}.theirs"
    script = {
        "open": f"mkdir -m 777 '{path}'",
        "link": f"mkdir -m 777 '{target}' && ln -s '{target}' '{path}'",
        "foreign": f"mkdir -m 700 '{path}'",
    }[kind]
    as_nobody(script)
