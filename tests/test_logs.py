"""The run directory's writer when the disk under it fails."""

from __future__ import annotations

import errno
from pathlib import Path

from corral.run.logs import RunLogs


class _Full:
    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    def close(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_under_the_run_directory_stops_the_logs_not_the_run(tmp_path: Path, monkeypatch) -> None:
    # Seen with --runs-dir on a full tmpfs: the OSError from a log write ended
    # the reading of a node's events, so the node was declared "lost: no
    # heartbeat for 10s (network partition...)", and corral ended with a
    # traceback.
    said: list[str] = []
    logs = RunLogs(tmp_path, "r", on_error=said.append)
    logs.line("n1", 0, "first")
    logs._files[("n1", 0)] = _Full()  # the disk fills up
    logs.line("n1", 0, "second")
    logs.status("n1", 0, "progress")
    logs.marker("restart")
    logs.flush()
    assert said == [f"cannot write the run's logs in {tmp_path / 'r'}: No space left on device"]
    assert logs.error == said[0]
    logs.close()  # nothing raised

    def full(self, *a, **kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    logs2 = RunLogs(tmp_path, "r2")
    monkeypatch.setattr(Path, "write_text", full)
    logs2.write_record({"status": "succeeded"})
    assert logs2.error and not (tmp_path / "r2" / "run.json.tmp").exists()


def test_the_run_directory_is_private_whatever_the_umask(tmp_path: Path) -> None:
    # A log holds whatever a rank printed, tokens included: under the usual
    # umask 022 the run directory was 0755 and its logs 0644.
    import os

    old = os.umask(0o022)
    try:
        logs = RunLogs(tmp_path / "runs", "r", on_error=None)
        logs.line("n1", 0, "HF_TOKEN=hf_secret")
        logs.line("n1", None, "launcher")
        logs.write_record({"status": "running"})
        logs.close()
    finally:
        os.umask(old)
    run = tmp_path / "runs" / "r"
    modes = {str(p.relative_to(run)): p.stat().st_mode & 0o777 for p in [run, *run.rglob("*")]}
    assert modes == {".": 0o700, "n1": 0o700, "n1/rank0.log": 0o600, "n1/launcher.log": 0o600,
                     "run.json": 0o600}, modes
