"""The collective flight recorder: dumps read safely and explained, gathered from every rank.

Unit tests read dumps recorded from real runs (tests/fixtures/flightrec/README.md);
the end-to-end tests run real torch.distributed (gloo) under `corral run`,
on this machine and on the sandbox (4 nodes x 2 ranks).
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from corral.diagnose.flightrec import DumpError, analyse, parse_dump, rank_dump, read_dir
from corral.diagnose.hang import parse_stacks_file
from corral.run.flightrec import FlightDumps

CORRAL = [sys.executable, "-m", "corral"]
FIXTURES = Path(__file__).parent / "fixtures" / "flightrec"


def recorded(name: str, tmp_path: Path) -> Path:
    """A run directory holding the dumps of a recorded run."""
    run = tmp_path / name
    shutil.copytree(FIXTURES / name, run / "flightrec")
    return run


# -- reading and explaining dumps ------------------------------------------------


def test_a_skipped_all_reduce_names_the_rank_the_collective_and_its_number(tmp_path: Path) -> None:
    report = read_dir(recorded("skip", tmp_path), 4)
    assert report is not None and report.culprits == (3,)
    (d,) = report.divergences
    assert (d.seq, d.expected.op, d.agreeing) == (45, "all_reduce", (0, 1, 2))
    (odd,) = d.mismatched
    assert odd.rank.host == "vm" and odd.rank.pid == 17422 and odd.entered.op == "barrier"
    stacks = parse_stacks_file((FIXTURES / "skip" / "stacks.txt").read_text())
    text = "\n".join(report.lines(stacks))
    assert "diverges at collective #45: ranks 0-2 entered all_reduce [1000] Float" in text
    assert "rank 3 (vm, pid 17422) entered #45 as barrier" in text and "mismatched operation" in text
    assert "skip.py:22" in text  # rank 3's own stack: the final barrier


def test_a_rank_that_never_entered_the_collective_is_named_with_its_last_one(tmp_path: Path) -> None:
    report = read_dir(recorded("stall", tmp_path), 4)
    assert report is not None
    (d,) = report.divergences
    assert d.seq == 4 and [o.rank.rank for o in d.never_entered] == [1] and not d.mismatched
    assert "rank 1 (vm, pid 19211) never entered #4 all_reduce (its last: #3 all_reduce)" in "\n".join(report.lines())
    assert d.expected.shape == "[256] Half"


def test_a_size_mismatch_is_named_and_the_rank_without_a_dump_too(tmp_path: Path) -> None:
    report = read_dir(recorded("mismatch", tmp_path), 4)
    assert report is not None and report.culprits == (1,)
    text = "\n".join(report.lines())
    assert "rank 1 (vm, pid 20495) entered #4 as all_reduce [1200] Float: mismatched sizes" in text
    assert "no flight recorder dump from rank 0" in text


def test_a_collective_dropped_from_one_ring_buffer_is_not_a_divergence(tmp_path: Path) -> None:
    # A rank's ring buffer holds its last N collectives: one that starts later
    # dropped the older ones; it did not skip them.
    run = recorded("skip", tmp_path)
    dump = json.loads((run / "flightrec" / "rank1.cpu.json").read_text())
    dump["entries"] = dump["entries"][30:]
    (run / "flightrec" / "rank1.cpu.json").write_text(json.dumps(dump))
    report = read_dir(run, 4)
    assert report is not None and report.culprits == (3,) and report.divergences[0].seq == 45


def test_every_rank_in_the_same_unfinished_collective_is_said_so() -> None:
    dumps = {}
    for r in range(4):
        dump = json.loads((FIXTURES / "skip" / f"rank{r}.cpu.json").read_text())
        dump["entries"] = dump["entries"][:-1]  # before the divergence
        dump["entries"][-1]["retired"] = False
        dumps[r] = rank_dump(r, json.dumps(dump).encode())
    report = analyse(dumps, 4)
    assert not report.divergences
    assert report.lines() == ["flight recorder: every rank's last collective of group 0 is #44 all_reduce "
                              "[1000] Float, and none of them finished it"]


def test_the_pickle_format_is_read_with_its_stacks() -> None:
    dump = rank_dump(2, (FIXTURES / "pickle" / "rank2.cpu.pkl").read_bytes())
    last = dump.calls[-1]
    assert (last.seq, last.op, last.done) == (45, "all_reduce", False)
    assert last.frames[0].file.endswith("h.py") and last.frames[-1].func == "all_reduce"


def test_a_pickle_that_references_anything_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "ran"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (marker,))

    data = pickle.dumps({"entries": [Evil()]}, protocol=2)
    with pytest.raises(DumpError, match="refused: the dump references"):
        parse_dump(data)
    assert not marker.exists()
    with pytest.raises(DumpError, match="not a flight recorder dump"):
        parse_dump(b'["a list"]')
    with pytest.raises(DumpError, match="neither JSON nor pickle"):
        parse_dump(b"\x00garbage")


def test_a_dump_file_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    run = recorded("stall", tmp_path)
    (run / "flightrec" / "rank1.cpu.json").unlink()
    (run / "flightrec" / "rank1.cpu.json").symlink_to(FIXTURES / "skip" / "rank1.cpu.json")
    report = read_dir(run, 4)
    assert report is not None and report.unreadable == ((1, "rank1.cpu.json: a symbolic link, not followed"),)


def test_dumps_from_nodes_are_kept_only_under_the_hooks_names_and_ranks(tmp_path: Path) -> None:
    dumps = FlightDumps()
    data = (FIXTURES / "stall" / "rank1.cpu.json").read_text()
    dumps.take("node1", {"ev": "flightrec", "r": 1, "pid": 7, "name": "../../etc/passwd", "fmt": "json", "data": data})
    dumps.take("node1", {"ev": "flightrec", "r": 1, "pid": 7, "name": "rank2.cpu.json", "fmt": "json", "data": data})
    dumps.take("node1", {"ev": "flightrec", "r": 1, "pid": 7, "name": "rank1.nccl.pkl", "fmt": "pickle",
                         "data": "not base64!"})
    assert dumps.save(tmp_path) is None  # nothing kept
    dumps.take("node1", {"ev": "flightrec", "r": 1, "pid": 7, "name": "rank1.cpu.json", "fmt": "json", "data": data})
    folder = dumps.save(tmp_path)
    assert folder is not None and sorted(p.name for p in folder.iterdir()) == ["index.json", "rank1.cpu.json"]
    assert (folder / "rank1.cpu.json").stat().st_mode & 0o077 == 0
    report = read_dir(tmp_path, 2)
    assert report is not None and report.ranks[1].host == "node1" and report.ranks[1].pid == 7


# -- end to end ------------------------------------------------------------------


def test_no_flight_recorder_leaves_it_off(tmp_path: Path) -> None:
    shutil.copy(FIXTURES / "mismatch.py", tmp_path)
    res = subprocess.run(CORRAL + ["run", "--no-flight-recorder", "--env", "ODD_RANK", "--nproc-per-node", "2",
                                   "--json", "mismatch.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=180, env=_env(ODD_RANK="1"))
    assert res.returncode != 0, res.stderr[-3000:]
    out = json.loads(res.stdout[res.stdout.index("{\n"):])
    assert out["flightrec"] == [] and not (Path(out["run_dir"]) / "flightrec").exists()


def _env(**extra: str) -> dict:
    import os

    return {**os.environ, **extra}


@pytest.mark.sandbox
def test_skipped_all_reduce_on_the_sandbox_names_rank_5_its_node_collective_and_stack(sandbox) -> None:
    repo = Path(__file__).resolve().parents[1]
    work = repo / "scratch" / f"fr-skip-{time.monotonic_ns()}"
    work.mkdir(parents=True)
    try:
        shutil.copy(FIXTURES / "skip.py", work)
        res = subprocess.run(CORRAL + ["run", "-c", str(sandbox.cluster_file), "--hang-timeout", "30", "--json",
                                       "skip.py"], cwd=work, capture_output=True, text=True, timeout=240)
        assert res.returncode == 124, res.stderr[-3000:]
        out = json.loads(res.stdout[res.stdout.index("{\n"):])
        text = "\n".join(out["flightrec"])
        node3 = sandbox.nodes[2]  # ranks 4-5
        assert "group 0 diverges at collective #45: ranks 0-4,6-7 entered all_reduce [1000] Float" in text, res.stderr[-4000:]
        assert f"rank 5 ({node3}, pid " in text and "entered #45 as barrier" in text, text
        assert "skip.py:22" in text  # rank 5's stack: the barrier it went on to
        assert out["failure"]["rank"] == 5
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.sandbox
def test_size_mismatch_on_the_sandbox_is_named(sandbox) -> None:
    repo = Path(__file__).resolve().parents[1]
    work = repo / "scratch" / f"fr-mismatch-{time.monotonic_ns()}"
    work.mkdir(parents=True)
    try:
        shutil.copy(FIXTURES / "mismatch.py", work)
        res = subprocess.run(CORRAL + ["run", "-c", str(sandbox.cluster_file), "--env", "ODD_RANK", "--json",
                                       "mismatch.py"], cwd=work, capture_output=True, text=True, timeout=240,
                             env=_env(ODD_RANK="6"))
        assert res.returncode != 0, res.stderr[-3000:]
        out = json.loads(res.stdout[res.stdout.index("{\n"):])
        text = "\n".join(out["flightrec"])
        assert f"rank 6 ({sandbox.nodes[3]}, pid " in text, res.stderr[-3000:]
        assert "entered #4 as all_reduce [1200] Float: mismatched sizes" in text, text
        assert (Path(out["run_dir"]) / "flightrec" / "index.json").is_file()
        res = subprocess.run(CORRAL + ["diagnose", out["run_dir"]], cwd=work, capture_output=True, text=True,
                             timeout=120)
        assert "Flight recorder: group 0 diverges at collective #4" in res.stdout, res.stdout
    finally:
        shutil.rmtree(work, ignore_errors=True)
