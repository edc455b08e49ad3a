"""The destination on a node: no links below its root, guarded deletes (stdlib, Python 3.8+).

Shipped to the nodes ahead of ``nodetree`` in the same source (one
namespace there; ``pipeline.SOURCE``), imported by it on the head.

- Below the destination root nothing is written or deleted through a
  symbolic link: directories are opened one component at a time with
  ``O_NOFOLLOW`` (``open_dir``), and ``linked_dirs`` finds the links the
  synced paths would pass through, so ``status`` refuses them before rsync
  (which would replace them) or the chain (which must not follow them) runs.
  The root itself may be a link: the user named it.
- ``--delete`` prunes only a recognisably synced directory: ``guard``
  reports, per directory, whether it is ``/`` or a home (or holds one),
  carries the ``MARKER`` a first sync writes, or is empty.
- A file written here goes to a private temporary file created exclusively
  next to it (``create_tmp``), removed on every failure (``discard``), and
  a failure to write is named for the user (``write_error``: a full disk).
- Destinations that are one directory on several nodes (a home on NFS) are
  found by ``share_probe``: each node creates a file named for the sync and its
  index, then looks each peer's name up; the head writes such a directory
  once instead of racing several rsyncs into it.
"""

from __future__ import annotations

import errno
import os
import stat
import time

#: Written into a destination on its first sync: ``--delete`` refuses a
#: non-empty directory without it (a home, /srv, someone's checkout).
MARKER = ".corral-sync"
#: ``PROBE + token + "-" + index``: one node's sign that it sees a destination
#: (see ``share_probe``); never synced, never an "extra" file for ``--delete``.
PROBE = ".corral-probe-"
#: A probe older than this was left by an interrupted sync; the next probe removes it.
PROBE_STALE_S = 3600
MARKER_TEXT = (
    "This directory is a destination of `corral sync`.\n"
    "`corral sync --delete` removes files here that are not in the synced tree;\n"
    "it refuses a non-empty directory without this file (unless --force-delete).\n"
)


class DestinationError(Exception):
    """The destination cannot be used; the message is for the user as is."""

    def __init__(self, message: str, kind: str = "destination"):
        super().__init__(message)
        self.kind = kind


def rel_parts(rel: str):
    """``rel`` split into names, or None unless it is a plain relative path
    (no ``..``, ``.``, empty or absolute part: nothing that leaves the root)."""
    parts = rel.split("/")
    if not rel or any(p in ("", ".", "..") for p in parts):
        return None
    return parts


def link_error(root: str, parts: list) -> DestinationError:
    where = os.path.join(root, *parts)
    try:
        target = os.readlink(where)
    except OSError:
        target = "?"
    return DestinationError(
        "%s is a symbolic link to %s: corral never writes or deletes through a link inside the "
        "destination (the sync would land in %s)" % (where, target, target), "dest-link")


def open_dir(root: str, parts: list, create: bool = False) -> int:
    """A descriptor of ``root/parts...``, opened one component at a time with
    O_NOFOLLOW (made first with ``create``): a link anywhere below the root
    raises ``DestinationError`` instead of being followed."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    fd = os.open(root, flags)  # the root itself: the user named it, links and all
    try:
        for i, name in enumerate(parts):
            if create:
                try:
                    os.mkdir(name, 0o777, dir_fd=fd)
                except FileExistsError:
                    pass
            try:
                nfd = os.open(name, flags | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR) and stat.S_ISLNK(
                        os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise link_error(root, parts[: i + 1]) from None
                raise
            os.close(fd)
            fd = nfd
        return fd
    except BaseException:
        os.close(fd)
        raise


def linked_dirs(root: str, paths: list) -> list:
    """Directories (relative) that the synced ``paths`` pass through and that
    are symbolic links on this node: rsync would replace them, the chain
    would write through them; corral refuses them, naming each."""
    seen, found = {}, []
    for rel in paths:
        parts = rel.split("/")[:-1]
        for i in range(len(parts)):
            sub = "/".join(parts[: i + 1])
            if sub not in seen:
                try:
                    seen[sub] = stat.S_ISLNK(os.lstat(os.path.join(root, sub)).st_mode)
                except OSError:
                    seen[sub] = None  # missing: nothing deeper exists either
                if seen[sub]:
                    found.append(sub)
            if seen[sub] is not False:
                break
    return found


def home_dirs() -> list:
    """This node's home directories: the login user's (also resolved), and every
    account's as written (resolving them could mount every automounted home)."""
    mine = os.path.expanduser("~")
    homes = {os.path.normpath(mine), os.path.realpath(mine)}
    try:
        import pwd

        homes.update(os.path.normpath(p.pw_dir) for p in pwd.getpwall() if p.pw_dir.startswith("/"))
    except (ImportError, KeyError, OSError):
        pass
    return sorted(homes)


def danger(path: str, homes: list):
    """Why ``--delete`` into ``path`` would be dangerous (None when it is not)."""
    names = {os.path.normpath(path), os.path.realpath(path)}
    if "/" in names:
        return "it is the root directory"
    for home in homes:
        if home == "/":
            continue
        if home in names:
            return "it is a home directory" + ("" if home == path else " (%s)" % home)
        if any(home.startswith(n + "/") for n in names):
            return "it holds the home directory %s" % home
    return None


def is_empty(path: str) -> bool:
    """Nothing in ``path`` but (perhaps) the marker; True when it does not exist."""
    try:
        with os.scandir(path) as it:
            return all(e.name == MARKER for e in it)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False  # unreadable: not known to be empty


def guard(root: str, scope: list) -> list:
    """Facts for the ``--delete`` guard, per directory it would prune: dangerous
    (``/``, a home), marked as a corral destination, or empty."""
    if not scope:
        return []
    homes = home_dirs()
    root_marked = os.path.isfile(os.path.join(root, MARKER))
    out = []
    for top in scope:
        path = os.path.join(root, top) if top else root
        marked = root_marked or os.path.isfile(os.path.join(path, MARKER))
        out.append({"dir": top, "path": path, "danger": danger(path, homes), "marked": marked,
                    "empty": is_empty(path)})
    return out


def write_marker(root: str, top: str) -> None:
    try:
        fd = open_dir(root, top.split("/") if top else [], create=True)
    except (OSError, DestinationError):
        return  # status names a link; rsync names the rest
    try:
        tmp = os.open(MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
                      0o644, dir_fd=fd)
        try:
            os.write(tmp, MARKER_TEXT.encode())
        finally:
            os.close(tmp)
    except OSError:
        pass  # a full or read-only disk: the transfer says so
    finally:
        os.close(fd)


def make_root(root: str) -> None:
    try:
        os.makedirs(root, exist_ok=True)
    except FileExistsError:
        # Not a directory, though something is there: a link to nowhere, or a file.
        if os.path.islink(root):
            raise DestinationError(
                "%s is a symbolic link to %s, which does not exist: create that directory, or "
                "remove the link (then sync again)" % (root, os.readlink(root))) from None
        raise DestinationError("%s exists and is not a directory: move it away, or choose "
                               "another destination (--to)" % root) from None
    except OSError as e:
        kind = "dest-permission" if e.errno in (errno.EACCES, errno.EPERM) else "destination"
        raise DestinationError("cannot create %s: %s" % (root, e.strerror or e), kind) from None


def refused(fact: dict) -> bool:
    """Whether the ``--delete`` guard refuses the directory ``fact`` describes."""
    return bool(fact["danger"]) or not (fact["marked"] or fact["empty"])


def in_dir(root: str, rel: str, fn) -> bool:
    """``fn(name, dir_fd)`` for ``root/rel`` reached without following a link;
    False (nothing done) when ``rel`` leaves the root or passes through a link
    or a missing directory."""
    parts = rel_parts(rel)
    if parts is None:
        return False
    try:
        fd = open_dir(root, parts[:-1])
    except (OSError, DestinationError):
        return False
    try:
        fn(parts[-1], fd)
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def write_error(e: OSError, path: str):
    """(kind, message) for a failure to write ``path`` on this node."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        why = "the disk is full" if e.errno == errno.ENOSPC else "the disk quota is exceeded"
        return "nospace", "%s: cannot write %s (%s)" % (why, path, e.strerror)
    if e.errno in (errno.EACCES, errno.EPERM):
        return "dest-permission", "permission denied: cannot write %s" % path
    if e.errno == errno.EROFS:
        return "readonly", "read-only file system: cannot write %s" % path
    return "io", "cannot write %s: %s" % (path, e.strerror or e)


def create_tmp(dfd: int, base: str):
    """A new private temporary file next to ``base`` (never an existing one, never a link)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    while True:
        name = ".%s.corral-%d-%s" % (base[:200], os.getpid(), os.urandom(4).hex())
        try:
            return name, os.open(name, flags, 0o600, dir_fd=dfd)
        except FileExistsError:
            continue


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def discard(dfd, tmp, fd) -> None:
    """Close and remove a partial file (nothing half-written stays behind)."""
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass
    if tmp is not None:
        try:
            os.unlink(tmp, dir_fd=dfd)
        except OSError:
            pass


def _probe_name(token: str, index: int) -> str:
    return "%s%s-%d" % (PROBE, token, index)


def share_probe(roots: list, token: str, index: int, count: int) -> list:
    """For each destination root (made by ``status`` already): the indices of
    the other nodes of this sync that see the same directory.

    Node ``index`` creates its own probe file, then looks up every peer's by
    name.  Each node writes before it looks, so of two nodes sharing a
    directory the one that looks last sees the other's; the head joins
    the pairs.  Lookups by a name never used before are asked of the file
    server (an NFS client has no cached answer for it), where a directory
    listing could be served from a stale cache.  A root that cannot be
    probed (read-only, a link below) answers None: it is treated as this
    node's own, and ``status`` or the transfer names the real problem."""
    return [_at_root(root, lambda fd: _probe(fd, token, index, count)) for root in roots]


def share_unprobe(roots: list, token: str, index: int) -> None:
    """Remove this node's probe files of ``token`` (where they still are)."""
    for root in roots:
        _at_root(root, lambda fd: os.unlink(_probe_name(token, index), dir_fd=fd))


def _at_root(root: str, fn):
    """``fn(fd)`` of the destination root (``~`` is this node's home); None when
    the root cannot be opened or ``fn`` fails with an OSError."""
    try:
        fd = open_dir(os.path.expanduser(root), [])
    except OSError:
        return None
    try:
        return fn(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


def _probe(fd: int, token: str, index: int, count: int) -> list:
    _remove_stale(fd, token)
    os.close(os.open(_probe_name(token, index),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=fd))
    return [j for j in range(count) if j != index and _exists(fd, _probe_name(token, j))]


def _exists(fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def _remove_stale(fd: int, token: str) -> None:
    """Probes of earlier syncs that were interrupted before removing theirs."""
    try:
        names = [n for n in os.listdir(fd) if n.startswith(PROBE) and not n.startswith(PROBE + token)]
    except OSError:
        return
    for name in names[:1024]:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISREG(st.st_mode) and time.time() - st.st_mtime > PROBE_STALE_S:
                os.unlink(name, dir_fd=fd)
        except OSError:
            continue
