"""The head's control socket (what `corral stacks RUN` talks to)."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from corral.errors import CorralError
from corral.run.control import control_path, live_controls, request, serve


@pytest.fixture()
def tmpdir_env(monkeypatch: pytest.MonkeyPatch):
    """Point TMPDIR somewhere and make tempfile notice (it caches the answer)."""

    def use(path: Path) -> None:
        monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)  # else the socket goes there
        monkeypatch.setenv("TMPDIR", str(path))
        monkeypatch.setattr(tempfile, "tempdir", None)

    yield use


def _round_trip(path: Path) -> dict:
    async def go() -> dict:
        async def handler(req: str) -> dict:
            return {"echo": req}

        server = await serve(path, handler)
        try:
            return await asyncio.to_thread(request, str(path), "stacks")
        finally:
            server.close()
            path.unlink(missing_ok=True)

    return asyncio.run(go())


def test_socket_lives_in_a_private_directory_under_tmpdir(tmpdir_env) -> None:
    short = Path(tempfile.mkdtemp(prefix="cc", dir="/tmp"))  # pytest's tmp_path is too long
    tmpdir_env(short)
    path = control_path("20260101-000000-abcd")
    assert path.parent == short / f"corral-{os.getuid()}" / "ctl"
    assert path.parent.stat().st_mode & 0o777 == 0o700
    assert _round_trip(path) == {"echo": "stacks"}
    shutil.rmtree(short)


def test_a_tmpdir_too_long_for_a_unix_socket_falls_back_to_tmp(tmp_path: Path, tmpdir_env) -> None:
    deep = tmp_path / ("job-scratch-" + "x" * 60) / ("y" * 40)
    deep.mkdir(parents=True)
    tmpdir_env(deep)
    path = control_path("20260101-000000-abcd")
    assert str(path).startswith(f"/tmp/corral-{os.getuid()}/ctl/")
    assert _round_trip(path) == {"echo": "stacks"}  # bind() would fail on the long path


def test_no_usable_directory_is_a_named_error(tmp_path: Path, tmpdir_env, monkeypatch) -> None:
    deep = tmp_path / ("z" * 120)
    deep.mkdir()
    tmpdir_env(deep)
    import corral.run.control

    real = corral.run.control.private_dir

    def no_tmp(path: str, base: str):
        if path.startswith("/tmp/corral-"):
            raise PermissionError(13, "Permission denied", path)
        return real(path, base)

    monkeypatch.setattr(corral.run.control, "private_dir", no_tmp)
    with pytest.raises(CorralError) as e:
        control_path("20260101-000000-abcd")
    assert "over 100 bytes" in e.value.message and "TMPDIR" in (e.value.hint or "")


def test_clients_that_leave_early_print_nothing_into_the_run(tmpdir_env) -> None:
    """A liveness probe, and a `corral stacks` stopped while the ranks dump, used to print
    asyncio's 'Unhandled exception in client_connected_cb ... ConnectionResetError' into the
    output of the run being inspected."""
    short = Path(tempfile.mkdtemp(prefix="cc", dir="/tmp"))
    tmpdir_env(short)
    path = control_path("20260101-000000-abcd")

    async def go() -> list[dict]:
        errors: list[dict] = []
        asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))

        async def handler(req: str) -> dict:
            await asyncio.sleep(0.3)  # the ranks take a moment to dump their stacks
            return {"stacks": {"0": "x" * 200_000}}

        server = await serve(path, handler)
        try:
            found = await asyncio.to_thread(live_controls)
            assert found.get("20260101-000000-abcd") == path
            _, writer = await asyncio.open_unix_connection(str(path))
            writer.write(b"stacks\n")
            await writer.drain()
            writer.close()  # gone before the answer
            await asyncio.sleep(0.6)
            assert (await asyncio.to_thread(request, str(path), "stacks"))["stacks"]["0"] == "x" * 200_000
        finally:
            server.close()
            path.unlink(missing_ok=True)
        return errors

    assert asyncio.run(go()) == []
    shutil.rmtree(short)


def test_a_client_that_hangs_up_before_the_answer_is_not_a_traceback(tmp_path: Path) -> None:
    # `corral stacks` interrupted while the head gathers the ranks' stacks: the
    # running job's head must not print asyncio's "Unhandled exception" over
    # the job's output.
    import socket

    errors: list[dict] = []

    async def go() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: errors.append(ctx))
        answered = asyncio.Event()

        async def handler(req: str) -> dict:
            await asyncio.sleep(0.3)
            answered.set()
            return {"stacks": {"0": "x" * 1_000_000}}

        path = tmp_path / "ctl.sock"
        server = await serve(path, handler)
        try:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(path))
            s.sendall(b"stacks\n")
            s.close()
            await answered.wait()
            await asyncio.sleep(0.3)
        finally:
            server.close()

    asyncio.run(go())
    assert errors == []


@pytest.mark.parametrize("kind", ["open", "link", "foreign"])
def test_a_control_dir_another_user_made_first_is_refused(kind: str, tmpdir_env) -> None:
    """nobody makes ``corral-<uid>`` first in the shared temp dir: the run's
    control socket would have gone into a directory of theirs (they could
    answer `corral stacks`, or take the name).  Now a named error, nothing
    made there, and `corral stacks` does not look there either."""
    from attacker import prepare, shared_place

    with shared_place() as tmp:
        tmpdir_env(tmp)
        root = tmp / f"corral-{os.getuid()}"
        prepare(kind, root)
        with pytest.raises(CorralError) as e:
            control_path("20260101-000000-abcd")
        assert f"{root} is not safe to use" in e.value.message and "nobody" in e.value.message, e.value.message
        assert "TMPDIR" in (e.value.hint or "")
        assert not (root / "ctl").exists() and not (tmp / f"{root.name}.theirs" / "ctl").exists()
        with pytest.raises(CorralError, match="not safe to use"):
            live_controls()


def test_the_users_runtime_dir_is_preferred(tmpdir_env, monkeypatch) -> None:
    short = Path(tempfile.mkdtemp(prefix="cr", dir="/tmp"))
    tmpdir_env(Path("/nonexistent"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(short))
    path = control_path("20260101-000000-abcd")
    assert path.parent == short / "corral" / "ctl"
    assert all((d.stat().st_mode & 0o777) == 0o700 for d in (path.parent, path.parent.parent))
    shutil.rmtree(short)
