"""Who may use a sandbox: root, and the one user ``up --for USER`` names.

A sandbox needs root to start, but the person rehearsing a run is often not
root.  ``sudo corral sandbox up 4 --with-keys --for alice`` keeps every file
root-owned and out of alice's reach to change, and lets her read what she
needs: the state directory (group alice, 0750), its cluster file, hostfile,
ssh_config and known_hosts, the state file (0640, for ``status`` and
``list``) and the head key (owned by alice, 0600, as ssh demands).  The
nodes' own directories stay root's (0700).

The state directory of such a sandbox defaults to
``/var/lib/corral/sandbox/<name>``: a place only root can write, so root
never writes through a path alice could swap for a symlink (a directory in
her home would be one).  Its /etc/hosts block records where it is, so her
commands find it without ``--state-dir``.

With ``--with-keys`` alice logs in to the nodes as root, and the nodes share
this machine's filesystem: ``--for`` is for a user you would give root.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from pathlib import Path

from corral.errors import SandboxError, UsageError

#: Where the state of a sandbox started ``--for`` a user lives by default.
SHARED_BASE = Path("/var/lib/corral/sandbox")


def user(name: str) -> pwd.struct_passwd:
    """The account ``--for`` names; a clear error when there is none."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise UsageError(f"--for {name}: no such user on this machine",
                         hint="name an existing login, e.g. --for $SUDO_USER") from None
    if entry.pw_uid == 0:
        raise UsageError(f"--for {name}: that is root, who may use every sandbox already",
                         hint="leave out --for")
    return entry


def shared_state_dir(name: str) -> Path:
    """``/var/lib/corral/sandbox/<name>``, its parents made root-owned and 0755."""
    for path in (SHARED_BASE.parent, SHARED_BASE):
        path.mkdir(mode=0o755, exist_ok=True)
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != 0 or st.st_mode & 0o022:
            raise SandboxError(f"{path} is not a root-owned directory that only root can write",
                               hint="remove it, or pass --state-dir DIR (one the user can reach)")
        os.chmod(path, 0o755)
    return SHARED_BASE / name


def check_reachable(state_dir: Path, owner: pwd.struct_passwd) -> None:
    """``owner`` can pass through every existing parent of ``state_dir``."""
    groups = {owner.pw_gid} | {g.gr_gid for g in grp.getgrall() if owner.pw_name in g.gr_mem}
    for parent in reversed(state_dir.parents):
        try:
            st = os.stat(parent)
        except FileNotFoundError:
            continue
        if st.st_uid == owner.pw_uid:
            ok = st.st_mode & stat.S_IXUSR
        elif st.st_gid in groups:
            ok = st.st_mode & stat.S_IXGRP
        else:
            ok = st.st_mode & stat.S_IXOTH
        if not ok:
            raise SandboxError(
                f"{owner.pw_name} cannot reach the sandbox's state directory {state_dir}: "
                f"{parent} is mode {stat.S_IMODE(st.st_mode):04o}",
                hint="leave out --state-dir (a sandbox started --for a user then lives in "
                     f"{SHARED_BASE}/NAME), or `corral sandbox down` this one and "
                     "start it again --for",
            )


def grant(state_dir: Path, owner: pwd.struct_passwd) -> None:
    """Let ``owner`` read the sandbox's files and use its head key; change nothing else."""
    os.chown(state_dir, 0, owner.pw_gid)
    os.chmod(state_dir, 0o750)
    for name in ("corral.toml", "hostfile", "ssh_config", "known_hosts", "id_ed25519.pub"):
        path = state_dir / name
        if path.exists():
            os.chmod(path, 0o644)
    key = state_dir / "id_ed25519"
    if key.exists():
        os.chown(key, owner.pw_uid, owner.pw_gid)
        os.chmod(key, 0o600)


def state_file_mode(owner_name: str | None) -> tuple[int, int | None]:
    """The state file's mode and group: readable by the ``--for`` user's group."""
    if not owner_name:
        return 0o600, None
    try:
        return 0o640, pwd.getpwnam(owner_name).pw_gid
    except KeyError:  # the account was removed since: keep the state root's alone
        return 0o600, None
