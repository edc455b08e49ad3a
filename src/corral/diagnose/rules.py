"""Load and validate the failure-signature knowledge base (``rules.toml``).

The knowledge base is data, not code, so that adding a failure class is a
reviewable edit to one file plus one real log excerpt under
``tests/fixtures/diagnose/``.  Everything that can be wrong with an entry
(unknown keys, a regex that does not compile, a category nobody knows, a fix
template naming a value nothing provides) is caught here, at load time, with
an error that names the entry, instead of surfacing as a wrong diagnosis on
a user's failed run.
"""

from __future__ import annotations

import functools
import re
import string
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from corral.diagnose.checks import CHECKS, Check
from corral.diagnose.facts import PREDICATES
from corral.errors import UsageError

#: Category id -> label shown to users.  The issue's list of failure areas.
CATEGORIES: dict[str, str] = {
    "network": "network/NCCL",
    "rendezvous": "rendezvous",
    "ssh": "SSH",
    "environment": "environment mismatch",
    "memory": "memory",
    "data": "data loading",
    "deepspeed": "DeepSpeed/ZeRO",
    "checkpoint": "checkpointing",
    "launcher": "launcher configuration",
    "gpu": "GPU/CUDA",
    "model": "model/DDP",
    "scheduler": "scheduler (Slurm)",
}

#: Weight of a pattern given as a bare string ("this line names the failure").
STRONG_WEIGHT = 0.8
#: Weight of a ``weak`` pattern: context that raises confidence, never enough alone.
WEAK_WEIGHT = 0.2

#: Template names every refinement may use besides captures and predicate values.
_BUILTIN_NAMES = frozenset({"host", "rank"})
_RULE_KEYS = frozenset(
    {"id", "title", "category", "patterns", "weak", "requires", "excludes", "distinct",
     "cause", "fix", "refine", "source", "fixtures", "symptom", "notice"}
)
_REQUIRED = ("id", "title", "category", "patterns", "cause", "fix")
_PATTERN_KEYS = frozenset({"re", "weight", "check"})
_REFINE_KEYS = frozenset({"when", "needs", "fix", "fallback", "last"})
_ID = re.compile(r"^[a-z0-9][a-z0-9-]*$")


class RulesError(UsageError):
    """A rules file that cannot be used; the message names the file and the entry."""


@dataclass(frozen=True, kw_only=True)
class Pattern:
    """One regular expression of a rule and how much a match of it is worth."""

    regex: re.Pattern[str]
    #: Probability-like weight in (0, 1]; combined across patterns by noisy-or.
    weight: float
    #: Weak patterns add confidence but never make a rule match on their own.
    weak: bool = False
    #: A condition on the match (:mod:`corral.diagnose.checks`) that must hold for it to count.
    check: Check | None = None


@dataclass(frozen=True, kw_only=True)
class Refinement:
    """A fix step made specific by what is known about the failing host.

    ``when`` names a predicate in :mod:`corral.diagnose.facts` (evaluated on
    doctor facts), ``needs`` lists template values that must be known (the
    host, a regex capture); ``fix`` is a ``str.format`` template.
    """

    when: str | None
    needs: tuple[str, ...]
    fix: str
    #: Applies only when no earlier refinement of the rule produced a step.
    fallback: bool = False
    #: Shown after the rule's generic steps instead of before them.
    last: bool = False


@dataclass(frozen=True, kw_only=True)
class Rule:
    """One known failure class: how to recognise it, what it means, how to fix it."""

    id: str
    title: str
    category: str
    patterns: tuple[Pattern, ...]
    requires: tuple[re.Pattern[str], ...] = ()
    excludes: tuple[re.Pattern[str], ...] = ()
    #: A named group that must take at least two different values for the
    #: patterns capturing it to count (e.g. ranks in *different* collectives).
    distinct: str | None = None
    cause: str
    fix: tuple[str, ...]
    refine: tuple[Refinement, ...] = ()
    sources: tuple[str, ...] = ()
    fixtures: tuple[str, ...] = ()
    #: The error is the echo of a failure elsewhere (a peer went away), not a cause.
    symptom: bool = False
    #: Not a failure but worth naming (NCCL fell back to sockets): listed after the causes.
    notice: bool = False

    @property
    def category_label(self) -> str:
        return CATEGORIES[self.category]

    @property
    def group_names(self) -> frozenset[str]:
        """Every named capture group the rule's patterns can produce."""
        names: set[str] = set()
        for p in self.patterns:
            names.update(p.regex.groupindex)
        return frozenset(names)


def default_rules_path() -> Path:
    """The knowledge base shipped inside the package."""
    return Path(str(resources.files("corral.diagnose").joinpath("rules.toml")))


@functools.lru_cache(maxsize=8)
def _load_cached(paths: tuple[str, ...]) -> tuple[Rule, ...]:
    rules: list[Rule] = []
    seen: dict[str, str] = {}
    for path in paths:
        for rule in _load_file(Path(path)):
            if rule.id in seen:
                raise RulesError(
                    f"{path}: rule '{rule.id}' is defined twice (also in {seen[rule.id]})",
                    hint="give every rule a unique id",
                )
            seen[rule.id] = path
            rules.append(rule)
    return tuple(rules)


def load_rules(extra: Iterable[str | Path] = ()) -> list[Rule]:
    """The built-in rules, then those of ``extra`` rule files (validated, cached)."""
    paths = (str(default_rules_path()), *(str(Path(p)) for p in extra))
    return list(_load_cached(paths))


def _load_file(path: Path) -> list[Rule]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise RulesError(f"{path}: cannot read rules file: {err.strerror}",
                         hint="pass an existing TOML file") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise RulesError(f"{path}: not valid TOML: {err}", hint="fix the TOML syntax") from None
    unknown = set(data) - {"rule"}
    if unknown:
        raise RulesError(f"{path}: unknown top-level key(s): {', '.join(sorted(unknown))}",
                         hint="a rules file holds only [[rule]] tables")
    entries = data.get("rule", [])
    if not isinstance(entries, list):
        raise RulesError(f"{path}: 'rule' must be an array of tables ([[rule]])")
    return [_parse_rule(path, i, entry) for i, entry in enumerate(entries)]


def _parse_rule(path: Path, index: int, entry: Any) -> Rule:
    where = f"{path}: rule #{index + 1}"
    if not isinstance(entry, dict):
        raise RulesError(f"{where}: expected a table")
    rid = entry.get("id")
    if isinstance(rid, str):
        where = f"{path}: rule '{rid}'"

    def fail(msg: str, hint: str | None = None) -> RulesError:
        return RulesError(f"{where}: {msg}", hint=hint)

    unknown = set(entry) - _RULE_KEYS
    if unknown:
        raise fail(f"unknown key(s): {', '.join(sorted(unknown))}",
                   hint=f"allowed keys: {', '.join(sorted(_RULE_KEYS))}")
    for key in _REQUIRED:
        if key not in entry:
            raise fail(f"missing required key '{key}'")
    if not isinstance(rid, str) or not _ID.match(rid):
        raise fail("'id' must be lowercase letters, digits and dashes")
    category = entry["category"]
    if category not in CATEGORIES:
        raise fail(f"unknown category '{category}'",
                   hint=f"one of: {', '.join(CATEGORIES)}")
    patterns = tuple(_parse_pattern(p, fail, weak=False) for p in _list(entry, "patterns", fail))
    if not patterns:
        raise fail("'patterns' must list at least one regex")
    patterns += tuple(_parse_pattern(p, fail, weak=True) for p in _list(entry, "weak", fail))
    symptom = entry.get("symptom", False)
    notice = entry.get("notice", False)
    if not isinstance(symptom, bool):
        raise fail("'symptom' must be true or false")
    if not isinstance(notice, bool):
        raise fail("'notice' must be true or false")
    rule = Rule(
        id=rid,
        title=_text(entry, "title", fail),
        category=category,
        patterns=patterns,
        requires=tuple(_compile(p, fail) for p in _strings(entry, "requires", fail)),
        excludes=tuple(_compile(p, fail) for p in _strings(entry, "excludes", fail)),
        distinct=entry.get("distinct"),
        cause=_text(entry, "cause", fail),
        fix=tuple(_strings(entry, "fix", fail)),
        refine=tuple(_parse_refine(r, fail) for r in _list(entry, "refine", fail)),
        sources=_one_or_many(entry, "source", fail),
        fixtures=tuple(_strings(entry, "fixtures", fail)),
        symptom=symptom,
        notice=notice,
    )
    if not rule.fix:
        raise fail("'fix' must list at least one step")
    if rule.distinct is not None and rule.distinct not in rule.group_names:
        raise fail(f"'distinct' names group '{rule.distinct}' that no pattern captures")
    _check_templates(rule, fail)
    return rule


def _list(entry: Mapping[str, Any], key: str, fail) -> list[Any]:
    value = entry.get(key, [])
    if not isinstance(value, list):
        raise fail(f"'{key}' must be a list")
    return value


def _strings(entry: Mapping[str, Any], key: str, fail) -> list[str]:
    values = _list(entry, key, fail)
    if not all(isinstance(v, str) and v.strip() for v in values):
        raise fail(f"'{key}' must be a list of non-empty strings")
    return values


def _text(entry: Mapping[str, Any], key: str, fail) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value.strip():
        raise fail(f"'{key}' must be a non-empty string")
    return " ".join(value.split())


def _one_or_many(entry: Mapping[str, Any], key: str, fail) -> tuple[str, ...]:
    value = entry.get(key, [])
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise fail(f"'{key}' must be a string or a list of strings")
    return tuple(value)


def _compile(source: str, fail) -> re.Pattern[str]:
    if "(?P=" in source:
        raise fail(f"backreferences are not supported: {source!r}")
    try:
        return re.compile(source)
    except re.error as err:
        raise fail(f"regex {source!r} does not compile: {err}",
                   hint="regexes use Python's re syntax; write them as TOML literal strings '...'")


def _parse_pattern(item: Any, fail, *, weak: bool) -> Pattern:
    if isinstance(item, str):
        return Pattern(regex=_compile(item, fail), weight=WEAK_WEIGHT if weak else STRONG_WEIGHT,
                       weak=weak)
    if not isinstance(item, dict) or "re" not in item:
        raise fail("a pattern is a regex string or a table { re = '...', weight = 0.9 }")
    unknown = set(item) - _PATTERN_KEYS
    if unknown:
        raise fail(f"unknown pattern key(s): {', '.join(sorted(unknown))}")
    weight = item.get("weight", WEAK_WEIGHT if weak else STRONG_WEIGHT)
    if not isinstance(weight, (int, float)) or not 0 < weight <= 1:
        raise fail(f"pattern weight must be in (0, 1], got {weight!r}")
    regex = _compile(item["re"], fail)
    check = None
    if "check" in item:
        check = CHECKS.get(item["check"]) if isinstance(item["check"], str) else None
        if check is None:
            raise fail(f"pattern check {item['check']!r} is unknown",
                       hint=f"one of: {', '.join(sorted(CHECKS))}")
        missing = sorted(check.needs - set(regex.groupindex))
        if missing:
            raise fail(f"pattern check '{check.name}' reads group(s) {', '.join(missing)} "
                       f"that {item['re']!r} does not capture")
    return Pattern(regex=regex, weight=float(weight), weak=weak, check=check)


def _parse_refine(item: Any, fail) -> Refinement:
    if not isinstance(item, dict):
        raise fail("each 'refine' entry must be a table")
    unknown = set(item) - _REFINE_KEYS
    if unknown:
        raise fail(f"unknown refine key(s): {', '.join(sorted(unknown))}")
    when = item.get("when")
    if when is not None and when not in PREDICATES:
        raise fail(f"refine 'when' names unknown predicate '{when}'",
                   hint=f"one of: {', '.join(sorted(PREDICATES))}")
    fix = item.get("fix")
    if not isinstance(fix, str) or not fix.strip():
        raise fail("refine 'fix' must be a non-empty string")
    needs = item.get("needs", [])
    if not isinstance(needs, list) or not all(isinstance(n, str) for n in needs):
        raise fail("refine 'needs' must be a list of names")
    fallback = item.get("fallback", False)
    last = item.get("last", False)
    if not isinstance(fallback, bool) or not isinstance(last, bool):
        raise fail("refine 'fallback' and 'last' must be true or false")
    return Refinement(when=when, needs=tuple(needs), fix=" ".join(fix.split()), fallback=fallback,
                      last=last)


def _check_templates(rule: Rule, fail) -> None:
    """Every ``{name}`` in a refinement must be something that can be known."""
    for ref in rule.refine:
        known = set(_BUILTIN_NAMES) | rule.group_names
        if ref.when is not None:
            known |= PREDICATES[ref.when].provides
        for name in ref.needs:
            if name not in known:
                raise fail(f"refine needs '{name}', which no capture group or predicate provides")
        try:
            fields = [f for _, f, _, _ in string.Formatter().parse(ref.fix) if f]
        except ValueError as err:
            raise fail(f"refine fix template is malformed: {err}") from None
        for name in fields:
            if name not in known:
                raise fail(f"refine fix uses '{{{name}}}', which no capture group or predicate provides")
