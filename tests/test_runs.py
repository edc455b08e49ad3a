"""`corral runs`: past and running runs, and runs whose head died."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from corral.run.history import RunRecord, _state, list_runs

CORRAL = [sys.executable, "-m", "corral"]


def _record(tmp_path: Path, head: dict | None) -> RunRecord:
    d = tmp_path / "20260101-000000-abcd"
    d.mkdir(exist_ok=True)
    data = {"status": "running", "started": time.time()}
    if head is not None:
        data["head"] = head
    (d / "run.json").write_text(json.dumps(data))
    [r] = list_runs(tmp_path)
    return r


def test_running_run_whose_head_is_gone_is_shown_as_died(tmp_path: Path) -> None:
    here = socket.gethostname()
    gone = subprocess.Popen(["true"])
    gone.wait()
    assert _record(tmp_path, {"host": here, "pid": gone.pid}).status == "died"
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "corral"])
    try:
        assert _record(tmp_path, {"host": here, "pid": alive.pid}).status == "running"
    finally:
        alive.kill()
        alive.wait()
    # a head that exited but was not reaped yet (a zombie has no command line)
    zombie = subprocess.Popen([sys.executable, "-c", "pass", "corral"])
    try:
        while _state(zombie.pid) != "Z":
            time.sleep(0.01)
        assert _record(tmp_path, {"host": here, "pid": zombie.pid}).status == "died"
    finally:
        zombie.wait()
    # a pid now used by something that is not corral: the head is gone too
    other = subprocess.Popen(["sleep", "30"])
    try:
        assert _record(tmp_path, {"host": here, "pid": other.pid}).status == "died"
    finally:
        other.kill()
        other.wait()
    # another machine's run (a shared runs/ directory), or an older record: as recorded
    assert _record(tmp_path, {"host": here + "-elsewhere", "pid": gone.pid}).status == "running"
    assert _record(tmp_path, None).status == "running"


def test_head_killed_with_sigkill_shows_as_died(tmp_path: Path) -> None:
    script = f"sleepy_{os.getpid()}.py"  # a name no other process on this machine has
    (tmp_path / script).write_text("import time\nprint('in user code', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen(CORRAL + ["run", "-n", "1", "--fresh-ranks", script], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:  # type: ignore[union-attr]
            if "in user code" in line:
                break
            assert time.monotonic() < deadline
        listed = subprocess.run(CORRAL + ["runs", "--json"], cwd=tmp_path, capture_output=True, text=True, check=False)
        assert [r["status"] for r in json.loads(listed.stdout)["runs"]] == ["running"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        listed = subprocess.run(CORRAL + ["runs", "--json"], cwd=tmp_path, capture_output=True, text=True, check=False)
        assert [r["status"] for r in json.loads(listed.stdout)["runs"]] == ["died"]
        shown = subprocess.run(CORRAL + ["runs"], cwd=tmp_path, capture_output=True, text=True, check=False)
        assert "died" in shown.stdout
    finally:
        proc.kill()
        proc.wait()
        # the local agent sees its head's pipe close and stops the rank
        deadline = time.monotonic() + 20
        while subprocess.run(["pgrep", "-f", script], capture_output=True, check=False).returncode == 0:
            if time.monotonic() > deadline:
                ps = subprocess.run(["ps", "-eo", "pid,ppid,sid,stat,etime,args"], capture_output=True,
                                    text=True, check=False).stdout
                raise AssertionError(f"the rank outlived its head by 20 s:\n{ps}")
            time.sleep(0.2)


FIXTURES = Path(__file__).parent / "fixtures" / "diagnose"


def test_runs_on_a_terminal_never_cuts_the_run_id(tmp_path: Path, monkeypatch) -> None:
    # At 80 and 120 columns rich shrank every column, the run id (what
    # `corral diagnose` and `corral stacks` take) to `20261123-1…`.
    import re
    import shutil

    from click.testing import CliRunner

    from corral.cli import cli

    ids = []
    for fixture in sorted(FIXTURES.glob("run-*")):  # real run records: long failures, several launchers
        run_id = json.loads((fixture / "run.json").read_text())["run_id"]
        if run_id not in ids:
            shutil.copytree(fixture, tmp_path / "runs" / run_id)
            ids.append(run_id)
    assert len(ids) >= 5
    monkeypatch.setenv("FORCE_COLOR", "1")  # a terminal, as rich sees it
    for columns in (80, 120):
        monkeypatch.setenv("COLUMNS", str(columns))
        res = CliRunner().invoke(cli, ["runs", "--runs-dir", str(tmp_path / "runs")])
        assert res.exit_code == 0, res.output
        shown = re.sub(r"\x1b\[[0-9;]*m", "", res.stdout)
        for run_id in ids:
            row = next(line for line in shown.splitlines() if run_id in line)  # whole, on its own row
            assert "failed" in row or "interrupted" in row, row
            assert len(row.rstrip()) <= columns, row  # the failure is what gets cut, not the width
        assert "…" in shown  # the long failures were cut to fit


REPO = Path(__file__).resolve().parents[1]


def test_a_run_made_in_a_test_stays_out_of_the_checkouts_runs() -> None:
    # `make test` left the suite's runs (planted failures among them) in the
    # checkout's ./runs, where `corral diagnose` with no argument looks.
    before = set(os.listdir(REPO / "runs")) if (REPO / "runs").is_dir() else None
    res = subprocess.run(CORRAL + ["run", "--json", "--launcher", "command", sys.executable, "-c", "print(1)"],
                         cwd=REPO, capture_output=True, text=True, timeout=120, check=False)
    run_id = json.loads(res.stdout)["run_id"] if res.stdout.startswith("{") else None
    try:
        assert res.returncode == 0 and run_id, res.stderr
        assert not (REPO / "runs" / run_id).exists()
        assert (Path(os.environ["CORRAL_RUNS_DIR"]) / run_id / "run.json").is_file()
    finally:  # on the old setup: take back what it left
        if run_id and (REPO / "runs" / run_id).exists():
            import shutil

            shutil.rmtree(REPO / "runs" / run_id)
            if before is None and not os.listdir(REPO / "runs"):
                (REPO / "runs").rmdir()


def _in_read_only(directory: Path, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """``argv`` run in ``directory`` made read-only for it alone (a bind mount
    in a mount namespace of its own: root writes everywhere else)."""
    import shlex

    script = (f"mount --bind {shlex.quote(str(directory))} {shlex.quote(str(directory))} && "
              f"mount -o remount,bind,ro {shlex.quote(str(directory))} && cd {shlex.quote(str(directory))} && "
              f"exec {shlex.join(argv)}")
    return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script], env=env,
                          capture_output=True, text=True, timeout=120, check=False)


def test_run_where_runs_cannot_be_written_uses_the_per_user_directory(tmp_path: Path) -> None:
    # It ended in a PermissionError traceback (with --json: empty stdout, exit 1).
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        import pytest

        pytest.skip("needs root and unshare(1) for a read-only bind mount")
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "hello.py").write_text("print('hello')\n")
    env = {k: v for k, v in os.environ.items() if k != "CORRAL_RUNS_DIR"}
    env["XDG_STATE_HOME"] = str(tmp_path / "state")
    run = CORRAL + ["run", "--json", "--launcher", "command", sys.executable, "hello.py"]
    res = _in_read_only(proj, run, env)
    assert res.returncode == 0, res.stderr
    fallback = tmp_path / "state" / "corral" / "runs"
    assert f"{proj / 'runs'} cannot be written (read-only file system): run directories are in {fallback}" \
        in res.stderr and "--runs-dir" in res.stderr
    run_id = json.loads(res.stdout)["run_id"]
    assert (fallback / run_id / "run.json").is_file() and not (proj / "runs").exists()
    # `corral runs` there looks where the run wrote
    listed = _in_read_only(proj, CORRAL + ["runs", "--json"], env)
    assert [r["run_id"] for r in json.loads(listed.stdout)["runs"]] == [run_id], listed.stderr
    # a --runs-dir that cannot be written is bad input, named before anything starts
    res = _in_read_only(proj, CORRAL + ["run", "--json", "--runs-dir", str(proj / "out"), "--launcher",
                                        "command", sys.executable, "hello.py"], env)
    assert res.returncode == 2, res.stderr
    err = json.loads(res.stdout)["error"]
    assert f"--runs-dir {proj / 'out'}: run directories cannot be written there (read-only file system)" \
        == err["message"] and "Traceback" not in res.stderr
