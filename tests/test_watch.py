"""Root-cause selection from agent events, the way an engineer reads logs."""

from __future__ import annotations

from corral.model import Cluster, Host
from corral.run.plan import NodeFacts, RunSpec, build_plan
from corral.run.watch import JobWatch


def watch(launcher: str = "torchrun") -> JobWatch:
    c = Cluster(hosts=(Host(name="a", slots=2), Host(name="b", slots=2)))
    plan = build_plan(c, RunSpec(program="t.py", run_id="r", launcher=launcher),
                      {"a": NodeFacts(), "b": NodeFacts()},
                      master_addr="10.0.0.1", master_port=1, head_env={}, head_cwd="/")
    return JobWatch(plan, sinks=[])


def test_own_error_beats_peers_that_saw_it_first() -> None:
    w = watch()
    # Rank 0 reports first, but only because its peer vanished.
    w.event("a", {"ev": "rank_exit", "r": 0, "code": 1,
                  "exc": "torch.distributed.DistBackendError: Connection closed by peer [10.0.0.2]:123"})
    w.event("b", {"ev": "rank_exit", "r": 3, "code": 1, "exc": "RuntimeError: CUDA error: illegal memory access"})
    cause = w.root_cause()
    assert (cause.host, cause.rank) == ("b", 3)
    assert "illegal memory access" in cause.describe()


def test_first_observed_wins_among_equals() -> None:
    w = watch()
    w.event("b", {"ev": "rank_exit", "r": 2, "code": 2, "exc": "ValueError: x"})
    w.event("a", {"ev": "rank_exit", "r": 1, "code": 3, "exc": "KeyError: y"})
    assert w.root_cause().rank == 2


def test_terminated_rank_is_not_a_failure_when_its_node_succeeds() -> None:
    w = watch()
    w.event("a", {"ev": "rank_exit", "r": 1, "code": None, "sig": 15, "exc": None})
    w.event("a", {"ev": "exit", "code": 0, "sig": None})
    assert not w.failed


def test_terminated_rank_counts_when_its_node_fails() -> None:
    w = watch()
    w.event("a", {"ev": "rank_exit", "r": 1, "code": None, "sig": 15, "exc": None})
    w.event("a", {"ev": "exit", "code": 1, "sig": None})
    assert w.failed and w.root_cause().rank == 1


def test_lost_node_and_teardown_victims() -> None:
    w = watch()
    w.lose("b", "no heartbeat for 10s")
    w.stopping = True
    w.event("a", {"ev": "rank_exit", "r": 0, "code": None, "sig": 9, "exc": None})
    cause = w.root_cause()
    assert cause.kind == "lost" and cause.host == "b" and len(w.failures) == 1
    assert "b was lost" in cause.describe()


def test_tail_is_the_traceback() -> None:
    w = watch()
    for line in ["step 1", "step 2", "[rank1]: Traceback (most recent call last):", "[rank1]:   File x", "[rank1]: ValueError: v"]:
        w.event("a", {"ev": "line", "r": 1, "s": "log", "t": line})
    w.event("a", {"ev": "rank_exit", "r": 1, "code": 1, "exc": "ValueError: v"})
    assert w.tail_for(w.root_cause())[0].endswith("Traceback (most recent call last):")


#: torchrun 2.x's summary, as a node's launcher printed it (tests/test_preload.py run, 2026-11-23).
TORCHRUN_SUMMARY = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
probe.py FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-23_07:35:46
  host      : vm
  rank      : 3 (local_rank: 1)
  exitcode  : {code} (pid: 27831)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================"""


def test_rank_reaped_before_the_agent_looked_is_named_from_torchruns_summary() -> None:
    w = watch()
    # The agent saw the rank go, but torchrun had already reaped it: no status;
    # its peer was terminated by torchrun's teardown.
    w.event("b", {"ev": "rank_exit", "r": 3, "code": None, "sig": None, "exc": None})
    w.event("b", {"ev": "rank_exit", "r": 2, "code": None, "sig": 15, "exc": None})
    for line in TORCHRUN_SUMMARY.format(code=7).splitlines():
        w.event("b", {"ev": "line", "r": None, "t": line})
    w.event("b", {"ev": "exit", "code": 1, "sig": None})
    cause = w.root_cause()
    assert (cause.host, cause.rank, cause.code, cause.exit_code) == ("b", 3, 7, 7)
    assert cause.describe() == "rank 3 on b exited with code 7"


def test_torchruns_summary_signal_and_no_summary() -> None:
    w = watch()
    for line in TORCHRUN_SUMMARY.format(code=-9).splitlines():
        w.event("a", {"ev": "line", "r": None, "t": line})
    w.event("a", {"ev": "exit", "code": 1, "sig": None})
    cause = w.root_cause()
    assert (cause.rank, cause.signal, cause.exit_code) == (3, 9, 137)
    w = watch()
    w.event("a", {"ev": "line", "r": None, "t": "Traceback: something else"})
    w.event("a", {"ev": "exit", "code": 1, "sig": None})
    assert w.root_cause().rank is None


def _lines(w: JobWatch, host: str, rank: int, text: str) -> None:
    for line in text.splitlines():
        w.event(host, {"ev": "line", "r": rank, "s": "err", "t": line})


def test_lightning_main_process_is_its_nodes_first_rank() -> None:
    # Lightning: corral starts local rank 0 (global rank 2 on b), which spawns
    # rank 3.  Rank 2 raises; Lightning's child sees its peer vanish and is
    # terminated.  The child reports first (its hook), the main process only
    # as the node's exit: the main process's own error is still the cause.
    w = watch("lightning")
    _lines(w, "b", 2, "Epoch 0:  10%\n[rank2]: Traceback (most recent call last):\n"
                      '[rank2]:   File "train.py", line 9, in training_step\n'
                      "[rank2]:     raise ValueError('bad batch on global rank 2')\n"
                      "[rank2]: ValueError: bad batch on global rank 2")
    w.event("b", {"ev": "rank_exit", "r": 3, "code": None, "sig": 15,
                  "exc": "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] "
                         "Connection closed by peer [10.0.0.2]:4321"})
    w.stopping = True  # the child's report already started the teardown
    w.event("b", {"ev": "exit", "code": 1, "sig": None})
    cause = w.root_cause()
    assert (cause.host, cause.rank, cause.exit_code) == ("b", 2, 1)
    assert cause.describe() == "rank 2 on b failed: ValueError: bad batch on global rank 2 (exited with code 1)"
    assert w.tail_for(cause)[-1] == "[rank2]: ValueError: bad batch on global rank 2"


def test_command_launcher_node_exit_names_its_rank_and_keeps_its_output() -> None:
    w = watch("command")
    _lines(w, "a", 0, "bash: line 1: exec: python: not found")
    w.event("a", {"ev": "exit", "code": 127, "sig": None})
    cause = w.root_cause()
    assert (cause.host, cause.rank, cause.exit_code) == ("a", 0, 127)
    assert w.tail_for(cause) == ["bash: line 1: exec: python: not found"]


def test_node_process_terminated_from_outside_is_not_the_cause() -> None:
    w = watch("lightning")
    w.event("a", {"ev": "rank_exit", "r": 1, "code": 1, "exc": "KeyError: 'batch_size'"})
    w.event("b", {"ev": "exit", "code": None, "sig": 15})
    assert w.root_cause().rank == 1


def test_node_process_stopped_by_the_teardown_is_not_the_cause() -> None:
    # Rank 1 failed; stopping node b made its Lightning main process raise
    # SIGTERMException (exit 1) or just exit: neither is blamed.
    stopped = ("Traceback (most recent call last):\n  File \"x.py\", line 1\n"
               "lightning.pytorch.utilities.exceptions.SIGTERMException")
    for text, code in ((stopped, 1), ("", 1)):
        w = watch("lightning")
        w.event("a", {"ev": "rank_exit", "r": 1, "code": None, "sig": 15,
                      "exc": "RuntimeError: Connection closed by peer [10.0.0.2]:1"})
        w.stopping = True
        _lines(w, "b", 2, text)
        w.event("b", {"ev": "exit", "code": code, "sig": None})
        assert w.root_cause().rank == 1


def test_a_caught_traceback_is_kept_per_rank() -> None:
    # A script that prints a traceback and goes on (or exits 0): the run
    # succeeds, and the summary says which rank printed what.
    w = watch()
    lines = {0: ["step 1", "Traceback (most recent call last):", '  File "t.py", line 3, in <module>',
                 "    open(p)", "FileNotFoundError: [Errno 2] No such file: 'x'", "",
                 "During handling of the above exception, another exception occurred:", "",
                 "Traceback (most recent call last):", "RuntimeError: second"],
             1: ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "t.py", line 9, in f',
                 "[rank1]: ValueError: bad shard"],
             2: ["Traceback (most recent call last) is a phrase in this line"]}
    for rank, texts in lines.items():
        for text in texts:
            w.event("a" if rank < 2 else "b", {"ev": "line", "r": rank, "s": "log", "t": text})
    assert w.tracebacks == {("a", 0): "FileNotFoundError: [Errno 2] No such file: 'x'",
                            ("a", 1): "ValueError: bad shard"}


def test_rank_that_left_no_exception_is_named_after_a_peers_echo_came_first() -> None:
    # A rank on b dies without a word (its disk is full, or sys.exit(1)) and
    # torchrun reaps it before the agent looks; a's rank sees the peer vanish
    # and reports first, so the job is already stopping when b's torchrun
    # names its rank: that rank is the cause, not a's echo.
    w = watch()
    w.event("a", {"ev": "rank_exit", "r": 1, "code": 1,
                  "exc": "RuntimeError: [pair.cc:553] Connection closed by peer [10.0.0.2]:26028"})
    assert w.root_cause().consequential
    w.stopping = True
    w.event("b", {"ev": "rank_exit", "r": 3, "code": None, "sig": None, "exc": None})
    for line in TORCHRUN_SUMMARY.format(code=1).splitlines():
        w.event("b", {"ev": "line", "r": None, "t": line})
    w.event("b", {"ev": "exit", "code": 1, "sig": None})
    cause = w.root_cause()
    assert (cause.host, cause.rank, cause.code) == ("b", 3, 1)
    assert not cause.consequential


def test_ranks_the_teardown_terminated_are_not_named_from_torchruns_summary() -> None:
    w = watch()
    w.event("a", {"ev": "rank_exit", "r": 1, "code": 1,
                  "exc": "RuntimeError: Connection closed by peer [10.0.0.2]:26028"})
    w.stopping = True
    for line in TORCHRUN_SUMMARY.format(code=-15).splitlines():
        w.event("b", {"ev": "line", "r": None, "t": line})
    w.event("b", {"ev": "exit", "code": 1, "sig": None})
    assert (w.root_cause().host, w.root_cause().rank) == ("a", 1)


def test_a_traceback_the_script_printed_itself_names_its_exit() -> None:
    """`traceback.print_exc(); os._exit(1)` (NVIDIA's torchrun_main around
    @record): no uncaught exception for the hook to record, but the rank's
    last lines are a traceback; the summary names its exception, not only
    "exited with code 1".  A signal death keeps its own story."""
    w = watch()
    _lines(w, "b", 3, "Traceback (most recent call last):\n  File \"t.py\", line 9, in main\n"
                      "    raise KeyError(\"missing 'labels' in batch\")\nKeyError: \"missing 'labels' in batch\"")
    w.event("b", {"ev": "rank_exit", "r": 3, "code": 1, "sig": None, "exc": None})
    cause = w.root_cause()
    assert cause.rank == 3 and "failed: KeyError: \"missing 'labels' in batch\"" in cause.describe()
    w = watch()
    _lines(w, "b", 2, "Traceback (most recent call last):\n  File \"t.py\", line 1\nValueError: caught earlier")
    w.event("b", {"ev": "rank_exit", "r": 2, "code": None, "sig": 9, "exc": None})
    assert "ValueError" not in w.root_cause().describe()


def test_the_failure_summary_cannot_carry_a_ranks_terminal_controls() -> None:
    w = watch()
    osc52 = "\x1b]52;c;ZWNobyBwd25lZA==\x1b\\"
    w.event("a", {"ev": "line", "r": 1, "s": "log", "t": "Traceback (most recent call last):"})
    w.event("a", {"ev": "line", "r": 1, "s": "log", "t": f"ValueError: bad{osc52}\x1b]0;title\x07"})
    w.event("a", {"ev": "rank_exit", "r": 1, "code": 1, "exc": f"ValueError: bad{osc52}"})
    cause = w.root_cause()
    assert cause.describe() == "rank 1 on a failed: ValueError: bad (exited with code 1)"
    assert w.tail_for(cause) == ["Traceback (most recent call last):", "ValueError: bad"]
