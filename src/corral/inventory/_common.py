"""Validation shared by every inventory reader.

Each reader (hostfile, ``-H``, corral.toml, Slurm) turns its own syntax into
``Host`` objects through these helpers, so a host name, a slot count or a
duplicate is judged the same way -- and reported with the same words --
whichever format it came from.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from corral.errors import InventoryError
from corral.hostrange import HostRangeError, expand
from corral.model import DEFAULT_PYTHON, Host

#: Names that mean "this machine": reached without ssh unless a port, user or
#: address says otherwise (a container's sshd on localhost:2222 is remote).
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})

# A host name, ssh alias or IP address.  No leading '-': ssh would read the
# name as an option.  ':' and '%' allow IPv6 literals in hostfiles.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:%-]*$")
_USER = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*\$?$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_SSH_OPTION = re.compile(r"^[A-Za-z][A-Za-z0-9]*=\S.*$")


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
    if not _NAME.match(name):
        raise InventoryError(
            f"{name!r} is not a valid host name",
            path=path,
            line=line,
            hint="use a host name, an ssh alias or an IP address (letters, digits, '.', '-', '_')",
        )


def check_user(user: str, *, path: str | None, line: int | None) -> str:
    if not _USER.match(user):
        raise InventoryError(f"{user!r} is not a valid user name", path=path, line=line)
    return user


def positive_int(value: str, *, what: str, path: str | None, line: int | None) -> int:
    """Parse a count written as text (``slots=8``); 0, negatives and '8.0' fail."""
    if not value.isascii() or not value.isdigit() or int(value) <= 0:
        raise InventoryError(
            f"{what} must be a positive integer, got {value!r}", path=path, line=line
        )
    return int(value)


def port_number(value: int, *, what: str, path: str | None, line: int | None) -> int:
    if not 1 <= value <= 65535:
        raise InventoryError(
            f"{what} must be between 1 and 65535, got {value}", path=path, line=line
        )
    return value


def check_env_key(key: str, *, what: str, path: str | None, line: int | None) -> str:
    if not _ENV_KEY.match(key):
        raise InventoryError(
            f"{what}: {key!r} is not a valid environment variable name", path=path, line=line
        )
    return key


def check_ssh_option(option: str, *, what: str, path: str | None, line: int | None) -> str:
    if not _SSH_OPTION.match(option):
        raise InventoryError(
            f"{what}: {option!r} is not an ssh option",
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
    """Read a cluster file, turning OS errors into InventoryError."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InventoryError(
            f"{what} not found",
            path=label,
            hint="check the path; -c/--cluster takes a hostfile or a corral.toml",
        ) from None
    except IsADirectoryError:
        inside = [n for n in ("corral.toml", "hostfile") if (path / n).is_file()]
        raise InventoryError(
            f"{what} is a directory, not a file", path=str(path) if label in ("", ".") else label,
            hint=f"-c/--cluster takes the file itself, e.g. -c {path / inside[0]}" if inside
            else "-c/--cluster takes a hostfile or a corral.toml, not a directory",
        ) from None
    except UnicodeDecodeError as err:
        raise InventoryError(f"{what} is not UTF-8 text ({err.reason})", path=label) from None
    except OSError as err:
        raise InventoryError(f"cannot read {what}: {err.strerror}", path=label) from None
