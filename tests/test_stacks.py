"""Stacks of every rank merged into one tree; a planted hang names its rank."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from corral.diagnose.stacks import (
    fold_keys,
    fold_ranks,
    main_stack,
    never_met_note,
    parse_key,
    stack_report,
)

CORRAL = [sys.executable, "-m", "corral"]

_DUMPER = """
import faulthandler, sys, threading, time
def helper():
    time.sleep(30)
threading.Thread(target=helper, daemon=True).start()
def {func}():
    faulthandler.dump_traceback(all_threads=True)
    sys.stderr.flush()
def outer():
    {func}()
time.sleep(0.2)
outer()
"""


def real_dump(func: str) -> str:
    """A real faulthandler dump (two threads) from a real interpreter."""
    res = subprocess.run([sys.executable, "-c", _DUMPER.format(func=func)], capture_output=True, text=True,
                         timeout=30)
    return res.stderr


def test_main_thread_is_found_and_ordered_outermost_first() -> None:
    frames = main_stack(real_dump("in_allreduce"))
    assert [f.func for f in frames] == ["<module>", "outer", "in_allreduce"]


def test_preloaded_ranks_show_the_scripts_frames_not_the_zygotes() -> None:
    # A preloaded rank runs the script from the zygote's code (<string>); a
    # `python -c` program is all <string> and keeps its frames.
    dump = ("Thread 0x01 (most recent call first):\n"
            '  File "/w/train.py", line 9 in read_shard\n'
            '  File "/w/train.py", line 20 in <module>\n'
            '  File "<string>", line 323 in run_script\n'
            '  File "<string>", line 53 in <module>\n')
    assert [(f.file, f.func) for f in main_stack(dump)] == [("/w/train.py", "<module>"),
                                                            ("/w/train.py", "read_shard")]
    assert [f.func for f in main_stack(real_dump("x"))] == ["<module>", "outer", "x"]


def test_merge_groups_identical_stacks_and_singles_out_the_odd_rank() -> None:
    dumps = {r: real_dump("in_allreduce") for r in (0, 1, 2, 4, 5)}
    dumps[3] = real_dump("in_dataloader")
    lines, odd = stack_report(dumps, world_size=7)
    text = "\n".join(lines)
    assert odd == {3}
    assert "ranks 0-5" in text  # the shared trunk
    assert any("in_allreduce" in ln and ln.endswith("ranks 0-2,4-5") for ln in lines), text
    assert any("in_dataloader" in ln and ln.endswith("rank 3") for ln in lines), text
    assert "no stack from rank 6" in text


def _dump(*frames: tuple[str, int, str]) -> str:
    """A faulthandler dump of one thread; frames outermost first."""
    lines = ["Current thread 0x01 (most recent call first):"]
    lines += [f'  File "{file}", line {line} in {func}' for file, line, func in reversed(frames)]
    return "\n".join(lines) + "\n"


_TORCH = "/venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py"


def test_ranks_outside_any_collective_are_the_culprits_even_when_most() -> None:
    """Rank 0 waits in all_reduce; ranks 1-2 loop waiting for a file only node 0
    has: the many ranks outside the collective are what it waits for."""
    in_collective = _dump(("/w/prep.py", 16, "<module>"), (_TORCH, 81, "wrapper"),
                          ("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 2950,
                           "all_reduce"))
    waiting_for_file = _dump(("/w/prep.py", 14, "<module>"), ("/w/prep.py", 9, "wait_for_data"))
    lines, odd = stack_report({0: in_collective, 1: waiting_for_file, 2: waiting_for_file}, world_size=3)
    assert odd == {1, 2}, "\n".join(lines)
    # every rank in a collective, but not the same one: the rank in the other one stands out
    other = _dump(("/w/prep.py", 16, "<module>"), (_TORCH, 81, "wrapper"),
                  ("/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", 3100,
                   "all_gather_object"))
    _, odd = stack_report({0: other, 1: in_collective, 2: in_collective}, world_size=3)
    assert odd == {0}
    # a rank still in backward (DDP's all-reduce) waits too
    backward = _dump(("/w/train.py", 30, "<module>"), ("/venv/lib/python3.11/site-packages/torch/_tensor.py", 626,
                                                       "backward"),
                     ("/venv/lib/python3.11/site-packages/torch/autograd/graph.py", 823, "_engine_run_backward"))
    loader = _dump(("/w/train.py", 28, "<module>"), ("/w/train.py", 12, "load_batch"))
    _, odd = stack_report({0: backward, 1: backward, 2: loader, 3: backward}, world_size=4)
    assert odd == {2}


def test_every_rank_inside_init_process_group_never_met() -> None:
    # a real 3-node hang: init_method="file:///tmp/ddp_example", a different file on each node
    from corral.diagnose.hang import parse_stacks_file

    stacks_file = Path(__file__).parent / "fixtures" / "diagnose" / "run-hang-init-filestore" / "stacks-230959.txt"
    dumps = parse_stacks_file(stacks_file.read_text())
    assert sorted(dumps) == [0, 1, 2]
    note = never_met_note(dumps, world_size=3)
    assert note is not None and note.startswith("Every rank is still inside init_process_group: the ranks never met")
    assert never_met_note(dumps, world_size=4) is None  # rank 3 left no stack: look at it instead
    elsewhere = {**dumps, 2: real_dump("load_batch")}
    assert never_met_note(elsewhere, world_size=3) is None


def test_fold_ranks() -> None:
    assert fold_ranks({0, 1, 2, 4, 6, 7}) == "ranks 0-2,4,6-7"
    assert fold_ranks({5}) == "rank 5"


_SPAWNER = [("/w/train_net.py", 40, "<module>"), ("/w/train_net.py", 30, "launch"),
            ("/venv/torch/multiprocessing/spawn.py", 340, "start_processes"),
            ("/venv/torch/multiprocessing/spawn.py", 180, "join"),
            ("/usr/lib/python3.11/multiprocessing/connection.py", 947, "wait")]
_WORKER = [("<string>", 1, "<module>"), ("/usr/lib/python3.11/multiprocessing/spawn.py", 122, "spawn_main"),
           ("/usr/lib/python3.11/multiprocessing/spawn.py", 135, "_main"),
           ("/venv/torch/multiprocessing/spawn.py", 90, "_wrap"), ("/w/train_net.py", 20, "main")]


def test_a_rank_waiting_in_mp_spawn_is_shown_by_its_workers() -> None:
    in_step = _WORKER + [("/w/train_net.py", 12, "train_step"),
                         ("/venv/torch/distributed/c10d_logger.py", 81, "wrapper")]
    loading = _WORKER + [("/w/train_net.py", 7, "load_shard")]
    tracker = [("<string>", 1, "<module>"), ("/usr/lib/python3.11/multiprocessing/resource_tracker.py", 227, "main")]
    dumps = {0: _dump(*_SPAWNER), parse_key("0/4700"): _dump(*tracker),
             parse_key("0/4711"): _dump(*in_step), parse_key("0/4712"): _dump(*loading),
             1: _dump(*_SPAWNER), parse_key("1/5001"): _dump(*in_step), parse_key("1/5002"): _dump(*in_step)}
    lines, odd = stack_report(dumps, world_size=2)
    tree = "\n".join(lines)
    # The processes are numbered in the order they started, per rank; the
    # spawning ranks, which only wait, and multiprocessing's resource tracker
    # are not in the tree.
    assert any("load_shard train_net.py:7" in ln and ln.endswith("rank 0 worker 1") for ln in lines), tree
    assert any("wrapper c10d_logger.py:81" in ln and ln.endswith("rank 0 worker 0, rank 1 workers 0-1")
               for ln in lines), tree
    assert "join spawn.py" not in tree and "resource_tracker" not in tree and "no stack from" not in tree, tree
    assert odd == {(0, 1)}
    assert fold_keys(odd) == "rank 0 worker 1"


def test_a_busy_ranks_helper_processes_are_left_out() -> None:
    training = [("/w/train.py", 50, "<module>"), ("/w/train.py", 12, "train_step")]
    helper = [("/w/tools/convert.py", 3, "<module>"), ("/w/tools/convert.py", 9, "convert")]
    lines, odd = stack_report({0: _dump(*training), 1: _dump(*training), parse_key("1/777"): _dump(*helper)},
                              world_size=2)
    assert "convert" not in "\n".join(lines) and odd == set()
    assert lines[0].endswith("ranks 0-1")


HANG = """
    import os, time
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    def load_batch():
        time.sleep(3600)          # the planted hang
    def train_step():
        dist.all_reduce(torch.ones(1))
    train_step()
    print("warmed up", flush=True)
    if dist.get_rank() == {rank}:
        load_batch()
    train_step()
"""


def test_hang_timeout_dumps_the_tree_and_stops(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text(textwrap.dedent(HANG.format(rank=1)))
    res = subprocess.run(CORRAL + ["run", "--hang-timeout", "10", "--json", "hang.py"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 124, res.stderr[-2000:]
    out = json.loads(res.stdout[res.stdout.index("{\n"):])
    tree = "\n".join(out["stacks"])
    assert any("load_batch hang.py:6" in ln and ln.endswith("rank 1") for ln in out["stacks"]), tree
    assert any("all_reduce" in ln and ln.endswith("rank 0") for ln in out["stacks"]), tree
    stacks_file = next(Path(out["run_dir"]).glob("stacks-*.txt"))
    assert "load_batch" in stacks_file.read_text()


def test_corral_stacks_on_a_running_job(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text(textwrap.dedent(HANG.format(rank=0)))
    proc = subprocess.Popen(CORRAL + ["run", "hang.py"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        answer = None
        while time.monotonic() < deadline:
            time.sleep(1)
            res = subprocess.run(CORRAL + ["stacks", "--json"], cwd=tmp_path, capture_output=True, text=True,
                                 timeout=60)
            if res.returncode == 0 and len(json.loads(res.stdout)["stacks"]) == 2:
                answer = json.loads(res.stdout)["stacks"]
                if "load_batch" in answer["0"]:
                    break
        assert answer and "load_batch" in answer["0"] and "all_reduce" in answer["1"], answer
        res = subprocess.run(CORRAL + ["stacks"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert "rank 0" in res.stdout and "load_batch" in res.stdout
        # the flight recorder too: rank 1 waits in collective #2, which rank 0 never entered
        assert "rank 0 (" in res.stdout and "never entered #2 all_reduce (its last: #1 all_reduce)" in res.stdout, (
            res.stdout)
        assert next((tmp_path / "runs").iterdir()).joinpath("flightrec", "index.json").is_file()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    # Named by id: without one, `corral stacks` would go on to any other run
    # of this user alive on the machine (found by its control socket).
    run_id = next((tmp_path / "runs").iterdir()).name
    res = subprocess.run(CORRAL + ["stacks", run_id], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and f"run {run_id} is not running" in res.stderr, res.stderr


def test_corral_stacks_from_another_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the run's directory is under where `corral run` was started; a second shell is elsewhere
    monkeypatch.delenv("CORRAL_RUNS_DIR")  # the ./runs default, as outside the tests
    started, elsewhere = tmp_path / "project", tmp_path / "home"
    started.mkdir()
    elsewhere.mkdir()
    (started / "hang.py").write_text(textwrap.dedent(HANG.format(rank=0)))
    proc = subprocess.Popen(CORRAL + ["run", "hang.py"], cwd=started, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not list((started / "runs").glob("*/run.json")):
            time.sleep(0.5)
        run_id = next((started / "runs").glob("*/run.json")).parent.name
        res = None
        while time.monotonic() < deadline:
            time.sleep(1)
            res = subprocess.run(CORRAL + ["stacks", run_id[:15], "--json"], cwd=elsewhere, capture_output=True,
                                 text=True, timeout=60, check=False)
            if res.returncode == 0 and "load_batch" in json.loads(res.stdout)["stacks"].get("0", ""):
                break
        assert res is not None and res.returncode == 0, res and res.stderr
        assert json.loads(res.stdout)["run_id"] == run_id
        assert f"run {run_id} is not in {elsewhere / 'runs'}: found it by its control socket" in res.stderr
    finally:
        proc.terminate()
        proc.communicate(timeout=60)


@pytest.mark.sandbox
def test_planted_hang_on_the_sandbox_names_the_rank(sandbox) -> None:
    repo = Path(__file__).resolve().parents[1]
    work = repo / "scratch" / f"hang-{time.monotonic_ns()}"
    work.mkdir(parents=True)
    try:
        (work / "hang.py").write_text(textwrap.dedent(HANG.format(rank=5)))
        res = subprocess.run(CORRAL + ["run", "-c", str(sandbox.cluster_file), "--hang-timeout", "15", "hang.py"],
                             cwd=work, capture_output=True, text=True, timeout=240)
        assert res.returncode == 124, res.stderr[-3000:]
        node3 = sandbox.nodes[2]
        assert "rank 5 elsewhere than the others" in res.stderr
        assert any("load_batch" in ln and ln.rstrip().endswith("rank 5") for ln in res.stderr.splitlines())
        assert any("all_reduce" in ln and ln.rstrip().endswith("ranks 0-4,6-7") for ln in res.stderr.splitlines())
        assert node3  # rank 5 lives on the third node (2 ranks per node)
    finally:
        import shutil
        shutil.rmtree(work, ignore_errors=True)


SPAWN_HANG = """
    import os, sys, time
    import torch, torch.distributed as dist, torch.multiprocessing as mp
    def load_shard():
        time.sleep(3600)          # the planted hang, in mp.spawn process 1
    def worker(i, n):
        os.environ.update(RANK=str(i), WORLD_SIZE=str(n), MASTER_PORT=str(int(os.environ["MASTER_PORT"]) + 1))
        dist.init_process_group("gloo", rank=i, world_size=n)
        dist.all_reduce(torch.ones(1))
        print("worker", i, "warmed up", flush=True)
        if i == 1:
            load_shard()
        dist.all_reduce(torch.ones(1))
    if __name__ == "__main__":
        mp.spawn(worker, args=(2,), nprocs=2)
"""


def test_hang_in_mp_spawn_workers_names_the_worker(tmp_path: Path) -> None:
    # detectron2-style: one process per node (--launcher command) that starts
    # its workers with mp.spawn.  The hook in each worker registers its own
    # stack dump, so the hang is found in worker 1, not in the spawner's join.
    (tmp_path / "spawn_hang.py").write_text(textwrap.dedent(SPAWN_HANG))
    res = subprocess.run(CORRAL + ["run", "--launcher", "command", "--hang-timeout", "10", "--json",
                                   "spawn_hang.py"], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert res.returncode == 124, res.stderr[-2000:]
    out = json.loads(res.stdout[res.stdout.index("{\n"):])
    tree = "\n".join(out["stacks"])
    assert any("load_shard spawn_hang.py:5" in ln and ln.endswith("rank 0 worker 1") for ln in out["stacks"]), tree
    assert any("all_reduce" in ln and ln.endswith("rank 0 worker 0") for ln in out["stacks"]), tree
    assert "rank 0 worker 1 elsewhere than the others" in res.stderr, res.stderr[-2000:]
    assert "rank 0, pid " in next(Path(out["run_dir"]).glob("stacks-*.txt")).read_text()


def test_ranks_of_a_node_that_did_not_answer_are_named_as_such() -> None:
    training = _dump(("/w/train.py", 50, "<module>"), ("/w/train.py", 12, "train_step"))
    lines, _ = stack_report({0: training, 1: training}, world_size=5, unanswered={2: "node2", 3: "node2"})
    assert "(no stack from ranks 2-3: its node node2 did not answer)" in lines
    assert "(no stack from rank 4: not a Python rank, or exited)" in lines
