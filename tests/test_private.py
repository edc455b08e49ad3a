"""Private directories in shared places (corral/agent/private.py), against a real other user."""

from __future__ import annotations

import os
import stat

import pytest
from attacker import as_nobody, prepare, shared_place

from corral.agent.private import UnsafePlace, existing_private_dir, private_dir


def test_a_fresh_private_dir_is_0700_and_ours_whatever_the_umask() -> None:
    with shared_place() as tmp:
        old = os.umask(0)
        try:
            got = private_dir(str(tmp / "corral-0" / "ctl"), str(tmp))
        finally:
            os.umask(old)
        assert got == str(tmp / "corral-0" / "ctl")
        for d in (tmp / "corral-0", tmp / "corral-0" / "ctl"):
            st = os.lstat(d)
            assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o700
        assert private_dir(str(tmp / "corral-0" / "ctl"), str(tmp))  # reused as it is
        # An older corral's own 0755 directory: nobody else could write in it, so it is closed, not refused.
        os.chmod(tmp / "corral-0", 0o755)
        private_dir(str(tmp / "corral-0" / "ctl"), str(tmp))
        assert stat.S_IMODE(os.lstat(tmp / "corral-0").st_mode) == 0o700


@pytest.mark.parametrize("kind", ["open", "link", "foreign"])
def test_a_directory_another_user_made_first_is_refused(kind: str) -> None:
    with shared_place() as tmp:
        prepare(kind, tmp / "corral-0")
        with pytest.raises(UnsafePlace) as e:
            private_dir(str(tmp / "corral-0" / "ctl"), str(tmp))
        assert str(tmp / "corral-0") in str(e.value) and "nobody" in str(e.value), str(e.value)
        assert "TMPDIR" in e.value.hint
        with pytest.raises(UnsafePlace):
            existing_private_dir(str(tmp / "corral-0" / "ctl"), str(tmp))
        for d in (tmp / "corral-0", tmp / "corral-0.theirs"):
            assert not (d / "ctl").exists()  # nothing made in it


def test_our_own_directory_left_writable_by_others_is_refused() -> None:
    # Someone else may have put anything in it already: not closed after the fact.
    with shared_place() as tmp:
        (tmp / "corral-0").mkdir()
        os.chmod(tmp / "corral-0", 0o777)
        with pytest.raises(UnsafePlace, match="other users can write in it"):
            private_dir(str(tmp / "corral-0" / "ctl"), str(tmp))


def test_a_place_others_can_write_without_the_sticky_bit_is_refused() -> None:
    # Not sticky: anyone could rename corral's own directory away and put theirs there.
    with shared_place() as tmp:
        os.chmod(tmp, 0o777)
        with pytest.raises(UnsafePlace, match="not sticky"):
            private_dir(str(tmp / "corral-0"), str(tmp))
        assert not (tmp / "corral-0").exists()
        as_nobody(f"mkdir -m 700 '{tmp}/theirs'")
        with pytest.raises(UnsafePlace, match="belongs to nobody"):
            private_dir(str(tmp / "theirs" / "corral-0"), str(tmp / "theirs"))


def test_a_missing_directory_is_not_made_by_a_reader() -> None:
    with shared_place() as tmp:
        assert existing_private_dir(str(tmp / "corral-0" / "ctl"), str(tmp)) is False
        assert not (tmp / "corral-0").exists()


def test_a_runtime_dir_that_is_not_ours_is_not_used() -> None:
    # After `su`, XDG_RUNTIME_DIR still names the first user's directory.
    from corral.agent.private import runtime_dir

    with shared_place() as tmp:
        as_nobody(f"mkdir -m 700 '{tmp}/theirs'")
        (tmp / "mine").mkdir(mode=0o700)
        assert runtime_dir({"XDG_RUNTIME_DIR": str(tmp / "theirs")}) is None
        assert runtime_dir({"XDG_RUNTIME_DIR": str(tmp / "mine")}) == str(tmp / "mine")
        assert runtime_dir({"XDG_RUNTIME_DIR": "relative"}) is None and runtime_dir({}) is None
