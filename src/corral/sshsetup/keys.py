"""The head's own key: the one installed on every node for head -> node logins.

Order of choice: ``--identity FILE``; else the first of ssh's own
``IdentityFile`` candidates (``ssh -G``: ``~/.ssh/id_rsa``,
``~/.ssh/id_ed25519``...) that exists with its ``.pub``; else a new
``~/.ssh/id_ed25519`` made by ``ssh-keygen``, after asking.  ``~`` is the
home ssh uses (the password database's), so the key is where ssh looks.
Only the public half is ever read.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from corral.errors import UsageError
from corral.sshsetup.hostkeys import Target, ssh_home


@dataclass(frozen=True, kw_only=True)
class Identity:
    """A private key path (never read) and its public key line."""

    path: Path
    public_key: str
    generated: bool = False


def read_public(path: Path, *, flag: str = "--identity") -> str:
    pub = Path(str(path) + ".pub")
    if not path.exists():
        raise UsageError(
            f"{flag} {path}: no such file",
            hint="give the private key; its .pub must sit next to it",
        )
    if not pub.exists():
        raise UsageError(
            f"{flag} {path}: {pub} is missing",
            hint=f"recreate it with `ssh-keygen -y -f {path} > {pub}`",
        )
    line = pub.read_text().strip()
    if len(line.split()) < 2:
        raise UsageError(
            f"{pub}: not an OpenSSH public key", hint="expected 'ssh-ed25519 AAAA... comment'"
        )
    return line


def find(identity: Path | None, targets: list[Target]) -> Identity | None:
    """The key to install, or None when there is none yet (see ``generate``)."""
    if identity is not None:
        path = identity.expanduser()
        return Identity(path=path, public_key=read_public(path))
    seen: list[str] = []
    for target in targets:
        for candidate in target.identity_files:
            if candidate not in seen:
                seen.append(candidate)
    for candidate in seen:
        path = Path(candidate)
        if path.is_file() and Path(candidate + ".pub").is_file():
            return Identity(path=path, public_key=read_public(path, flag="IdentityFile"))
    return None


def default_path() -> Path:
    return Path(ssh_home()) / ".ssh" / "id_ed25519"


def generate(path: Path, confirm: Callable[[Path], bool]) -> Identity:
    """Make a new ed25519 key at ``path`` if ``confirm(path)`` agrees."""
    if path.exists():
        return Identity(path=path, public_key=read_public(path))
    if not confirm(path):
        raise UsageError(
            "this machine has no SSH key to install on the nodes",
            hint=f"let corral create {path} (answer yes, or pass --yes), "
            "or name one with --identity FILE",
        )
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    proc = subprocess.run(
        [
            "ssh-keygen",
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-C",
            f"{os.environ.get('USER', 'corral')}@corral-head",
            "-f",
            str(path),
        ],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise UsageError(
            f"ssh-keygen could not create {path}: {(proc.stderr or proc.stdout).strip()}"
        )
    return Identity(path=path, public_key=read_public(path), generated=True)
