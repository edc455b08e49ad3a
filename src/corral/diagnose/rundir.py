"""Diagnose a log file or a whole run directory written by ``corral run``.

Run directory layout (written by ``corral run``)::

    runs/<run-id>/run.json            status, failure {host, rank, exit_code, signal}
    runs/<run-id>/facts.json          doctor facts per host (optional)
    runs/<run-id>/<host>/rank<N>.log  stdout+stderr of global rank N
    runs/<run-id>/<host>/launcher.log the node's launcher (torchrun) output

Each file is matched on its own (``requires``/``excludes`` are per log), with
lines attributed to the host and rank its path names.  The same failure seen
on sixteen ranks is one diagnosis listing sixteen ranks, and what the first
failing rank (from run.json) shows comes first: the other ranks mostly show
the echo of its failure ("connection closed by peer").
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from corral.diagnose.facts import AllFacts
from corral.diagnose.logtext import open_log
from corral.diagnose.matcher import Diagnosis, Matcher
from corral.diagnose.rules import Rule, load_rules
from corral.errors import UsageError

_RANK_FILE = re.compile(r"^rank(\d+)\.log$")
_MAX_LINES = 8


@dataclass(frozen=True, kw_only=True)
class Failure:
    """The first failure ``corral run`` recorded in run.json."""

    host: str | None = None
    rank: int | None = None
    exit_code: int | None = None
    signal: str | None = None


@dataclass(frozen=True, kw_only=True)
class RunReport:
    """What was read and what it shows."""

    path: str
    #: "file" (one log), "run" (a corral run directory) or "dir" (a folder of logs).
    kind: str
    files: tuple[str, ...]
    failure: Failure | None
    facts_hosts: tuple[str, ...]
    diagnoses: tuple[Diagnosis, ...]
    #: run.json's status ("failed", "succeeded", ...) for run directories.
    status: str | None = None


def diagnose_path(path: str | Path, facts: AllFacts | None = None,
                  rules: Sequence[Rule] | None = None) -> list[Diagnosis]:
    """Likely causes for a log file or a run directory, most relevant first."""
    return list(diagnose_run(path, facts=facts, rules=rules).diagnoses)


def diagnose_run(path: str | Path, *, facts: AllFacts | None = None,
                 rules: Sequence[Rule] | None = None) -> RunReport:
    """Like :func:`diagnose_path`, also saying which files and facts were used."""
    root = Path(path)
    if not root.exists():
        raise UsageError(f"{path}: no such file or directory",
                         hint="give a log file, or a run directory such as runs/<run-id>")
    rules = load_rules() if rules is None else list(rules)
    if root.is_file():
        diags = _scan(root, str(root), rules, None, None, facts)
        return RunReport(path=str(root), kind="file", files=(str(root),), failure=None,
                         facts_hosts=tuple(sorted(facts or {})), diagnoses=tuple(diags))
    run_json = root / "run.json"
    record = _read_record(run_json) if run_json.is_file() else {}
    failure = _failure(record)
    all_facts: dict[str, Any] = {}
    if (root / "facts.json").is_file():
        all_facts.update(load_facts(root / "facts.json"))
    all_facts.update(facts or {})
    logs = _log_files(root)
    if not logs:
        raise UsageError(f"{path}: no log files found (looked for <host>/rank<N>.log, "
                         "<host>/launcher.log and *.log)",
                         hint="give a log file, or a run directory written by `corral run`")
    per_file = [
        _scan(file, str(file.relative_to(root)), rules, host, rank, all_facts)
        for file, host, rank in logs
    ]
    order = {r.id: i for i, r in enumerate(rules)}
    diags = _merge(per_file, failure, order)
    return RunReport(path=str(root), kind="run" if run_json.is_file() else "dir",
                     files=tuple(str(f.relative_to(root)) for f, _, _ in logs), failure=failure,
                     facts_hosts=tuple(sorted(all_facts)), diagnoses=tuple(diags),
                     status=record.get("status") if isinstance(record.get("status"), str) else None)


def load_facts(path: str | Path) -> dict[str, dict]:
    """Doctor facts keyed by host.

    Accepts ``corral doctor --json`` output as is (its ``evidence.facts``), a
    ``{host: facts}`` object, or a list of facts objects each naming its "host".
    """
    data = _read_json(Path(path))
    if isinstance(data, dict) and isinstance(data.get("evidence"), dict):
        data = data["evidence"].get("facts")
    elif isinstance(data, dict) and isinstance(data.get("facts"), dict):
        data = data["facts"]
    if isinstance(data, list):
        out = {}
        for item in data:
            if not isinstance(item, dict) or not isinstance(item.get("host"), str):
                raise UsageError(f"{path}: each facts entry needs a \"host\" name",
                                 hint="write what `corral doctor --json` produces")
            out[item["host"]] = item
        return out
    if isinstance(data, dict) and all(isinstance(v, dict) for v in data.values()):
        return {str(k): v for k, v in data.items()}
    raise UsageError(f"{path}: facts must be an object {{host: facts}} or a list of facts",
                     hint="write what `corral doctor --json` produces")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise UsageError(f"{path}: cannot read: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise UsageError(f"{path}:{err.lineno}: not valid JSON: {err.msg}") from None


def _read_record(run_json: Path) -> dict[str, Any]:
    data = _read_json(run_json)
    if not isinstance(data, dict):
        raise UsageError(f"{run_json}: expected a JSON object", hint="run.json is written by `corral run`")
    return data


def _failure(record: Mapping[str, Any]) -> Failure | None:
    failure = record.get("failure")
    if not isinstance(failure, dict):
        return None
    rank = failure.get("rank")
    code = failure.get("exit_code")
    return Failure(
        host=failure.get("host") if isinstance(failure.get("host"), str) else None,
        rank=rank if isinstance(rank, int) else None,
        exit_code=code if isinstance(code, int) else None,
        signal=str(failure["signal"]) if failure.get("signal") is not None else None,
    )


def _log_files(root: Path) -> list[tuple[Path, str | None, int | None]]:
    """(file, host, rank) for every log, ordered by host then rank (launcher last)."""
    found = []
    for file in sorted(root.glob("*.log")):
        found.append((file, None, None))
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        ranked, others = [], []
        for file in sorted(sub.glob("*.log")):
            m = _RANK_FILE.match(file.name)
            (ranked if m else others).append((file, sub.name, int(m.group(1)) if m else None))
        found += sorted(ranked, key=lambda t: t[2]) + others
    return found


def _scan(file: Path, origin: str, rules: Sequence[Rule], host: str | None, rank: int | None,
          facts: AllFacts | None) -> list[Diagnosis]:
    matcher = Matcher(rules, origin=origin, host=host, rank=rank)
    try:
        with open_log(file) as stream:
            matcher.feed_stream(stream)
    except OSError as err:
        raise UsageError(f"{file}: cannot read: {err.strerror}") from None
    return matcher.diagnoses(facts)


def _at_failure(diag: Diagnosis, failure: Failure | None) -> bool:
    if failure is None or failure.host is None or diag.host != failure.host:
        return False
    return failure.rank is None or diag.rank is None or diag.rank == failure.rank


def _merge(per_file: list[list[Diagnosis]], failure: Failure | None,
           order: Mapping[str, int]) -> list[Diagnosis]:
    by_rule: dict[str, list[Diagnosis]] = {}
    for diags in per_file:
        for d in diags:
            by_rule.setdefault(d.rule_id, []).append(d)
    merged = []
    for ds in by_rule.values():
        primary = max(ds, key=lambda d: (_at_failure(d, failure), d.confidence))
        lines = list(primary.lines)
        for d in ds:
            if d is not primary and len(lines) < _MAX_LINES:
                lines.append(d.lines[0])
        hosts = sorted({h for d in ds for h in (d.hosts or ((d.host,) if d.host else ()))})
        ranks = sorted({r for d in ds for r in (d.ranks or ((d.rank,) if d.rank is not None else ()))})
        merged.append(replace(primary, confidence=max(d.confidence for d in ds),
                              lines=tuple(lines), hosts=tuple(hosts), ranks=tuple(ranks)))
    merged.sort(key=lambda d: (not _at_failure(d, failure), -d.confidence, order.get(d.rule_id, 0)))
    return merged
