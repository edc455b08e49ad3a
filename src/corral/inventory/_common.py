"""Validation shared by every inventory reader.

Each reader (hostfile, ``-H``, corral.toml, Slurm) turns its own syntax into
``Host`` objects through these helpers, so a host name, a slot count or a
duplicate is judged the same way -- and reported with the same words --
whichever format it came from.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterable
from pathlib import Path

from corral.errors import InventoryError
from corral.hostrange import MAX_HOSTS, HostRangeError, expand
from corral.model import DEFAULT_PYTHON, Host
from corral.names import HOST_NAME_RULE, USER_NAME_RULE, is_address, is_user_name

#: Names that mean "this machine": reached without ssh unless a port, user or
#: address says otherwise (a container's sshd on localhost:2222 is remote).
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})

#: Largest cluster file read: 65,536 hosts with their keys fit in a few MiB.
MAX_FILE_BYTES = 8 << 20
#: Most processes on one host (``slots``): beyond any machine, small enough to plan.
MAX_SLOTS = 4096

# Names, addresses and users follow corral.names (one grammar for the
# inventory and for what nodes report in `ssh setup`); fullmatch everywhere,
# since `$` would accept a trailing newline.
_ENV_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Key=Value on one line: a newline would start another ssh_config directive.
_SSH_OPTION = re.compile(r"[A-Za-z][A-Za-z0-9]*=[^\s][^\r\n]*")


def expand_names(text: str, *, path: str | None, line: int | None) -> list[str]:
    """Expand a folded host expression, with errors pointing at path:line."""
    try:
        names = expand(text)
    except HostRangeError as err:
        raise InventoryError(
            f"malformed host range: {err}",
            path=path,
            line=line,
            hint="ranges look like node[01-04,07]: digits only, low-high, brackets closed",
        ) from None
    for name in names:
        check_name(name, path=path, line=line)
    return names


def check_name(name: str, *, path: str | None, line: int | None) -> None:
    if not is_address(name):
        raise InventoryError(
            f"{_shown(name)} is not a valid host name",
            path=path,
            line=line,
            hint=f"use a host name, an ssh alias or an IP address ({HOST_NAME_RULE})",
        )


def check_address(address: str, *, what: str, path: str | None, line: int | None) -> str:
    """An ``address`` from a cluster file: it becomes ``ssh -o HostName=``."""
    if not is_address(address):
        raise InventoryError(
            f"{what} {_shown(address)} is not a host name or an IP address",
            path=path,
            line=line,
            hint=f"give a DNS name or an IP address ({HOST_NAME_RULE})",
        )
    return address


def check_user(user: str, *, path: str | None, line: int | None) -> str:
    if not is_user_name(user):
        raise InventoryError(
            f"{_shown(user)} is not a valid user name", path=path, line=line,
            hint=f"a login name: {USER_NAME_RULE}",
        )
    return user


def _shown(text: str, limit: int = 80) -> str:
    """``text`` quoted for a message, cut when long (a megabyte name stays one line)."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text)} characters)"


def positive_int(
    value: str, *, what: str, path: str | None, line: int | None, most: int | None = None
) -> int:
    """Parse a count written as text (``slots=8``); 0, negatives, '8.0' and
    numbers over ``most`` fail (a 5,000-digit one too, without converting it)."""
    if not value.isascii() or not value.isdigit() or len(value) > 100 or int(value) <= 0:
        raise InventoryError(
            f"{what} must be a positive integer, got {_shown(value)}", path=path, line=line
        )
    return at_most(int(value), most, what=what, path=path, line=line)


def at_most(value: int, most: int | None, *, what: str, path: str | None, line: int | None) -> int:
    if most is not None and value > most:
        raise InventoryError(
            f"{what} must be at most {most}, got {_shown(str(value))}", path=path, line=line,
            hint="slots is the number of processes on the host (one per GPU, usually 8 or fewer)"
            if "slots" in what else None,
        )
    return value


def port_number(value: int, *, what: str, path: str | None, line: int | None) -> int:
    if not 1 <= value <= 65535:
        raise InventoryError(
            f"{what} must be between 1 and 65535, got {value}", path=path, line=line
        )
    return value


def check_env_key(key: str, *, what: str, path: str | None, line: int | None) -> str:
    if not _ENV_KEY.fullmatch(key):
        raise InventoryError(
            f"{what}: {key!r} is not a valid environment variable name", path=path, line=line
        )
    return key


def check_ssh_option(option: str, *, what: str, path: str | None, line: int | None) -> str:
    if not _SSH_OPTION.fullmatch(option):
        raise InventoryError(
            f"{what}: {_shown(option)} is not an ssh option",
            path=path,
            line=line,
            hint="write ssh options as Key=Value, as for ssh -o (e.g. IdentityFile=~/.ssh/lab)",
        )
    return option


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """A hint naming the closest valid word, or listing them all."""
    import difflib  # only on this error path

    choices = sorted(choices)
    close = difflib.get_close_matches(word, choices, n=1)
    if close:
        return f"did you mean {close[0]!r}?"
    return "valid keys: " + ", ".join(choices)


class DuplicateCheck:
    """Remembers where each host was defined, to report both places."""

    def __init__(self, path: str | None):
        self.path = path
        self.lines: dict[str, int | None] = {}

    def add(self, name: str, line: int | None) -> None:
        if len(self.lines) >= MAX_HOSTS:
            raise InventoryError(
                f"more than {MAX_HOSTS} hosts", path=self.path, line=line,
                hint="corral drives at most 65,536 hosts (as a folded range does); "
                "check that this is the right file",
            )
        if name in self.lines:
            first = self.lines[name]
            where = f" (first defined on line {first})" if first is not None else " (listed twice)"
            raise InventoryError(
                f"duplicate host {name!r}{where}",
                path=self.path,
                line=line,
                hint="list each host once; for several sshd ports on one machine give each "
                "entry its own name and set its address",
            )
        self.lines[name] = line


def make_host(
    name: str,
    *,
    address: str | None = None,
    port: int | None = None,
    user: str | None = None,
    slots: int | None = None,
    labels: tuple[str, ...] = (),
    python: str | None = None,
    env: dict[str, str] | None = None,
    workdir: str | None = None,
    ssh_options: tuple[str, ...] = (),
) -> Host:
    """Build a Host; ``localhost`` with no port/user/address is this machine."""
    local = name in LOCAL_NAMES and port is None and user is None and address is None
    return Host(
        name=name,
        address=address,
        port=port,
        user=user,
        slots=slots,
        labels=labels,
        python=python or DEFAULT_PYTHON,
        env=dict(env or {}),
        workdir=workdir,
        local=local,
        ssh_options=ssh_options,
    )


def display_path(path: Path, cwd: Path | None = None) -> str:
    """The path as the user would type it: relative to cwd when inside it."""
    if cwd is not None:
        try:
            return os.path.relpath(path, cwd) if path.is_relative_to(cwd) else str(path)
        except ValueError:
            return str(path)
    return str(path)


def read_text(path: Path, *, label: str, what: str) -> str:
    """Read a cluster file as text (newlines normalised as ``open()`` would)."""
    return decode_text(read_bytes(path, label=label, what=what), label=label, what=what)


def decode_text(data: bytes, *, label: str, what: str) -> str:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise InventoryError(f"{what} is not UTF-8 text ({err.reason})", path=label) from None
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_bytes(path: Path, *, label: str, what: str) -> bytes:
    """A cluster file's bytes: a regular file of at most ``MAX_FILE_BYTES``.

    ``-c /dev/zero`` would fill the memory, and a FIFO or ``/dev/urandom``
    would never end; both are refused before a byte is read.  The file is
    opened without blocking and checked again through the open descriptor,
    so what is read is what was checked.
    """
    try:
        info = os.stat(path)
        if stat.S_ISDIR(info.st_mode):
            raise _directory_error(path, label=label, what=what)
        _check_regular(info, label=label, what=what)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InventoryError(
            f"{what} not found",
            path=label,
            hint="check the path; -c/--cluster takes a hostfile or a corral.toml",
        ) from None
    except OSError as err:
        raise InventoryError(f"cannot read {what}: {err.strerror}", path=label) from None
    try:  # the path may have been swapped since the stat: check what was opened
        _check_regular(os.fstat(fd), label=label, what=what)
    except InventoryError:
        os.close(fd)
        raise
    with open(fd, "rb") as fh:
        try:
            data = fh.read(MAX_FILE_BYTES + 1)
        except OSError as err:
            raise InventoryError(f"cannot read {what}: {err.strerror}", path=label) from None
    if len(data) > MAX_FILE_BYTES:
        raise _too_big(label, what)
    return data


def _check_regular(info: os.stat_result, *, label: str, what: str) -> None:
    if not stat.S_ISREG(info.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(info.st_mode) else (
            "a device" if stat.S_ISCHR(info.st_mode) or stat.S_ISBLK(info.st_mode)
            else "not a regular file")
        raise InventoryError(
            f"{what} is {kind}, not a regular file", path=label,
            hint="give the path of a hostfile or corral.toml on disk "
            "(process substitution and devices are not read)",
        )
    if info.st_size > MAX_FILE_BYTES:
        raise _too_big(label, what)


def _too_big(label: str, what: str) -> InventoryError:
    return InventoryError(
        f"{what} is larger than {MAX_FILE_BYTES // (1 << 20)} MiB", path=label,
        hint=f"a cluster file describes at most {MAX_HOSTS} hosts; "
        "check that this is the right file",
    )


def _directory_error(path: Path, *, label: str, what: str) -> InventoryError:
    inside = [n for n in ("corral.toml", "hostfile") if (path / n).is_file()]
    return InventoryError(
        f"{what} is a directory, not a file", path=str(path) if label in ("", ".") else label,
        hint=f"-c/--cluster takes the file itself, e.g. -c {path / inside[0]}" if inside
        else "-c/--cluster takes a hostfile or a corral.toml, not a directory",
    )
