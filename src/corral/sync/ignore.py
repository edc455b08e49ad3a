"""gitignore-syntax patterns, for ``.corralignore``, corral's defaults, and
``.gitignore`` files outside git repositories.

Inside a git repository git itself decides what it ignores (``git ls-files
--exclude-standard``, ``git check-ignore``); this module covers the rest with
the same rules as gitignore(5):

- blank lines and ``#`` comments are skipped; ``\\#`` and ``\\!`` escape;
- ``!pattern`` re-includes what an earlier pattern excluded (the last match
  wins), but never a file inside an excluded directory;
- a trailing ``/`` matches directories only;
- a pattern with a ``/`` at its start or middle is anchored to the directory
  of the file that holds it; otherwise it matches at any depth;
- ``*`` and ``?`` never match ``/``; ``**/``, ``/**/`` and ``/**`` span
  directories; ``[a-z]`` / ``[!a-z]`` are character classes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Rule:
    pattern: str
    regex: re.Pattern[str]
    negate: bool
    dir_only: bool
    #: Directory (relative, '' for the root) of the file the rule came from.
    base: str
    origin: str = ""

    def matches(self, path: str, is_dir: bool) -> bool:
        if self.dir_only and not is_dir:
            return False
        if self.base:
            if not path.startswith(self.base + "/"):
                return False
            path = path[len(self.base) + 1 :]
        return self.regex.match(path) is not None


def _translate(glob: str) -> str:
    """Regex body for one gitignore glob (without anchoring)."""
    out: list[str] = []
    i, n = 0, len(glob)
    while i < n:
        c = glob[i]
        if glob.startswith("**/", i) and (i == 0 or glob[i - 1] == "/"):
            out.append("(?:.*/)?")
            i += 3
            continue
        if glob.startswith("**", i) and i + 2 == n and i > 0 and glob[i - 1] == "/":
            out.append(".*")
            i += 2
            continue
        if c == "*":
            while i < n and glob[i] == "*":
                i += 1
            out.append("[^/]*")
            continue
        if c == "?":
            out.append("[^/]")
        elif c == "[":
            j = glob.find("]", i + 2 if glob[i + 1 : i + 2] in ("!", "^", "]") else i + 1)
            if j < 0:
                out.append(re.escape(c))
            else:
                body = glob[i + 1 : j]
                if body[:1] in ("!", "^"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = j
        elif c == "\\" and i + 1 < n:
            i += 1
            out.append(re.escape(glob[i]))
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def parse_line(line: str, *, base: str = "", origin: str = "") -> Rule | None:
    """One gitignore line as a ``Rule`` (None for blanks and comments)."""
    text = line.rstrip("\n").rstrip("\r")
    # Trailing spaces are dropped unless escaped with a backslash.
    stripped = text.rstrip(" ")
    if stripped.endswith("\\") and len(stripped) < len(text):
        stripped += " "
    text = stripped
    if not text or text.startswith("#"):
        return None
    negate = text.startswith("!")
    if negate or text.startswith(("\\!", "\\#")):
        text = text[1:]
    dir_only = text.endswith("/")
    text = text.rstrip("/")
    if not text:
        return None
    anchored = "/" in text
    text = text.lstrip("/")
    body = _translate(text)
    regex = re.compile(("^" if anchored else "^(?:.*/)?") + body + "(?:$)")
    return Rule(
        pattern=line.strip(),
        regex=regex,
        negate=negate,
        dir_only=dir_only,
        base=base,
        origin=origin,
    )


def parse(lines: Iterable[str], *, base: str = "", origin: str = "") -> list[Rule]:
    rules = []
    for line in lines:
        rule = parse_line(line, base=base, origin=origin)
        if rule is not None:
            rules.append(rule)
    return rules


class IgnoreRules:
    """An ordered rule list; ``ignored(path, is_dir)`` answers like git would."""

    def __init__(self, rules: Iterable[Rule] = ()):
        self.rules: list[Rule] = list(rules)

    def extend(self, rules: Iterable[Rule]) -> None:
        self.rules.extend(rules)

    def decide(self, path: str, is_dir: bool) -> bool | None:
        """True (ignored), False (re-included) or None (no rule matches), for
        ``path`` alone, assuming its parent directories are not ignored."""
        verdict: bool | None = None
        for rule in self.rules:
            if rule.matches(path, is_dir):
                verdict = not rule.negate
        return verdict

    def ignored(self, path: str, is_dir: bool = False) -> bool:
        """Whether ``path`` (relative, '/'-separated) is ignored, parents included."""
        parts = path.split("/")
        for i in range(1, len(parts)):
            if self.decide("/".join(parts[:i]), True):
                return True
        return bool(self.decide(path, is_dir))
