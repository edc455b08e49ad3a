"""Private directories in shared places (stdlib only, Python 3.8+).

Shipped with the node agent and imported by the head too: every directory
corral makes or reuses where other users can create files (``/tmp``, a
``$TMPDIR``) goes through ``private_dir``.  A name like ``/tmp/corral-<uid>``
is predictable, so another local user can make it first (mode 0777, or a
symbolic link to a directory of theirs) and then swap what corral puts in
it: a job's rank hook, for instance, which every rank imports.

``private_dir(path, base)`` makes each missing directory from ``base`` down
to ``path`` with mode 0700 and checks every one that was there already,
through directory file descriptors and ``O_NOFOLLOW`` (no path component
can be swapped between the check and the next step): a real directory, not
a symbolic link, owned by this user, writable by nobody else.  ``base``
itself (``/tmp``, the user's home) and the directories above it must be
owned by root or by this user and not writable by others, unless sticky
(the rule OpenSSH's StrictModes applies, with ``/tmp``'s sticky bit).
Anything else is refused with ``UnsafePlace``, never fixed up or used.
"""

from __future__ import annotations

import os
import stat

#: Hint for every refusal: what the user can do about it.
HINT = ("remove it (after checking what is in it: another user may have made it), or set TMPDIR "
        "(XDG_RUNTIME_DIR for the head's sockets) to a directory only you can write")


class UnsafePlace(Exception):
    """A directory corral would make or reuse is not safe: named, with why."""

    def __init__(self, path: str, why: str):
        super().__init__("%s is not safe to use: %s" % (path, why))
        self.path = path
        self.why = why
        self.hint = HINT


def _owner(uid: int) -> str:
    try:
        import pwd

        return "%s (uid %d)" % (pwd.getpwuid(uid).pw_name, uid)
    except (ImportError, KeyError):
        return "uid %d" % uid


def _check_own(path: str, st) -> None:
    """A directory corral made (or would have): ours and writable only by us."""
    me = os.geteuid()
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePlace(path, "it is not a directory")
    if st.st_uid != me:
        raise UnsafePlace(path, "it belongs to %s, not to this user, %s" % (_owner(st.st_uid), _owner(me)))
    if st.st_mode & 0o022:
        raise UnsafePlace(path, "other users can write in it (mode %04o)" % stat.S_IMODE(st.st_mode))


def _check_place(path: str) -> None:
    """``path`` (the shared place) and every directory above it: owned by
    root or by us, and writable by others only when sticky (no one else can
    rename or remove what we make in it)."""
    me = os.geteuid()
    real = os.path.realpath(path)
    parts = real.split(os.sep)
    for i in range(len(parts), 0, -1):
        here = os.sep.join(parts[:i]) or os.sep
        st = os.stat(here)
        if st.st_uid not in (0, me):
            raise UnsafePlace(here, "it belongs to %s, who could replace what corral makes in it"
                              % _owner(st.st_uid))
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            raise UnsafePlace(here, "other users can write in it and it is not sticky (mode %04o): "
                              "they could replace what corral makes in it" % stat.S_IMODE(st.st_mode))


def _open_child(fd: int, name: str, path: str, create: bool = True) -> int:
    """``name`` in the directory ``fd``, made 0700 if missing, checked; its fd."""
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=fd)
        except FileExistsError:
            pass
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    try:
        child = os.open(name, flags, dir_fd=fd)
    except OSError as e:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            raise e from None
        if stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(name, dir_fd=fd)
            except OSError:
                target = "?"
            raise UnsafePlace(path, "it is a symbolic link (to %s) owned by %s"
                              % (target, _owner(st.st_uid))) from None
        _check_own(path, st)
        raise
    try:
        st = os.fstat(child)
        _check_own(path, st)
        if st.st_mode & 0o077:
            # Ours and never writable by others (an older corral made it 0755):
            # nothing in it can be another user's, so closing it is safe.
            os.fchmod(child, 0o700)
    except BaseException:
        os.close(child)
        raise
    return child


def runtime_dir(environ=os.environ) -> str | None:
    """``$XDG_RUNTIME_DIR`` when it is this user's, as the spec requires
    (owned by us, 0700): after ``su`` it may still name the first user's."""
    path = environ.get("XDG_RUNTIME_DIR") or ""
    if not os.path.isabs(path):
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    return path


def private_dir(path: str, base: str | None = None) -> str:
    """Make or reuse ``path`` as a private directory (0700, ours); return it.

    ``base`` is the existing shared place it goes in (default: its parent);
    each directory between ``base`` and ``path`` is made or checked too.
    Raises ``UnsafePlace`` for a directory that is not safe to use, and
    ``OSError`` when one cannot be made (no space, no permission).
    """
    _walk(path, base, create=True)
    return os.path.abspath(path)


def existing_private_dir(path: str, base: str | None = None) -> bool:
    """Whether ``path`` is there, checked as ``private_dir`` checks it (without
    making anything); raises ``UnsafePlace`` as it does.  For readers: a
    listing of the control sockets must not read another user's directory."""
    try:
        _walk(path, base, create=False)
    except FileNotFoundError:
        return False
    return True


def _walk(path: str, base, create: bool) -> None:
    path = os.path.abspath(path)
    base = os.path.abspath(base) if base else os.path.dirname(path)
    rel = os.path.relpath(path, base)
    if rel == "." or rel.startswith(".."):
        raise ValueError("%s is not below %s" % (path, base))
    _check_place(base)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0))
    try:
        here = base
        for name in rel.split(os.sep):
            here = os.path.join(here, name)
            child = _open_child(fd, name, here, create)
            os.close(fd)
            fd = child
    finally:
        os.close(fd)
