"""Trust for a ``corral.toml`` that corral found by itself, the way direnv asks.

A ``corral.toml`` in the current directory is read without being named, so
it may come from a ``git clone`` rather than from the user.  Most of it only
says where to connect, but some keys make *this* machine run a command: ssh
options such as ``ProxyCommand`` (run locally before connecting), an
``ssh_config`` file (``Match exec``, ``ProxyCommand``...), and the
interpreter of a host that is this machine.  Such a file is refused, with
those exact lines, until the user trusts it once (``corral hosts --trust``).

Trust is remembered as the file's resolved path and the sha256 of its bytes
in ``$XDG_CONFIG_HOME/corral/trusted`` (``~/.config/corral/trusted``), a
0600 file replaced atomically: an edited file needs trust again.  A file
named with ``-c`` or ``$CORRAL_CLUSTER`` is the user's own choice and is not
asked about.
"""

from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from corral.errors import UsageError

#: ssh options that make the ssh client on this machine run a program or load
#: a library (lower case, as ssh compares them).
COMMAND_OPTIONS = frozenset({
    "proxycommand", "localcommand", "permitlocalcommand", "knownhostscommand",
    "pkcs11provider", "securitykeyprovider", "xauthlocation", "match", "include",
})
#: The command that records trust (named in every refusal).
TRUST_COMMAND = "corral hosts --trust"
_MAX_ENTRIES = 10_000


@dataclass(frozen=True, kw_only=True)
class Risk:
    """One line of a cluster file that runs something on this machine."""

    line: int | None
    why: str


def store_path() -> Path:
    """Where trusted files are remembered (XDG_CONFIG_HOME aware)."""
    base = os.environ.get("XDG_CONFIG_HOME") or ""
    root = Path(base) if os.path.isabs(base) else Path.home() / ".config"
    return root / "corral" / "trusted"


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def is_trusted(path: Path, data: bytes) -> bool:
    return (digest(data), str(path.resolve())) in _entries()


def require(path: Path, data: bytes, risks: Sequence[Risk], *, label: str) -> None:
    """Raise a ``UsageError`` quoting the risky lines unless ``path`` as it is now is trusted."""
    if not risks or is_trusted(path, data):
        return
    text = data.decode("utf-8", "replace").splitlines()
    shown = []
    for risk in risks:
        if risk.line is not None and 0 < risk.line <= len(text):
            shown.append(f"  {label}:{risk.line}: {text[risk.line - 1].strip()[:200]}")
        shown.append(f"      ({risk.why})")
    raise UsageError(
        f"{label} was found in the current directory (not named with -c) and makes this "
        "machine run commands:\n" + "\n".join(shown),
        hint=f"read those lines; if you trust them, run `{TRUST_COMMAND}` once here (an edited "
        f"file needs it again), or name the file yourself: -c {label}",
    )


def trust(path: Path, data: bytes) -> Path:
    """Remember ``path`` with the sha256 of ``data`` (its current bytes); the store's path."""
    where = str(path.resolve())
    kept = [(h, p) for h, p in _entries() if p != where][-(_MAX_ENTRIES - 1):]
    kept.append((digest(data), where))
    store = store_path()
    store.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".trusted.", dir=store.parent)  # 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("# corral: cluster files trusted to run commands here (sha256 path)\n")
            fh.writelines(f"{h} {p}\n" for h, p in kept)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, store)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return store


def _entries() -> list[tuple[str, str]]:
    """(sha256, path) pairs; a store that is not a private regular file of ours counts as empty."""
    store = store_path()
    try:
        fd = os.open(store, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return []
    with os.fdopen(fd, "rb") as fh:
        info = os.fstat(fh.fileno())
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid()
                or info.st_mode & 0o022 or info.st_size > 4 << 20):
            return []
        lines = fh.read().decode("utf-8", "replace").splitlines()
    out = []
    for line in lines:
        sha, _, where = line.partition(" ")
        if len(sha) == 64 and where.startswith("/"):
            out.append((sha, where))
    return out
