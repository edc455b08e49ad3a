"""Diagnose a log file or a whole run directory written by ``corral run``.

Run directory layout (written by ``corral run``)::

    runs/<run-id>/run.json            status, failure {host, rank, exit_code, signal}
    runs/<run-id>/facts.json          doctor facts per host (optional)
    runs/<run-id>/<host>/rank<N>.log  stdout+stderr of global rank N
    runs/<run-id>/<host>/launcher.log the node's launcher (torchrun) output
    runs/<run-id>/stacks-HHMMSS.txt   every rank's stack when the job hung

Each file is matched on its own (``requires``/``excludes`` are per log), with
lines attributed to the host and rank its path names.  The same failure seen
on sixteen ranks is one diagnosis listing sixteen ranks, and what the first
failing rank (from run.json) shows comes first: the other ranks mostly show
the echo of its failure ("connection closed by peer").

Besides the rules' diagnoses, a run directory's report names the first
failing rank's own Python exception (its last traceback: the exception line
and the innermost frame in the program's code) even when no rule explains it,
marks symptom rules seen elsewhere as consequences of that failure, and for a
hung run says which ranks were elsewhere than the others, and where.
"""

from __future__ import annotations

import json
import re
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from corral.diagnose.facts import AllFacts
from corral.diagnose.flightrec import FlightReport
from corral.diagnose.flightrec import read_dir as read_flightrec
from corral.diagnose.hang import Hang, parse_stacks_file, read_hang
from corral.diagnose.logtext import LogLine, iter_lines, open_log
from corral.diagnose.lost import lost_node
from corral.diagnose.matcher import Diagnosis, Matcher
from corral.diagnose.pyexc import Frame, PyException, basename, last_exception
from corral.diagnose.rules import Rule, load_rules
from corral.diagnose.runcontext import file_on_some_nodes_only, own_rendezvous, rank_hosts
from corral.diagnose.signs import failure_lines_in_file
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
    #: "exit", "signal", "hang", "lost", "start"... as corral run recorded it.
    kind: str | None = None
    #: The exception line corral run saw in the rank's output, if any.
    exception: str | None = None
    reason: str | None = None
    #: (host, rank) that had exited cleanly before this failure, which echoes
    #: their leaving (uneven work per rank).
    left_early: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, kw_only=True)
class FirstError:
    """The Python exception the first failing rank died with (its last traceback)."""

    host: str | None
    rank: int
    #: ``KeyError: 'batch_size'``
    exception: str
    type: str
    message: str
    #: Innermost frame in the program's own code (else the innermost frame).
    file: str | None
    line: int | None
    func: str | None
    #: The rank's log, relative to the run directory, and the exception's line in it.
    log: str
    log_line: int
    #: The log's path as given (run directory joined with ``log``).
    log_path: str
    #: The traceback as printed.
    traceback: tuple[str, ...] = ()
    #: Rules that matched in this rank's log (a known failure explains the exception).
    explained_by: tuple[str, ...] = ()
    #: "exception" (a Python traceback), or "exit" when the rank ended without
    #: one (a signal, ``sys.exit(2)`` from argparse...): then ``exception`` says
    #: how it ended and ``traceback`` holds the last lines it wrote.
    kind: str = "exception"

    @property
    def where(self) -> str:
        """``crash_rank3.py:9``"""
        if self.file is None:
            return ""
        return f"{basename(self.file)}:{self.line}"

    @property
    def summary(self) -> str:
        """``rank 3 on h1n2 failed first: KeyError: 'batch_size' (crash_rank3.py:9)``"""
        on = f" on {self.host}" if self.host else ""
        where = f" ({self.where})" if self.where else ""
        return f"rank {self.rank}{on} failed first: {self.exception}{where}"

    def to_dict(self) -> dict:
        return {
            "summary": self.summary, "host": self.host, "rank": self.rank,
            "exception": self.exception, "type": self.type, "message": self.message,
            "file": self.file, "line": self.line, "func": self.func, "where": self.where,
            "log": self.log, "log_line": self.log_line, "log_path": self.log_path,
            "traceback": list(self.traceback), "explained_by": list(self.explained_by),
            "kind": self.kind,
        }


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
    #: The first failing rank's own exception (run directories), listed before the diagnoses.
    first_error: FirstError | None = None
    #: What a hung run's record and stacks file say.
    hang: Hang | None = None
    #: For a single log file: the Python exception it ends with, if any
    #: (``FileNotFoundError: ... (train.py:9)``); a run directory has ``first_error``.
    exception: PyException | None = None
    #: For a single log no rule explains: (line, text) of its first lines that look
    #: like a failure; ``()`` means it shows none (a healthy log), None: not checked.
    failure_lines: tuple[tuple[int, str], ...] | None = None
    #: What the ranks' flight recorder dumps (``flightrec/``) say, if the run has any.
    flightrec: FlightReport | None = None
    #: Per rank, its faulthandler stack from the hang's stacks file (for the flight recorder's odd ranks).
    rank_stacks: Mapping[int, str] | None = None

    @property
    def found(self) -> bool:
        """Something names the failure: a rule, the first rank's exception, or a hang
        (a notice, such as NCCL falling back to sockets, is no failure)."""
        return (any(not d.notice for d in self.diagnoses) or self.first_error is not None
                or self.hang is not None or bool(self.flightrec and self.flightrec.culprits))


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
        # The last traceback is read by a Python pass over the file while grep feeds the
        # rules in another process: run side by side, the two passes cost the time of one.
        with ThreadPoolExecutor(max_workers=1) as pool:
            tail = pool.submit(last_exception, root)
            diags = _scan(root, str(root), rules, None, None, facts)
            try:
                exc = tail.result()
                unexplained = exc is None and all(d.notice for d in diags)
                signs = failure_lines_in_file(root) if unexplained else None
            except OSError:
                exc, signs = None, None
        first = _file_first_error(root, exc, diags)
        if first is not None:
            # torchrun named the rank that failed first: symptoms on the others are its echo
            diags = [replace(d, consequence=True) if d.symptom and d.rank != first.rank else d
                     for d in diags]
            diags.sort(key=lambda d: (d.notice, d.consequence))
        return RunReport(path=str(root), kind="file", files=(str(root),), failure=None,
                         facts_hosts=tuple(sorted(facts or {})), diagnoses=tuple(diags),
                         exception=exc, failure_lines=signs, first_error=first)
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
    if record.get("status") == "interrupted":
        # Ctrl-C or SIGTERM stopped it: a peer "going away" is that stop.
        diags = [replace(d, consequence=True) if d.symptom else d for d in diags]
        diags.sort(key=lambda d: (d.notice, d.consequence))
    diags = [own_rendezvous(d, record) for d in diags]
    if failure is not None and failure.kind == "lost" and failure.host:
        # No rank failed: the node went silent, and what the others show is its teardown.
        diags = [replace(d, consequence=True) if d.symptom else d for d in diags]
        diags.sort(key=lambda d: (d.notice, d.consequence))
        diags.insert(0, lost_node(failure.host, failure.reason, root, logs))
    first_error = _first_error(root, logs, per_file, failure)
    local = file_on_some_nodes_only(root, logs, record, first_error)
    if local is not None and first_error is not None:
        diags.insert(0, local)
        first_error = replace(first_error, explained_by=(local.rule_id, *first_error.explained_by))
    hang = read_hang(root, record, rank_hosts(record)) if record else None
    world = record.get("world_size")
    flight = read_flightrec(root, world if isinstance(world, int) else None)
    stacks = None
    if hang is not None and hang.stacks_file:
        try:
            stacks = parse_stacks_file(Path(hang.stacks_file).read_text(encoding="utf-8", errors="replace"))
        except OSError:
            stacks = None
    return RunReport(flightrec=flight, rank_stacks=stacks,path=str(root), kind="run" if run_json.is_file() else "dir",
                     files=tuple(str(f.relative_to(root)) for f, _, _ in logs), failure=failure,
                     facts_hosts=tuple(sorted(all_facts)), diagnoses=tuple(diags),
                     status=record.get("status") if isinstance(record.get("status"), str) else None,
                     first_error=first_error, hang=hang)


def resolve_target(target: str | Path, runs_root: Path) -> Path:
    """A log file or run directory as given, else the run whose id is (or starts with)
    ``target`` under ``runs_root`` (``./runs``), like `corral stacks` and `corral runs`."""
    path = Path(target)
    if path.exists():
        return path
    name = str(target)
    looks_like_id = bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")
    runs = sorted(d for d in runs_root.iterdir() if d.is_dir()) if runs_root.is_dir() else []
    matches = [d for d in runs if d.name.startswith(name)] if looks_like_id else []
    exact = [d for d in matches if d.name == name]
    if exact:
        return exact[0]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        listed = ", ".join(d.name for d in matches[:5]) + (" ..." if len(matches) > 5 else "")
        raise UsageError(f"{name}: matches {len(matches)} runs in {runs_root}: {listed}",
                         hint="give more of the run id (`corral runs` lists them)")
    where = f", and no run id starting with it in {runs_root}" if looks_like_id else ""
    raise UsageError(f"{name}: no such file or directory{where}",
                     hint="give a log file, a run directory such as runs/<run-id>, or a run id "
                          "(or a unique prefix) from `corral runs`")


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

    def text(key: str) -> str | None:
        value = failure.get(key)
        return value if isinstance(value, str) and value else None

    return Failure(
        host=text("host"),
        rank=rank if isinstance(rank, int) and not isinstance(rank, bool) else None,
        exit_code=code if isinstance(code, int) else None,
        signal=str(failure["signal"]) if failure.get("signal") is not None else None,
        kind=text("kind"), exception=text("exception"), reason=text("reason"),
        left_early=tuple((e["host"], e["rank"]) for e in failure.get("left_early") or ()
                         if isinstance(e, dict) and isinstance(e.get("host"), str)
                         and isinstance(e.get("rank"), int)),
    )


def _file_first_error(path: Path, exc: PyException | None,
                      diags: Sequence[Diagnosis]) -> FirstError | None:
    """In one log of many ranks (torchrun's output, a Slurm job's file): the
    exception of the rank torchrun's summary names as the first failure."""
    if exc is None or not exc.failed_first:
        return None
    rank = exc.summary_rank
    assert rank is not None
    if any(d.symptom and d.rank in (exc.rank, rank) and d.rank is not None for d in diags):
        # "Connection closed by peer": in a file of several nodes' torchruns,
        # the last summary is that of a node whose ranks only echoed another's
        return None
    frame = exc.user_frame
    return FirstError(
        host=dict(exc.summary).get("host"), rank=rank, exception=exc.text, type=exc.type,
        message=exc.message, file=frame.file if frame else None,
        line=frame.line if frame else None, func=frame.func if frame else None,
        log=path.name, log_line=exc.line, log_path=str(path), traceback=exc.shown,
        explained_by=tuple(d.rule_id for d in diags if d.rank == rank and not d.notice),
    )


def _first_error(root: Path, logs: Sequence[tuple[Path, str | None, int | None]],
                 per_file: Sequence[Sequence[Diagnosis]], failure: Failure | None) -> FirstError | None:
    """The exception the first failing rank's own log ends with (run.json names the rank)."""
    if failure is None or failure.rank is None or failure.kind == "hang":
        return None
    candidates = [i for i, (_, _, rank) in enumerate(logs) if rank == failure.rank]
    # the rank's file under its host's directory; any file of that rank if the host differs
    candidates.sort(key=lambda i: logs[i][1] != failure.host)
    for i in candidates:
        file, host, _ = logs[i]
        try:
            exc = last_exception(file)
        except OSError:
            continue
        if exc is None:
            continue
        frame = exc.user_frame
        log = str(file.relative_to(root))
        return FirstError(
            host=failure.host or host, rank=failure.rank, exception=exc.text, type=exc.type,
            message=exc.message, file=frame.file if frame else None,
            line=frame.line if frame else None, func=frame.func if frame else None,
            log=log, log_line=exc.line, log_path=str(root / log), traceback=exc.shown,
            explained_by=tuple(d.rule_id for d in per_file[i]),
        )
    return _ended_without_traceback(root, logs, per_file, failure, candidates)


def _rules_on_node(logs: Sequence[tuple[Path, str | None, int | None]],
                   per_file: Sequence[Sequence[Diagnosis]], i: int) -> tuple[str, ...]:
    """Rules matched in rank log ``i`` or its node's launcher log: for a rank that
    left no traceback, torchrun's report (``Signal 9 (SIGKILL) received``) is the evidence."""
    host = logs[i][1]
    ids = [d.rule_id for d in per_file[i]]
    for j, (_, h, rank) in enumerate(logs):
        if j != i and rank is None and h == host:
            ids += [d.rule_id for d in per_file[j] if d.rule_id not in ids]
    return tuple(ids)


#: Last lines of a rank log shown when the rank ended without a traceback.
_TAIL_LINES = 6


def _ended_without_traceback(root: Path, logs: Sequence[tuple[Path, str | None, int | None]],
                             per_file: Sequence[Sequence[Diagnosis]], failure: Failure,
                             candidates: Sequence[int]) -> FirstError | None:
    """A rank killed by a signal or exiting non-zero with no traceback still
    failed first: say how it ended and what it printed last (argparse's
    ``error: ...``, a C++ abort message), instead of naming it only in the header."""
    if failure.signal is not None:
        how = f"killed by {failure.signal}" if failure.signal.startswith("SIG") \
            else f"killed by signal {failure.signal}"
    elif failure.exit_code is not None and failure.exit_code != 0:
        how = f"exited with code {failure.exit_code}"
    else:
        return None
    for i in candidates:
        file, host, _ = logs[i]
        try:
            with open_log(file) as stream:
                recent = deque((ln for ln in iter_lines(stream) if ln.shown.strip()), maxlen=_FATAL_LINES)
        except OSError:
            continue
        tail = list(recent)[-_TAIL_LINES:]
        frame, fatal = _fatal_frame(list(recent))
        if fatal is not None:  # faulthandler's report: show it from its header
            tail = list(recent)[fatal:fatal + _TAIL_LINES]
        log = str(file.relative_to(root))
        return FirstError(
            host=failure.host or host, rank=failure.rank, exception=how, type="", message="",
            file=frame.file if frame else None, line=frame.line if frame else None,
            func=frame.func if frame else None, log=log, log_line=tail[-1].number if tail else 0,
            log_path=str(root / log), traceback=tuple(ln.shown for ln in tail),
            explained_by=_rules_on_node(logs, per_file, i), kind="exit",
        )
    return None


#: Lines read back from the end of a rank log for a native crash's report.
_FATAL_LINES = 80
_FAULTHANDLER_FRAME = re.compile(r'^File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')


def _fatal_frame(lines: Sequence[LogLine]) -> tuple[Frame | None, int | None]:
    """The program's innermost frame in faulthandler's last ``Fatal Python
    error`` report (the rank hook enables it), and where the report starts."""
    start = next((k for k in range(len(lines) - 1, -1, -1)
                  if lines[k].text.startswith("Fatal Python error:")), None)
    if start is None:
        return None, None
    frames = [Frame(file=m["file"], line=int(m["line"]), func=m["func"])
              for ln in lines[start:] if (m := _FAULTHANDLER_FRAME.match(ln.text))]
    user = next((fr for fr in frames if fr.is_user), frames[0] if frames else None)  # most recent first
    return user, start


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
        matcher.feed_file(file)
    except OSError as err:
        raise UsageError(f"{file}: cannot read: {err.strerror}") from None
    return matcher.diagnoses(facts)


def _at_failure(diag: Diagnosis, failure: Failure | None) -> bool:
    if failure is None or failure.host is None or diag.host != failure.host:
        return False
    return failure.rank is None or diag.rank is None or diag.rank == failure.rank


def _merge(per_file: list[list[Diagnosis]], failure: Failure | None,
           order: Mapping[str, int]) -> list[Diagnosis]:
    """One diagnosis per rule across files; a symptom rule seen only away from
    the first failing rank (run.json) is marked a consequence of that failure."""
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
        # A hung run printed no error of its own: a symptom in it (SIGTERM to
        # the launchers, a peer gone) is corral's teardown after the timeout.
        consequence = (primary.symptom and failure is not None
                       and (failure.kind == "hang"
                            or (failure.host is not None and not _at_failure(primary, failure))))
        merged.append(replace(primary, confidence=max(d.confidence for d in ds),
                              lines=tuple(lines), hosts=tuple(hosts), ranks=tuple(ranks),
                              consequence=consequence))
    merged.sort(key=lambda d: (d.notice, d.consequence, not _at_failure(d, failure), -d.confidence,
                               order.get(d.rule_id, 0)))
    return merged
