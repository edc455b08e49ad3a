"""What a run's record adds to the diagnosis of its logs (run directories only).

- A file one node has and another does not: the first failing rank could
  not open a path the ranks of another node did not miss (each node has its
  own disk there) -- ``file_on_some_nodes_only``.
- A script that sets its own MASTER_ADDR/MASTER_PORT on a multi-node run:
  "cannot connect to the store" at a loopback address corral did not give --
  ``own_rendezvous``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral.diagnose.matcher import Diagnosis, MatchedLine
from corral.diagnose.pyexc import last_exception

if TYPE_CHECKING:
    from corral.diagnose.rundir import FirstError

#: Lines shown of the logs a finding rests on.
_MAX_LINES = 8


def rank_hosts(record: Mapping[str, Any]) -> dict[int, str]:
    """Global rank -> host name, from run.json's hosts."""
    out: dict[int, str] = {}
    hosts = record.get("hosts")
    for h in hosts if isinstance(hosts, list) else ():
        if isinstance(h, dict) and isinstance(h.get("name"), str) and isinstance(h.get("ranks"), list):
            for r in h["ranks"]:
                if isinstance(r, int):
                    out[r] = h["name"]
    return out


_MISSING_FILE = re.compile(r"^(?:FileNotFoundError|OSError|IOError): \[Errno 2\] No such file or directory: '(?P<path>[^']+)'")
#: Id of the run-directory check below (it compares nodes, so it is no rule in rules.toml).
NODE_LOCAL_FILE = "file-on-some-nodes-only"


def file_on_some_nodes_only(root: Path, logs: Sequence[tuple[Path, str | None, int | None]],
                             record: Mapping[str, Any], first_error: FirstError | None) -> Diagnosis | None:
    """The first failing rank could not open a file that the ranks of another
    node did not miss: one node wrote it (rank 0's torch.save before a barrier)
    or holds it, and the others cannot see it, because each node has its own disk.

    Said only when run.json places the ranks on several hosts, every rank log
    that fails on the path is on hosts other than at least one host whose ranks
    all left logs without that error.
    """
    if first_error is None or first_error.kind != "exception":
        return None
    m = _MISSING_FILE.match(first_error.exception)
    if m is None:
        return None
    path = m["path"]
    if len(set(rank_hosts(record).values())) < 2:
        return None
    failed: dict[str, list[tuple[str, int, int, str]]] = {}
    clean: set[str] = set()
    for file, host, rank in logs:
        if rank is None or host is None:
            continue
        try:
            exc = last_exception(file)
        except OSError:
            return None
        hit = exc is not None and (mm := _MISSING_FILE.match(exc.text)) is not None and mm["path"] == path
        if hit:
            failed.setdefault(host, []).append((str(file.relative_to(root)), rank, exc.line, exc.text))
        else:
            clean.add(host)
    ok = sorted(clean - set(failed))
    if not failed or not ok:
        return None
    missing = sorted(failed)
    lines = tuple(MatchedLine(line=line, text=text, origin=origin, host=host, rank=rank)
                  for host in missing for origin, rank, line, text in failed[host][:2])[:_MAX_LINES]
    on_missing, on_ok = ", ".join(missing), ", ".join(ok)
    relative = "" if path.startswith("/") else " (a relative path, taken from each node's working directory)"
    return Diagnosis(
        rule_id=NODE_LOCAL_FILE,
        title=f"'{path}' is missing on {on_missing} but not on {on_ok}: the nodes do not share that directory",
        category="checkpoint", category_label="checkpointing",
        cause=(f"The ranks on {on_missing} could not open '{path}'{relative}, while the ranks on {on_ok} "
               "did not fail on it. Each node has its own disk there: a file one rank writes (rank 0's "
               "torch.save before a barrier, a checkpoint, a prepared dataset or cache) exists only on the "
               "node that wrote it, and a barrier does not copy it. (If the ranks on "
               f"{on_ok} were stopped before they reached that line, check the path on every node.)"),
        fix=(
            f"Put '{path}' on storage every node mounts (NFS, Lustre, a bucket through fsspec) and use that path on every rank.",
            "Or write it on every node: let each node's local rank 0 write it (`if int(os.environ['LOCAL_RANK']) == 0:`) before the barrier, instead of global rank 0 only.",
            "Or do not go through a file: rank 0 sends the object to the others, `obj = [state if dist.get_rank() == 0 else None]; dist.broadcast_object_list(obj, src=0)` (or dist.broadcast for tensors after building the model on every rank).",
            f"For inputs prepared before the run, copy them to every node: `corral sync` of the project directory, or rsync to {on_missing}.",
        ),
        confidence=0.85, lines=lines, host=first_error.host, rank=first_error.rank,
        hosts=tuple(missing), ranks=tuple(sorted(r for h in missing for _, r, _, _ in failed[h])),
        origin=first_error.log, captures={"path": path},
    )


_ENDPOINT = re.compile(r"^\(?\[?(?P<host>[^\s,()\[\]]+?)\]?(?:, |:)(?P<port>\d+)\)?$")
_LOOPBACK = re.compile(r"^(?:localhost|127\.\d+\.\d+\.\d+|::1|0\.0\.0\.0)$", re.IGNORECASE)


def own_rendezvous(diag: Diagnosis, record: Mapping[str, Any]) -> Diagnosis:
    """A rank of a multi-node corral run that cannot reach a store on a loopback
    address was not pointed there by corral:
    the script sets MASTER_ADDR / MASTER_PORT itself (the PyTorch DDP tutorial's
    ``setup()``), so every node looks for the store on itself."""
    if diag.rule_id != "store-unreachable" or "endpoint" not in diag.captures:
        return diag
    m = _ENDPOINT.match(diag.captures["endpoint"].strip())
    addr, port = record.get("master_addr"), record.get("master_port")
    if m is None or not isinstance(addr, str) or not isinstance(port, int):
        return diag
    if len(set(rank_hosts(record).values())) < 2 or _LOOPBACK.match(addr):
        return diag
    if not _LOOPBACK.match(m["host"]):  # another host or port may be torchrun's own choice
        return diag
    step = (f"The ranks connect to {m['host']}:{m['port']}, but corral started the store at {addr}:{port} "
            "and passed it as MASTER_ADDR / MASTER_PORT: the script overrides them (e.g. "
            f"os.environ['MASTER_ADDR'] = '{m['host']}' / os.environ['MASTER_PORT'] = '{m['port']}', "
            "or init_method='tcp://...'). Remove those lines and call init_process_group(backend) "
            "without init_method; RANK, WORLD_SIZE and LOCAL_RANK come from the environment too.")
    return replace(
        diag,
        title=(f"The script sets its own MASTER_ADDR/MASTER_PORT ({m['host']}:{m['port']}), "
               f"not corral's rendezvous store ({addr}:{port})"),
        cause=("Every rank of this multi-node run tried to reach a store at an address the script chose, "
               f"not at {addr}:{port} where corral's launcher started it. "
               + "On a loopback address each node looks for the store on itself, where nothing listens "
               "(on one machine the same code works, which is why tutorials write it). " + diag.cause),
        fix=(step, *diag.fix),
    )
