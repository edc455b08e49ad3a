"""A Slurm batch script read the way bash and sbatch read it, without running it.

``corral check`` needs to know, for each command of the script, which shell
expands each ``$VARIABLE``: the batch shell (once, on the first node, before
``srun`` starts any task) or a shell started per task (inside single quotes
of ``srun bash -c '...'``, after an escaping backslash, in a heredoc whose
delimiter is quoted).  That is a question about quoting, so this module
scans the text character by character as bash does (quotes, backslashes,
``$(...)``, comments, line continuations, heredocs) and cuts it into simple
commands, each with its first line number.  The ``#SBATCH`` directives are
read as sbatch reads them: only before the first command.

It is a reader for checking, not a shell: what it cannot follow (``eval``,
functions called through ``srun``, arrays) it leaves alone, so the checks
err towards silence.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

#: ``$NAME`` or ``${NAME...}`` at a position.
_VAR = re.compile(r"\$(?:\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)[^}]*\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))")
_HEREDOC = re.compile(r"<<(-?)\s*(?P<q>['\"]?)(?P<delim>[A-Za-z_][A-Za-z0-9_]*)(?P=q)")
_ASSIGN = re.compile(r"^(?:(?:export|declare\s+-x|local|readonly)\s+)?(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<value>.*)$",
                     re.S)


@dataclass(frozen=True, kw_only=True)
class Expansion:
    """One ``$NAME`` in the text and who expands it."""

    name: str
    line: int
    #: True: the batch shell expands it (unquoted or in double quotes, no
    #: backslash before it); False: it reaches the command as written.
    early: bool


@dataclass(frozen=True, kw_only=True)
class Command:
    """A simple command of the script (``a; b && c | d`` are four)."""

    line: int
    text: str  # as written, comments removed
    words: tuple[str, ...]  # shlex-split (quotes removed); () when it cannot be split
    expansions: tuple[Expansion, ...]
    #: Started in the background (``cmd &``).
    background: bool = False
    #: A line of a heredoc's body whose delimiter is unquoted.
    heredoc: bool = False
    #: Offsets in ``text`` where a new physical line starts (for ``line_of``).
    breaks: tuple[int, ...] = ()

    def line_of(self, needle: str) -> int:
        """The physical line where ``needle`` first appears in the command."""
        at = self.text.find(needle)
        return self.line if at < 0 else self.line + sum(1 for b in self.breaks if b <= at)


@dataclass(frozen=True, kw_only=True)
class Directive:
    """One ``#SBATCH`` option, in long form (``-N 2`` is ``nodes`` = ``2``)."""

    line: int
    name: str
    value: str | None


@dataclass(frozen=True, kw_only=True)
class BatchScript:
    """What a batch script holds, in order."""

    path: str
    directives: tuple[Directive, ...]
    commands: tuple[Command, ...]
    #: Lines of heredoc bodies the batch shell expands: (line, text).
    heredoc_lines: tuple[Command, ...] = field(default=())

    def option(self, *names: str) -> Directive | None:
        """The last ``#SBATCH`` directive of any of ``names`` (the last wins, as in sbatch)."""
        found = [d for d in self.directives if d.name in names]
        return found[-1] if found else None


#: sbatch's short options and the long ones they stand for.
SHORT_OPTIONS = {"N": "nodes", "n": "ntasks", "c": "cpus-per-task", "t": "time", "p": "partition",
                 "J": "job-name", "o": "output", "e": "error", "G": "gpus", "A": "account",
                 "C": "constraint", "w": "nodelist", "x": "exclude", "q": "qos", "D": "chdir",
                 "K": "kill-on-bad-exit", "a": "array", "d": "dependency", "m": "distribution"}
#: Long options whose value is the next word when not given with ``=``.
VALUE_OPTIONS = frozenset({
    "nodes", "ntasks", "cpus-per-task", "time", "partition", "job-name", "output", "error", "gpus",
    "account", "constraint", "nodelist", "exclude", "qos", "chdir", "ntasks-per-node", "gpus-per-node",
    "gpus-per-task", "gres", "mem", "mem-per-cpu", "mem-per-gpu", "cpus-per-gpu", "gpu-bind", "cpu-bind",
    "signal", "distribution", "array", "dependency", "export", "mpi", "het-group", "ntasks-per-gpu",
    "container-image", "container-mounts", "container-workdir", "container-name", "input", "label",
    "time-min", "reservation", "begin", "mail-type", "mail-user", "comment", "wckey", "network",
    "threads-per-core", "cores-per-socket", "sockets-per-node", "hint", "switches", "nice", "priority",
    "gres-flags", "mem-bind", "kill-on-bad-exit", "open-mode", "wait", "slurmd-debug", "unbuffered",
})
#: Short options that take a value.
_SHORT_VALUE = frozenset("NnctpJoeGACwxqDadm")
#: Options whose value is optional (``--kill-on-bad-exit[=0|1]``): never the next word.
_OPTIONAL_VALUE = frozenset({"kill-on-bad-exit", "requeue", "exclusive", "overlap", "unbuffered", "label",
                             "wait", "open-mode"})


def parse_options(words: list[str] | tuple[str, ...]) -> tuple[list[tuple[str, str | None]], int]:
    """sbatch/srun options at the front of ``words`` as (long name, value),
    and the index of the first word that is not an option (the program)."""
    found: list[tuple[str, str | None]] = []
    i = 0
    while i < len(words):
        word = words[i]
        if word == "--":
            return found, i + 1
        if word.startswith("--"):
            name, eq, value = word[2:].partition("=")
            if eq:
                found.append((name, value))
            elif name in VALUE_OPTIONS and name not in _OPTIONAL_VALUE and i + 1 < len(words):
                found.append((name, words[i + 1]))
                i += 1
            else:
                found.append((name, None))
        elif word.startswith("-") and len(word) > 1:
            letter = word[1]
            name = SHORT_OPTIONS.get(letter, letter)
            if letter in _SHORT_VALUE:
                if len(word) > 2:
                    found.append((name, word[2:].lstrip("=")))
                elif i + 1 < len(words):
                    found.append((name, words[i + 1]))
                    i += 1
                else:
                    found.append((name, None))
            else:
                found.append((name, None))
        else:
            return found, i
        i += 1
    return found, i


# --------------------------------------------------------------------------
# the scanner


@dataclass
class _Scan:
    """The scanner's state while it walks the text."""

    number: int = 1
    start: int = 1
    text: list[str] = field(default_factory=list)
    expansions: list[Expansion] = field(default_factory=list)
    commands: list[Command] = field(default_factory=list)
    breaks: list[int] = field(default_factory=list)

    def newline(self, kept: str) -> None:
        self.number += 1
        self.breaks.append(len(self.text))
        self.text.append(kept)


def _split(text: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(text, comments=False, posix=True))
    except ValueError:
        return ()


def _emit(scan: _Scan, background: bool = False) -> None:
    text = "".join(scan.text).strip()
    if text:
        offsets, at = [], 0
        for k, piece in enumerate(scan.text):  # breaks were list indexes; make them text offsets
            if scan.breaks and k in scan.breaks:
                offsets.append(at)
            at += len(piece)
        scan.commands.append(Command(line=scan.start, text=text, words=_split(text),
                                     expansions=tuple(scan.expansions), background=background,
                                     breaks=tuple(offsets)))
    scan.text, scan.expansions, scan.breaks = [], [], []


def scan_commands(source: str, first_line: int = 1, *, per_task: bool = False) -> list[Command]:
    """The simple commands of shell ``source`` (no heredoc bodies: see
    :func:`read_script`).  ``per_task``: the text is run by a shell of its
    own (the string of ``bash -c``), so no expansion in it is early."""
    scan = _Scan(number=first_line, start=first_line)
    single = False
    nest: list[str] = []  # open double quotes ('"') and parentheses ('(': $(...), $((...)), (...))
    i, n = 0, len(source)
    while i < n:
        ch = source[i]
        double = bool(nest) and nest[-1] == '"'
        if not scan.text and ch in " \t":
            i += 1
            continue
        if not scan.text and not single and not nest:
            scan.start = scan.number
        if ch == "\n":
            if single or nest:
                scan.newline(ch)
            else:
                scan.number += 1
                _emit(scan)
            i += 1
            continue
        if single:
            scan.text.append(ch)
            single = ch != "'"
            if ch == "$":
                _note_var(scan, source, i, early=False)
            i += 1
            continue
        if ch == "\\" and i + 1 < n:
            if source[i + 1] == "\n":  # a line continuation
                scan.newline(" ")
            else:
                scan.text.append(source[i:i + 2])
            i += 2
            continue
        if ch == '"':
            if double:
                nest.pop()
            else:
                nest.append('"')
        elif ch == "'" and not double:
            single = True
        elif ch == "$":
            if source.startswith("$(", i):
                nest.append("(")
                scan.text.append("$(")
                i += 2
                continue
            _note_var(scan, source, i, early=not per_task)
        elif ch == "(" and not double:
            nest.append("(")
        elif ch == ")" and not double:
            if nest:
                nest.pop()
        elif ch == "#" and not nest and (not scan.text or scan.text[-1] in " \t;|&("):
            while i < n and source[i] != "\n":
                i += 1
            continue
        elif not nest and ch in ";|&":
            prev, nxt = source[i - 1:i], source[i + 1:i + 2]
            if (ch == "&" and (prev in ("<", ">") and prev or nxt == ">")) or (ch == "|" and prev == ">"):
                scan.text.append(ch)  # >&2, &>file, >|file: redirections, not separators
                i += 1
                continue
            two = ch in "|&" and nxt == ch  # && and ||
            _emit(scan, background=ch == "&" and not two)
            i += 2 if two else 1
            continue
        scan.text.append(ch)
        i += 1
    _emit(scan)
    return scan.commands


def _note_var(scan: _Scan, source: str, i: int, *, early: bool) -> None:
    m = _VAR.match(source, i)
    if m:
        scan.expansions.append(Expansion(name=m.group("braced") or m.group("plain"), line=scan.number,
                                         early=early))


def _cut_heredocs(source: str) -> tuple[str, list[Command]]:
    """The script with heredoc bodies blanked out (their line numbers kept),
    and the body lines the batch shell expands (unquoted delimiter) as commands
    of their own, so their ``$VARIABLES`` count as early."""
    lines = source.split("\n")
    kept: list[str] = []
    bodies: list[Command] = []
    pending: list[tuple[str, bool, bool]] = []  # (delimiter, strip tabs, expands)
    for number, line in enumerate(lines, start=1):
        if pending:
            delim, strip, expands = pending[0]
            if (line.lstrip("\t") if strip else line) == delim:
                pending.pop(0)
            elif expands:
                body = scan_commands(line, number)
                bodies.extend(Command(line=c.line, text=c.text, words=c.words, expansions=c.expansions,
                                      heredoc=True) for c in body)
            kept.append("")
            continue
        kept.append(line)
        code = line.split(" #", 1)[0] if not line.lstrip().startswith("#") else ""
        for m in _HEREDOC.finditer(code):
            if code[:m.start()].count("'") % 2 == 0:
                pending.append((m.group("delim"), m.group(1) == "-", not m.group("q")))
    return "\n".join(kept), bodies


def read_directives(source: str) -> list[Directive]:
    """The ``#SBATCH`` options, read as sbatch reads them: from the top, up to
    the first line that is neither blank nor a comment."""
    found: list[Directive] = []
    for number, line in enumerate(source.split("\n"), start=1):
        stripped = line.strip()
        if number == 1 and stripped.startswith("#!"):
            continue
        if stripped and not stripped.startswith("#"):
            break
        if not stripped.startswith("#SBATCH"):
            continue
        words = _split(stripped[len("#SBATCH"):].split(" #", 1)[0])
        options, _ = parse_options(words)
        found.extend(Directive(line=number, name=name, value=value) for name, value in options)
    return found


def read_script(source: str, path: str = "job.sbatch") -> BatchScript:
    """The whole batch script: directives, commands, expanding heredoc lines."""
    code, bodies = _cut_heredocs(source)
    return BatchScript(path=path, directives=tuple(read_directives(source)),
                       commands=tuple(scan_commands(code)), heredoc_lines=tuple(bodies))


# --------------------------------------------------------------------------
# variables


def assignment(command: Command) -> tuple[str, str] | None:
    """``NAME=value`` / ``export NAME=value``: (name, the value as written)."""
    m = _ASSIGN.match(command.text)
    if not m or " " in m.group("value").strip() and not m.group("value").strip()[:1] in "\"'$":
        return None
    return m.group("name"), m.group("value").strip()


def unquote(value: str) -> str:
    words = _split(value)
    return words[0] if len(words) == 1 else value


def expand(word: str, values: dict[str, str]) -> str:
    """``word`` with ``$NAME`` / ``${NAME}`` / ``${NAME:-x}`` replaced by what
    ``values`` knows (unknown names stay as written)."""
    def sub(m: re.Match[str]) -> str:
        name = m.group("braced") or m.group("plain")
        if name in values:
            return values[name]
        default = re.match(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", m.group(0))
        return default.group(1) if default else m.group(0)

    return _VAR.sub(sub, word)


def as_int(word: str | None) -> int | None:
    if word is None:
        return None
    word = word.strip()
    return int(word) if word.isdigit() else None
