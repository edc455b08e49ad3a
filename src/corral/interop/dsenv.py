"""``.deepspeed_env``: the variables DeepSpeed's runner exports to every node.

The ``deepspeed`` command (deepspeed/launcher/runner.py, 0.19) reads
``$DS_ENV_FILE`` (default ``.deepspeed_env``) from the home directory, then
from the current directory, on the machine it is started on; every line is
``NAME=VALUE``, split at the first ``=``, both sides stripped.  Its pdsh
command then starts each node with ``export NAME=VALUE;`` for each variable,
in the order first read, the later file's value winning.  A value with a
character outside ``[A-Za-z0-9_@%+=:,./-]`` is put in double quotes
(multinode_runner.py, ``add_export``), so the node's shell expands
``$LD_LIBRARY_PATH`` and ``${HOME}`` there, removes quotes, and keeps
spaces.

corral's deepspeed launcher starts ``deepspeed.launcher.launch`` itself,
without that runner, so it applies the file here: the same files, the same
lines, the same quoting.  Values the shell would take literally travel as
they are; a value that names the node's variables (``$NAME``, ``${NAME}``)
travels as its parts and the node's agent fills them in from its own
environment, as the shell would.  What a shell would do beyond that
(command substitution, globbing, splitting a value into two words) is
refused with the line, since corral starts no shell to do it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from corral.errors import ForeignConfigError

#: The name of the file, unless ``DS_ENV_FILE`` names another (runner.py).
DEFAULT_NAME = ".deepspeed_env"
#: A value with any other character is double-quoted by DeepSpeed's ``add_export``.
_SAFE = re.compile(r"[\w@%+=:,./-]*")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
#: Larger than any environment file; a bigger one is not one.
MAX_BYTES = 1 << 20

#: One part of a value: ("lit", text) or ("var", NAME), the node's value of NAME.
Part = tuple[str, str]


@dataclass(frozen=True, kw_only=True)
class DsValue:
    """One variable of the file, as the node's shell would see ``export NAME=VALUE``."""

    name: str
    #: The value as written (stripped).
    raw: str
    #: Literal text and the node's variables, in order.
    parts: tuple[Part, ...]
    #: ``file:line`` it comes from (the last file that sets it).
    source: str

    @property
    def literal(self) -> str | None:
        """The value, when it names none of the node's variables."""
        if all(kind == "lit" for kind, _ in self.parts):
            return "".join(text for _, text in self.parts)
        return None

    def shown(self) -> str:
        """How ``--dry-run`` shows it: ``/opt/x:$LD_LIBRARY_PATH`` (filled in on the node)."""
        return "".join(text if kind == "lit" else "${%s}" % text for kind, text in self.parts)


@dataclass(frozen=True, kw_only=True)
class DsEnv:
    """Every file read, and the variables in DeepSpeed's order."""

    files: tuple[str, ...]
    values: tuple[DsValue, ...]

    def __bool__(self) -> bool:
        return bool(self.values)

    def summary(self) -> str:
        """The one line a run prints about it."""
        names = ", ".join(v.name for v in self.values)
        return (f"applying {' and '.join(self.files)} to every node, as DeepSpeed's runner does: {names} "
                "(a cluster file's env and --env win; docs/interop.md)")


def env_files(environ: Mapping[str, str], home: Path, cwd: Path) -> list[Path]:
    """The files DeepSpeed's runner reads, in its order: ``~/NAME`` then ``./NAME``.

    ``DS_ENV_FILE`` replaces the name; an absolute one is the same file both
    times (read once here: reading it twice changes nothing)."""
    name = environ.get("DS_ENV_FILE") or DEFAULT_NAME
    out: list[Path] = []
    for base in (home, cwd):
        path = base / Path(name).expanduser()
        if path.is_file() and not any(_same(path, p) for p in out):
            out.append(path)
    return out


def _same(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False


def load(environ: Mapping[str, str], home: Path, cwd: Path) -> DsEnv:
    """The variables DeepSpeed's runner would export, from every file it reads."""
    values: dict[str, DsValue] = {}
    files = []
    for path in env_files(environ, home, cwd):
        shown = _label(path, home, cwd)
        files.append(shown)
        for value in parse(_read(path, shown), shown):
            # a dict, as DeepSpeed's: a later file's value, the first file's place
            values[value.name] = value
    return DsEnv(files=tuple(files), values=tuple(values.values()))


def _label(path: Path, home: Path, cwd: Path) -> str:
    for base, prefix in ((cwd, "./"), (home, "~/")):
        try:
            return prefix + str(path.relative_to(base))
        except ValueError:
            continue
    return str(path)


def _read(path: Path, shown: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError as e:
        raise ForeignConfigError(f"cannot read it ({e.strerror})", path=shown,
                                 hint="make it readable, or remove it") from None
    if len(data) > MAX_BYTES or b"\0" in data:
        raise ForeignConfigError("is not a NAME=VALUE environment file (too large, or binary)", path=shown,
                                 hint="DeepSpeed reads it as text lines NAME=VALUE; remove it or point "
                                      "DS_ENV_FILE elsewhere")
    return data.decode("utf-8", errors="replace")


def parse(text: str, path: str) -> list[DsValue]:
    """The lines of one file.  Blank lines and ``#`` comments are skipped
    (DeepSpeed's runner stops with a ValueError on a blank line, and a ``#``
    line ends its pdsh command; neither is a setting)."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not sep or not _NAME.fullmatch(key):
            hint = "write NAME=VALUE, one a line"
            if key.startswith("export "):
                hint += " (without `export`: DeepSpeed's runner adds it)"
            raise ForeignConfigError(f"{line.strip()[:80]!r} is not NAME=VALUE", path=path, line=number,
                                     hint=hint)
        out.append(DsValue(name=key, raw=value, parts=shell_parts(value, path=path, line=number, name=key),
                           source=f"{path}:{number}"))
    return out


def shell_parts(value: str, *, path: str, line: int, name: str) -> tuple[Part, ...]:
    """What ``export NAME=<value as DeepSpeed quotes it>`` gives in the node's shell."""
    if _SAFE.fullmatch(value):
        return (("lit", value),)  # DeepSpeed leaves it unquoted; nothing in it is special
    return _Word(f'"{value}"', path=path, line=line, name=name).parts()


#: Outside quotes these make the shell do more than take the text.
_UNQUOTED_SPECIAL = set(" \t;&|<>()*?[~`")


class _Word:
    """A reader for one shell word of quoted text and ``$NAME`` / ``${NAME}``."""

    def __init__(self, word: str, *, path: str, line: int, name: str):
        self.word, self.path, self.line, self.name = word, path, line, name
        self.out: list[Part] = []

    def refuse(self, what: str) -> ForeignConfigError:
        raw = self.word[1:-1]
        hint = "write the value itself; $NAME and ${NAME} of the node's variables are filled in"
        if len(raw) > 1 and raw[0] == raw[-1] and raw[0] in "\"'":
            hint = f"write {self.name}={raw[1:-1]} (no quotes: DeepSpeed's runner quotes the value itself)"
        return ForeignConfigError(
            f"{self.name}: the node's shell would {what} (DeepSpeed's runner sends "
            f"`export {self.name}={self.word}`); corral starts no shell for it",
            path=self.path, line=self.line, hint=hint)

    def lit(self, text: str) -> None:
        if self.out and self.out[-1][0] == "lit":
            self.out[-1] = ("lit", self.out[-1][1] + text)
        else:
            self.out.append(("lit", text))

    def parts(self) -> tuple[Part, ...]:
        w, i, quote = self.word, 0, None
        while i < len(w):
            c = w[i]
            if quote == "'":
                if c == "'":
                    quote = None
                else:
                    self.lit(c)
                i += 1
            elif c == "\\":
                i = self.escape(i, quote)
            elif c == "$":
                i = self.dollar(i)
            elif c == "`":
                raise self.refuse("run a command (`...`)")
            elif c == '"':
                quote = None if quote == '"' else '"'
                i += 1
            elif quote is None and c == "'":
                quote = "'"
                i += 1
            elif quote is None and c in _UNQUOTED_SPECIAL:
                raise self.refuse(f"read {c!r} outside quotes as shell syntax (a second word, a pattern, a "
                                  "command separator or a home directory)")
            else:
                self.lit(c)
                i += 1
        if quote is not None:
            raise self.refuse(f"find an unclosed {quote} quote")
        return tuple(self.out) or (("lit", ""),)

    def escape(self, i: int, quote: str | None) -> int:
        nxt = self.word[i + 1] if i + 1 < len(self.word) else ""
        if quote is None:
            self.lit(nxt)
            return i + 2
        if nxt in ('$', '`', '"', '\\'):
            self.lit(nxt)
            return i + 2
        self.lit("\\")
        return i + 1

    def dollar(self, i: int) -> int:
        rest = self.word[i + 1:]
        m = _NAME.match(rest)
        if m:
            self.out.append(("var", m.group(0)))
            return i + 1 + m.end()
        m = re.match(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", rest)
        if m:
            self.out.append(("var", m.group(1)))
            return i + 1 + m.end()
        if rest.startswith("("):
            raise self.refuse("run a command ($(...))")
        if rest.startswith("{") or (rest[:1] and rest[0] in "0123456789@*#?$!-"):
            raise self.refuse(f"expand ${rest[:12]} (only $NAME and ${{NAME}} are filled in)")
        self.lit("$")  # a lone $ is itself
        return i + 1
