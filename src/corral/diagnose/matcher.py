"""Match log lines against the rules and rank the likely causes.

Confidence is a noisy-or of the weights of the distinct patterns that
matched: two independent signs of the same failure are stronger evidence
than one, but repeating one line a thousand times (every rank prints it) is
still one sign.  A rule needs at least one non-weak pattern to be reported,
all of its ``requires`` somewhere in the same log, and none of its
``excludes``.

:class:`Matcher` is fed line by line, so the same code serves a saved log,
a run directory (one matcher per file) and a live run.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO

from corral.diagnose import prefilter
from corral.diagnose.facts import AllFacts, refine_steps
from corral.diagnose.logtext import MAX_LINE, LogLine, iter_lines, open_log, parse
from corral.diagnose.rules import Rule, load_rules

#: Matched lines kept per pattern, and per diagnosis in total.
_LINES_PER_PATTERN = 3
_LINES_PER_DIAGNOSIS = 8
#: Distinct (host, rank) places remembered per rule.
_PLACES_PER_RULE = 256
_MAX_CONFIDENCE = 0.99


@dataclass(frozen=True, kw_only=True)
class MatchedLine:
    """A log line that matched one of a rule's patterns."""

    line: int
    text: str
    origin: str | None = None
    host: str | None = None
    rank: int | None = None


@dataclass(frozen=True, kw_only=True)
class Diagnosis:
    """A likely cause of a failure, with the evidence and the fix."""

    rule_id: str
    title: str
    category: str
    category_label: str
    cause: str
    #: Fix steps: host-specific refinements first, then the rule's generic steps.
    fix: tuple[str, ...]
    confidence: float
    lines: tuple[MatchedLine, ...]
    #: Where the evidence points; ``None`` when the log does not say.
    host: str | None = None
    rank: int | None = None
    #: Every host / rank whose output matched (a run directory gathers several).
    hosts: tuple[str, ...] = ()
    ranks: tuple[int, ...] = ()
    origin: str | None = None
    sources: tuple[str, ...] = ()
    #: Values captured by the rule's named groups (interface name, port...).
    captures: Mapping[str, str] = field(default_factory=dict)
    #: The rule names an echo of a failure elsewhere (a peer went away), not a cause.
    symptom: bool = False
    #: In a run directory: a symptom seen away from the first failing rank, so a
    #: consequence of that rank's failure rather than a cause.
    consequence: bool = False
    #: Not a failure, but worth naming (a performance warning); listed after the causes.
    notice: bool = False

    @property
    def id(self) -> str:
        """Alias of ``rule_id`` (what run summaries record)."""
        return self.rule_id

    def to_dict(self) -> dict:
        """A JSON-ready dict (``corral diagnose --json``)."""
        data = asdict(self)
        data["fix"] = list(self.fix)
        data["lines"] = [asdict(m) for m in self.lines]
        data["hosts"] = list(self.hosts)
        data["ranks"] = list(self.ranks)
        data["sources"] = list(self.sources)
        data["captures"] = dict(self.captures)
        return data


class _RuleState:
    """What one rule has seen so far in one log."""

    __slots__ = ("excluded", "hits", "lines", "places", "required", "values")

    def __init__(self, rule: Rule) -> None:
        self.hits = [0] * len(rule.patterns)
        self.lines: list[list[LogLine]] = [[] for _ in rule.patterns]
        self.values: list[dict[str, list[str]]] = [{} for _ in rule.patterns]
        self.required = [False] * len(rule.requires)
        self.excluded = False
        #: Where the lines of non-weak patterns came from: (host, rank).
        self.places: dict[tuple[str | None, int | None], None] = {}


class Matcher:
    """Accumulates rule matches over the lines of one log."""

    def __init__(self, rules: Sequence[Rule] | None = None, *, origin: str | None = None,
                 host: str | None = None, rank: int | None = None) -> None:
        self.rules = list(load_rules() if rules is None else rules)
        self.origin = origin
        self.host = host
        self.rank = rank
        self._states = [_RuleState(r) for r in self.rules]
        # Per rule, literals one of which a line it matches contains (None: it needs every line).
        self._index = prefilter.LiteralIndex([
            prefilter.literal_set([p.regex for p in r.patterns] + [*r.requires, *r.excludes])
            for r in self.rules
        ])
        self._literals = self._index.literals
        self._count = 0

    def feed(self, line: LogLine) -> None:
        text = line.text
        for index in self._index.candidates(text):
            rule, state = self.rules[index], self._states[index]
            for i, rx in enumerate(rule.requires):
                if not state.required[i] and rx.search(text):
                    state.required[i] = True
            if not state.excluded and any(rx.search(text) for rx in rule.excludes):
                state.excluded = True
            for i, pattern in enumerate(rule.patterns):
                m = pattern.regex.search(text)
                if not m or (pattern.check is not None and not pattern.check.test(m)):
                    continue
                state.hits[i] += 1
                if len(state.lines[i]) < _LINES_PER_PATTERN:
                    state.lines[i].append(line)
                if not pattern.weak and len(state.places) < _PLACES_PER_RULE:
                    state.places.setdefault(self._where(line))
                for name, value in m.groupdict().items():
                    if value is not None:
                        seen = state.values[i].setdefault(name, [])
                        if value not in seen and len(seen) < 16:
                            seen.append(value)

    def feed_text(self, raw: str, *, host: str | None = None, rank: int | None = None) -> None:
        """Feed one raw output line as it arrives (live runs).

        ``host``/``rank`` say where it came from; they win over what a prefix
        inside the line claims, like a per-rank log file's path does.
        """
        self._count += 1
        for line in parse(raw, self._count):
            if host or rank is not None:
                line = replace(line, host=host or line.host,
                               rank=rank if rank is not None else line.rank)
            self.feed(line)

    def feed_all(self, lines: Iterable[LogLine]) -> Matcher:
        for line in lines:
            self.feed(line)
        return self

    def feed_stream(self, stream: IO[str]) -> Matcher:
        """Feed a whole text stream; only lines containing a rule's literal are parsed."""
        if self._literals is None:
            return self.feed_all(iter_lines(stream))
        for number, raw in prefilter.scan(stream, self._literals, MAX_LINE):
            for line in parse(raw, number):
                self.feed(line)
        return self

    def feed_file(self, path: str | Path) -> Matcher:
        """Feed a log file: ``grep -E`` picks the lines holding a rule's literal
        when the file is UTF-8 and grep is there (hundreds of MB/s), else the
        pure-Python block scan reads it."""
        with open_log(path) as stream:
            grep = None if self._literals is None else prefilter.grep_path(stream.encoding, self._literals)
            if grep is None:
                return self.feed_stream(stream)
        for number, raw in prefilter.grep_scan(grep, path, self._literals, MAX_LINE):
            for line in parse(raw, number):
                self.feed(line)
        return self

    def diagnoses(self, facts: AllFacts | None = None) -> list[Diagnosis]:
        """The rules that matched, most likely first."""
        found = []
        for order, (rule, state) in enumerate(zip(self.rules, self._states)):
            diag = self._diagnose(rule, state, facts)
            if diag is not None:
                first = min(ln.number for ln_list in state.lines for ln in ln_list)
                found.append((-diag.confidence, first, order, diag))
        found.sort(key=lambda t: (t[3].notice, *t[:3]))
        return [d for *_, d in found]

    def _where(self, line: LogLine) -> tuple[str | None, int | None]:
        """Host and rank of a line: a per-rank log's own path wins over line prefixes.

        In a launcher's log (no rank) a prefix names the real source (pdsh's
        ``node3: ...``); in ``node2/rank3.log`` everything is node2's rank 3.
        """
        if self.rank is not None:
            return self.host or line.host, self.rank
        return line.host or self.host, line.rank

    def _counted(self, rule: Rule, state: _RuleState) -> list[int]:
        counted = []
        for i, pattern in enumerate(rule.patterns):
            if not state.hits[i]:
                continue
            needs_two = rule.distinct and rule.distinct in pattern.regex.groupindex
            if needs_two and len(state.values[i].get(rule.distinct, [])) < 2:
                continue
            counted.append(i)
        return counted

    def _diagnose(self, rule: Rule, state: _RuleState, facts: AllFacts | None) -> Diagnosis | None:
        counted = self._counted(rule, state)
        if not any(not rule.patterns[i].weak for i in counted):
            return None
        if state.excluded or not all(state.required):
            return None
        miss = 1.0
        for i in counted:
            miss *= 1.0 - rule.patterns[i].weight
        confidence = round(min(_MAX_CONFIDENCE, 1.0 - miss), 2)
        strong = [i for i in counted if not rule.patterns[i].weak]
        # The lines that name the failure first, then context, shown in log order.
        picked: dict[int, LogLine] = {}
        for i in strong + [i for i in counted if rule.patterns[i].weak]:
            for ln in state.lines[i]:
                if len(picked) < _LINES_PER_DIAGNOSIS:
                    picked.setdefault(id(ln), ln)
        evidence = sorted(picked.values(), key=lambda ln: ln.number)
        lead = min((state.lines[i][0] for i in strong), key=lambda ln: ln.number)
        host, rank = self._where(lead)
        captures: dict[str, str] = {}
        for i in counted:
            for name, values in state.values[i].items():
                captures.setdefault(name, values[0])
        where = {"captures": captures, "host": host, "rank": rank, "facts": facts}
        fix = refine_steps([r for r in rule.refine if not r.last], **where)
        fix += [step for step in rule.fix if step not in fix]
        last = refine_steps([r for r in rule.refine if r.last], **where)
        fix += [step for step in last if step not in fix]
        lines = tuple(
            MatchedLine(line=ln.number, text=ln.shown, origin=self.origin,
                        host=self._where(ln)[0], rank=self._where(ln)[1])
            for ln in evidence
        )
        # Where the failure was seen: every line that names it, not the context
        # lines (a weak pattern's line can come from a process that did not fail).
        hosts = sorted({h for h, _ in state.places if h})
        ranks = sorted({r for _, r in state.places if r is not None})
        return Diagnosis(
            rule_id=rule.id, title=rule.title, category=rule.category,
            category_label=rule.category_label, cause=rule.cause, fix=tuple(fix),
            confidence=confidence, lines=lines, host=host, rank=rank, hosts=tuple(hosts),
            ranks=tuple(ranks), origin=self.origin, sources=rule.sources, captures=captures,
            symptom=rule.symptom, notice=rule.notice,
        )


def diagnose_text(
    text: str,
    *,
    origin: str | None = None,
    facts: AllFacts | None = None,
    rules: Sequence[Rule] | None = None,
    host: str | None = None,
    rank: int | None = None,
    notices: bool = False,
) -> list[Diagnosis]:
    """Likely causes of the failure ``text`` shows, most likely first.

    ``host``/``rank`` attribute lines that do not name their own (a per-rank
    log file); ``facts`` (doctor facts per host) make fix steps host-specific.
    Notices (no failure, e.g. NCCL using sockets) are left out unless
    ``notices``: callers that take the first entries as a failed run's cause
    (corral run's summary) must not get one.
    """
    matcher = Matcher(rules, origin=origin, host=host, rank=rank)
    found = matcher.feed_stream(io.StringIO(text.removeprefix("\ufeff"))).diagnoses(facts)
    return found if notices else [d for d in found if not d.notice]
