"""Which failures --max-restarts restarts, and which nodes a restarted job runs on.

The judging is fed real agent events through a real ``JobWatch`` (the ranks'
lines, their exits), as the run loop feeds it; the regrouping is a pure
function of the nodes, the lost ones and the spares.  The same on the sandbox,
end to end: tests/test_multinode.py (a node stopped mid-run).
"""

from __future__ import annotations

import asyncio

import pytest

from corral.errors import HostError, PreflightError, UsageError
from corral.model import Cluster, Host
from corral.run.plan import NodeFacts, RunSpec, build_plan
from corral.run.recovery import (
    NotEnoughNodes,
    Recovery,
    RecoveryOptions,
    RestartGate,
    check_checkpoint_dir,
    hosts_in_error,
    judge,
    regroup,
)
from corral.run.watch import Failure, JobWatch


def watch() -> JobWatch:
    c = Cluster(hosts=(Host(name="a", slots=2), Host(name="b", slots=2)))
    plan = build_plan(c, RunSpec(program="t.py", run_id="r"), {"a": NodeFacts(), "b": NodeFacts()},
                      master_addr="10.0.0.1", master_port=1, head_env={}, head_cwd="/")
    return JobWatch(plan, sinks=[])


def traceback(*frames: tuple[str, int], exc: str) -> list[str]:
    lines = ["[rank1]: Traceback (most recent call last):"]
    for path, line in frames:
        lines += [f'[rank1]:   File "{path}", line {line}, in <module>', "[rank1]:     x()"]
    return lines + [f"[rank1]: {exc}"]


def failed_rank(w: JobWatch, lines: list[str], *, code: int = 1, exc: str | None = None) -> None:
    """Rank 1 on node a prints ``lines`` and exits with ``code``."""
    for text in lines:
        w.event("a", {"ev": "line", "r": 1, "s": "err", "t": text})
    w.event("a", {"ev": "rank_exit", "r": 1, "code": code, "exc": exc})


# ---------------------------------------------------------------------------
# judging one failure


def test_failures_a_restart_can_get_past_are_restarted() -> None:
    assert judge(Failure(host="b", rank=None, kind="lost", reason="no heartbeat"), []).restart
    assert judge(Failure(host="b", rank=3, kind="signal", signal=9), []).restart  # the OOM killer
    assert judge(Failure(host="b", rank=3, kind="exit", code=137), []).restart  # the same, through a shell
    assert judge(Failure(host="b", rank=None, kind="hang", code=124), []).restart
    # an echo of a vanished peer, and a timeout in the rank's own exception
    assert judge(Failure(host="b", rank=3, kind="exit", code=1, consequential=True,
                         exc="RuntimeError: Connection closed by peer"), []).restart
    timeout = traceback(("/w/train.py", 9), exc="torch.distributed.DistBackendError: [Rank 1] Watchdog caught "
                                                "collective operation timeout: WorkNCCL(SeqNum=7)")
    verdict = judge(Failure(host="a", rank=1, kind="exit", code=1), timeout)
    assert verdict.restart and verdict.signature is None  # restarted however often it repeats


def test_an_error_in_the_program_itself_is_not_restarted() -> None:
    for exc in ("ModuleNotFoundError: No module named 'datasets'", "SyntaxError: invalid syntax",
                "NameError: name 'modle' is not defined"):
        verdict = judge(Failure(host="a", rank=1, kind="exit", code=1),
                        traceback(("/w/train.py", 3), exc=exc))
        assert not verdict.restart, exc
        assert exc.split(":")[0] in verdict.what and "train.py:3" in verdict.what
    start = judge(Failure(host="a", rank=None, kind="start", reason="python9: not found", code=127), [])
    assert not start.restart and "python9: not found" in start.what


def test_an_ordinary_exception_is_restarted_once_and_ends_the_restarts_when_it_repeats() -> None:
    gate = RestartGate()
    boom = traceback(("/w/train.py", 40), ("/w/data.py", 12), exc="ValueError: shard 7 is empty")
    first = gate.decide(Failure(host="a", rank=1, kind="exit", code=1), boom, attempt=1)
    assert first.restart and first.signature == ("ValueError: shard 7 is empty", "/w/data.py:12")
    # raised elsewhere, or with another message: a different failure, restarted
    assert gate.decide(Failure(host="a", rank=1, kind="exit", code=1),
                       traceback(("/w/train.py", 40), ("/w/data.py", 13), exc="ValueError: shard 7 is empty"),
                       attempt=2).restart
    assert gate.decide(Failure(host="b", rank=3, kind="exit", code=1),
                       traceback(("/w/train.py", 40), ("/w/data.py", 12), exc="ValueError: shard 8 is empty"),
                       attempt=3).restart
    # the same line at the same place as attempt 1, on another rank: not again
    again = gate.decide(Failure(host="b", rank=2, kind="exit", code=1), boom, attempt=4)
    assert not again.restart
    assert "ValueError: shard 7 is empty at data.py:12 again, as in attempt 1" in again.what


def test_the_run_loop_judges_the_root_cause_and_says_why_it_stops_once() -> None:
    said: list[str] = []
    recovery = Recovery(Cluster(hosts=(Host(name="a"), Host(name="b"))), RecoveryOptions(), tag="r",
                        max_restarts=5, connect_timeout=1, node_timeout=3, say=said.append)
    boom = traceback(("/w/train.py", 8), exc="ValueError: bad batch")
    for attempt in (1, 2):
        w = watch()
        failed_rank(w, boom, exc="ValueError: bad batch")
        # the others only saw their peer vanish
        w.event("b", {"ev": "rank_exit", "r": 2, "code": 1, "exc": "RuntimeError: Connection closed by peer"})
        assert recovery.judge(w, attempt) is (attempt == 1)
    assert said == ["not restarting (4 of --max-restarts 5 unused): ValueError: bad batch at train.py:8 again, "
                    "as in attempt 1: the same exception at the same place, where a restart would fail once more"]
    assert recovery.record()["not_restarted"] == said[0]


def test_an_exit_code_without_a_traceback_is_judged_by_its_code() -> None:
    gate = RestartGate()
    assert gate.decide(Failure(host="a", rank=1, kind="exit", code=5), ["loss 0.3"], attempt=1).restart
    assert gate.decide(Failure(host="a", rank=1, kind="exit", code=6), ["loss 0.3"], attempt=2).restart
    assert not gate.decide(Failure(host="a", rank=0, kind="exit", code=5), ["loss 0.2"], attempt=3).restart


# ---------------------------------------------------------------------------
# the nodes of the next attempt


def hosts(*names: str, spare: bool = False) -> tuple[Host, ...]:
    return tuple(Host(name=n, spare=spare) for n in names)


def test_a_spare_takes_the_lost_nodes_place_and_the_others_keep_their_ranks() -> None:
    nodes, swaps = regroup(hosts("n1", "n2", "n3", "n4"), {"n2"}, hosts("s1", "s2", spare=True), min_nodes=None)
    assert [h.name for h in nodes] == ["n1", "s1", "n3", "n4"]
    assert swaps == {"n2": "s1"}
    assert not any(h.spare for h in nodes)  # a node of the job from now on


def test_without_a_spare_the_job_goes_on_smaller_down_to_min_nodes() -> None:
    nodes, swaps = regroup(hosts("n1", "n2", "n3", "n4"), {"n1", "n3"}, hosts("s1", spare=True), min_nodes=3)
    assert [h.name for h in nodes] == ["s1", "n2", "n4"] and swaps == {"n1": "s1", "n3": None}
    with pytest.raises(NotEnoughNodes) as err:
        regroup(hosts("n1", "n2", "n3", "n4"), {"n2", "n3"}, (), min_nodes=3)
    assert "n[2-3] lost and not back" in err.value.message
    assert "2 node(s) left (n[1,4]), fewer than --min-nodes 3" in err.value.message
    assert "spare = true" in (err.value.hint or "") and err.value.exit_code == 3
    with pytest.raises(NotEnoughNodes, match=r"n3 lost .* fewer than the 3 it ran on \(--min-nodes M lets"):
        regroup(hosts("n1", "n2", "n3"), {"n3"}, (), min_nodes=None)


def test_spares_are_held_back_when_the_job_starts() -> None:
    c = Cluster(hosts=(*hosts("n1", "n2"), *hosts("s1", spare=True)))
    recovery = Recovery(c, RecoveryOptions(min_nodes=2), tag="r", max_restarts=1, connect_timeout=1,
                        node_timeout=3, say=print)
    assert recovery.cluster.names == ["n1", "n2"] and [s.name for s in recovery.spares] == ["s1"]
    assert recovery.can_regroup
    with pytest.raises(UsageError, match="--min-nodes 3, but the job starts on 2 node"):
        Recovery(c, RecoveryOptions(min_nodes=3), tag="r", max_restarts=1, connect_timeout=1, node_timeout=3,
                 say=print)


def test_a_lost_node_that_answers_again_keeps_its_place() -> None:
    """Reconnecting to a node that is there (this machine, local transport)."""
    said: list[str] = []
    c = Cluster(hosts=(Host(name="localhost", local=True),))
    recovery = Recovery(c, RecoveryOptions(min_nodes=1, rejoin_timeout=5), tag="r", max_restarts=1,
                        connect_timeout=5, node_timeout=10, say=said.append)
    after = asyncio.run(recovery.regroup({"localhost"}, 2, asyncio.Event(), lambda: False))
    assert after.names == ["localhost"] and not recovery.excluded
    assert said[-1] == "localhost answers again: restarting on all 1 nodes"


def test_the_script_is_told_the_attempt_its_checkpoint_and_what_changed() -> None:
    c = Cluster(hosts=hosts("n1", "n2", "n3"))
    recovery = Recovery(c, RecoveryOptions(min_nodes=2, checkpoint_dir="/shared/ckpt"), tag="r",
                        max_restarts=2, connect_timeout=1, node_timeout=3, say=print)
    assert recovery.env(1) == {"CORRAL_ATTEMPT": "1", "CORRAL_MAX_RESTARTS": "2",
                               "CORRAL_CHECKPOINT_DIR": "/shared/ckpt"}
    plan = build_plan(c, RunSpec(program="t.py", run_id="r", nproc_per_node=2),
                      {n: NodeFacts() for n in c.names}, master_addr="10.0.0.1", master_port=1,
                      head_env={}, head_cwd="/")
    recovery.started(plan, 1)
    env = recovery.env(2)
    assert env["CORRAL_RESUME_DIR"] == "/shared/ckpt" and env["CORRAL_PREVIOUS_ATTEMPT"] == "1"
    assert env["CORRAL_PREVIOUS_WORLD_SIZE"] == "6" and "CORRAL_EXCLUDED_HOSTS" not in env
    assert recovery.record()["attempt_hosts"] == {"1": ["n1", "n2", "n3"]}


def test_bad_checkpoint_dirs_and_unreachable_hosts() -> None:
    for bad in ("~/ckpt", "", "a\nb"):
        with pytest.raises(UsageError, match="--checkpoint-dir"):
            check_checkpoint_dir(bad)
    check_checkpoint_dir("ckpt")  # relative to the work dir
    error = PreflightError([HostError("n2", "unreachable"), HostError("n4", "refused")], what="connecting")
    assert hosts_in_error(error) == {"n2", "n4"}
    assert hosts_in_error(PreflightError([HostError("n2", "no torch")], what="preflight")) == set()
