"""File trees as sync sees them, on the head and on the nodes (stdlib, Python 3.8+).

Shipped as source to the nodes (``corral.sshsetup.remote``) and imported by
the head, so both sides describe a tree with the same code:

- an entry per synced path: ``[kind, mode, size, digest]`` where kind is
  ``f`` (file: sha256 of the content) or ``l`` (symlink: sha256 of its
  target); directories are implied;
- the tree hash: sha256 over the sorted ``path, kind, mode, size, digest``
  lines of the synced file list, so two nodes agree exactly when every synced
  file is the same;
- a stat cache (like git's index): a file whose size, mtime, ctime and inode
  have not changed since it was hashed is not read again, so re-checking an
  unchanged 5,000-file tree costs ``stat`` calls, not reads; anything that
  writes the file (rsync's rename, an editor) changes its ctime or inode.

The node-side calls: ``status`` (what differs from the head's manifest, and
with ``scope`` what is extra), ``delete``, ``probe`` (can this node log in to
the next one) and ``receive`` (one hop of the streaming chain).

What may be written or deleted where (no links below the destination root,
the ``--delete`` guard, temporary files) is ``nodedest``: a node runs its
source just before this module's, in one namespace (``pipeline.SOURCE``).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time

CHUNK = 1 << 20
#: Directory names never walked when looking for extra files (sync never deletes in them).
PRUNE = (
    ".git",
    ".hg",
    ".svn",
    "__pycache__",
    ".venv",
    "venv",
    "node_modules",
    ".tox",
    ".nox",
    ".mypy_cache",
    ".pytest_cache",
    ".ruff_cache",
    ".ipynb_checkpoints",
)
MARK = "@@corral-result@@"
PROGRESS = "@@prog "
HOP = "@@hop "

if "_CORRAL_HEADER" not in globals():  # on the head; on a node nodedest's source ran just before
    from corral.sync.nodedest import (
        MARKER,
        PROBE,
        DestinationError,
        create_tmp,
        discard,
        guard,
        in_dir,
        link_error,
        linked_dirs,
        make_root,
        open_dir,
        refused,
        rel_parts,
        share_probe,  # noqa: F401  (called on the nodes by name)
        share_unprobe,  # noqa: F401
        write_all,
        write_error,
        write_marker,
    )


# ---------------------------------------------------------------------------
# entries, hashes, cache


def cache_file(root: str) -> str:
    """Per machine and root: a home shared by the nodes (NFS) holds every
    node's cache side by side, not one they keep overwriting."""
    where = "%s\0%s" % (os.uname().nodename, os.path.abspath(root))
    key = hashlib.sha1(where.encode()).hexdigest()[:16]
    return os.path.join(os.path.expanduser("~"), ".cache", "corral", "sync", key + ".json")


def load_cache(root: str) -> dict:
    try:
        with open(cache_file(root)) as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def save_cache(root: str, cache: dict) -> None:
    path = cache_file(root)
    tmp = "%s.%s.tmp" % (path, os.urandom(6).hex())  # pids repeat across machines
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as fh:
            json.dump(cache, fh, separators=(",", ":"))
        os.replace(tmp, path)
    except OSError:
        # A cache, never a reason to fail -- nor to leave a half-written
        # file in the home directory (a full disk, at every sync).
        try:
            os.unlink(tmp)
        except OSError:
            pass


class Stopped(Exception):
    """Hashing was asked to stop (the head's Ctrl-C): what was hashed so far
    is kept in the cache, nothing else is done."""


def file_digest(path: str, stop=None) -> str:
    """sha256 of ``path``; ``stop`` (a threading.Event) is looked at every
    chunk, so a Ctrl-C does not wait for a large file to be read to its end."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            if stop is not None and stop.is_set():
                raise Stopped(path)
            chunk = fh.read(CHUNK)
            if not chunk:
                break
            h.update(chunk)
    return h.hexdigest()


def entry(root: str, rel: str, cache: dict, stop=None):
    """``[kind, mode, size, digest]`` for ``root/rel``, or None when it is missing
    (or a directory); ``cache`` is updated in place."""
    full = os.path.join(root, rel)
    try:
        st = os.lstat(full)
    except OSError:
        return None
    if stat.S_ISLNK(st.st_mode):
        target = os.readlink(full)
        return ["l", 0, len(target.encode()), hashlib.sha256(target.encode()).hexdigest()]
    if not stat.S_ISREG(st.st_mode):
        return None
    key = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
    hit = cache.get(rel)
    if hit is not None and hit[:4] == key:
        digest = hit[4]
    else:
        digest = file_digest(full, stop)
        cache[rel] = key + [digest]
    return ["f", stat.S_IMODE(st.st_mode), st.st_size, digest]


def tree_hash(entries: dict) -> str:
    h = hashlib.sha256()
    for rel in sorted(entries):
        kind, mode, size, digest = entries[rel]
        h.update(f"{rel}\0{kind}\0{mode:o}\0{size}\0{digest}\n".encode())
    return h.hexdigest()


def manifest(root: str, paths: list, use_cache: bool = True, save: bool = True, stop=None) -> dict:
    """Entries and tree hash of ``paths`` under ``root`` (missing ones listed apart).

    ``stop`` (a threading.Event, set by the head on Ctrl-C) ends the hashing
    between two chunks with ``Stopped``; the files hashed until then are
    saved in the cache (a whole, renamed file), so the next sync does not
    hash them again."""
    cache = load_cache(root) if use_cache else {}
    before = dict(cache)
    entries, missing = {}, []
    try:
        for rel in paths:
            e = entry(root, rel, cache, stop)
            if e is None:
                missing.append(rel)
            else:
                entries[rel] = e
    finally:
        if use_cache and save and (cache != before or any(m in cache for m in missing)):
            save_cache(root, {k: v for k, v in cache.items() if k not in missing})
    return {"entries": entries, "missing": missing, "hash": tree_hash(entries)}


def _walk_extra(root: str, scope: list, expected: dict) -> list:
    extra = []
    for top in scope:
        start = os.path.join(root, top) if top else root
        if not os.path.isdir(start) or os.path.islink(start) or (top and linked_dirs(root, [top + "/x"])):
            continue
        for dirpath, dirnames, filenames in os.walk(start):
            dirnames[:] = [
                d
                for d in dirnames
                if d not in PRUNE and not os.path.islink(os.path.join(dirpath, d))
            ]
            rel_dir = os.path.relpath(dirpath, root)
            links = [
                d
                for d in os.listdir(dirpath)
                if os.path.islink(os.path.join(dirpath, d))
                and os.path.isdir(os.path.join(dirpath, d))
            ]
            for name in list(filenames) + links:
                rel = name if rel_dir == "." else rel_dir + "/" + name
                if rel not in expected and name != MARKER and not name.startswith(PROBE):
                    extra.append(rel)
    return sorted(set(extra))


def status(units: list, dry_run: bool = False, mark_all: bool = False, guarded: bool = False) -> list:
    """For each unit ``{"root", "paths": [...], "scope": [dirs] | None, "marks": [dirs]}``:
    the node's entries for those paths (the head compares them with its own),
    its tree hash, with a scope the files it has that are not listed, and the
    ``--delete`` guard's facts about the ``marks`` directories (``guarded``: a
    directory the guard refuses is not walked -- ``--to / --delete`` would
    walk the whole disk only to be refused).

    Outside dry runs it creates the root (so rsync has somewhere to write) and
    marks each ``marks`` directory that is new or empty (every one that is not
    dangerous with ``mark_all``: the user said --force-delete).  A synced
    directory that is a link here is refused before anything is written."""
    out = []
    for unit in units:
        root, paths = os.path.expanduser(unit["root"]), unit["paths"]  # `~/proj`: this node's home
        marks = unit.get("marks") or []
        exists = os.path.isdir(root)
        if not exists and not dry_run:
            make_root(root)
        linked = linked_dirs(root, list(paths) + [m + "/x" for m in marks if m]) if exists else []
        if linked:
            more = " (and %d more)" % (len(linked) - 1) if len(linked) > 1 else ""
            err = link_error(root, linked[0].split("/"))
            raise DestinationError(str(err) + more, err.kind)
        facts = guard(root, marks)
        if not dry_run:
            for f in facts:
                if not f["danger"] and not f["marked"] and (f["empty"] or mark_all):
                    write_marker(root, f["dir"])
        if exists:
            got = manifest(root, paths, save=not dry_run)
        else:
            got = {"entries": {}, "missing": list(paths), "hash": tree_hash({})}
        walk = unit.get("scope") is not None and exists
        if walk and guarded and any(refused(f) for f in facts):
            walk = False  # the head refuses this --delete anyway
        extra = _walk_extra(root, unit["scope"], set(paths)) if walk else []
        out.append({"root": unit["root"], "path": root, "hash": got["hash"], "entries": got["entries"],
                    "extra": extra, "guard": facts})
    return out


def differ(want: dict, have: dict) -> dict:
    """path -> why, for every path of ``want`` whose entry in ``have`` is not the same."""
    out = {}
    for rel, w in want.items():
        h = have.get(rel)
        if h is None:
            out[rel] = "missing"
        elif h[0] != w[0]:
            out[rel] = "kind"
        elif h[2] != w[2] or h[3] != w[3]:
            out[rel] = "content"
        elif h[1] != w[1]:
            out[rel] = "mode"
    return out


def remember(root: str, rel: str, digest: str, st=None) -> None:
    """Record the digest of a file this process just wrote and checked, so the
    verification that follows needs a stat, not another read of the file."""
    if st is None:
        st = os.lstat(os.path.join(root, rel))
    cache = load_cache(root)
    cache[rel] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, digest]
    save_cache(root, cache)


def delete(root: str, paths: list) -> int:
    """Remove ``paths`` (relative to ``root``), then directories they leave empty.

    Each path is reached one directory at a time without following links, so
    ``../proj-other/file`` or ``escape/x`` through a linked directory is never
    touched (a prefix test on path strings let ``/x/proj-other`` pass for
    ``/x/proj``)."""
    count = 0
    dirs = set()
    root = os.path.expanduser(root)
    for rel in paths:
        if not in_dir(root, rel, lambda name, fd: os.unlink(name, dir_fd=fd)):
            continue
        count += 1
        parent = os.path.dirname(rel)
        while parent:
            dirs.add(parent)
            parent = os.path.dirname(parent)
    for rel in sorted(dirs, key=lambda d: -d.count("/")):
        try:
            in_dir(root, rel, lambda name, fd: os.rmdir(name, dir_fd=fd))
        except OSError:
            pass  # not empty: something else lives there
    return count


def probe(argv: list, timeout: float = 15.0) -> str:
    """Can this node run ``argv`` (an ssh to the next node)?  "ok" or why not."""
    try:
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return "timed out"
    except OSError as e:
        return str(e)
    if proc.returncode == 0:
        return "ok"
    lines = [l for l in proc.stderr.splitlines() if l.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"


# ---------------------------------------------------------------------------
# one hop of the streaming chain


def _emit(lock: threading.Lock, line: str) -> None:
    with lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def _start_next(hop: dict, chain: list):
    """Start the ssh to the next hop and send it this module with the rest of the chain."""
    header = dict(globals()["_CORRAL_HEADER"])
    header["args"] = dict(header["args"], name=hop["name"], chain=chain)
    body = json.dumps(header).encode()
    child = subprocess.Popen(
        hop["argv"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    child.stdin.write(str(len(body)).encode() + b"\n" + body)
    return child


def _forward(child, lock: threading.Lock, results: list) -> None:
    for raw in child.stdout:
        line = raw.decode(errors="replace").rstrip("\n")
        if line.startswith(MARK):
            results.append(line[len(MARK) :])
            _emit(lock, HOP + line[len(MARK) :])
        elif line.startswith((PROGRESS, HOP)):
            _emit(lock, line)


def _stopped(signum, frame):
    raise SystemExit(128 + signum)  # unwinds through receive's cleanup


def _on_stop(handler):
    """Install ``handler`` (one, or a dict saved before) for SIGTERM and SIGHUP;
    the handlers it replaced (none off the main thread)."""
    saved = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            saved[sig] = signal.signal(sig, handler[sig] if isinstance(handler, dict) else handler)
        except (ValueError, KeyError):
            pass
    return saved


def receive(
    stream,
    name: str,
    root: str,
    rel: str,
    size: int,
    digest: str,
    mode: int,
    mtime_ns: int,
    chain: list = (),
) -> dict:
    """Write ``size`` bytes from ``stream`` to ``root/rel`` while forwarding them
    to the next hop of ``chain``; verify the sha256; rename into place.

    The file's directory is reached without following links (a link there
    fails this hop, naming it).  When writing here fails (a full disk), the
    partial file is removed at once and the bytes still go on to the next
    hop; on every other failure, a signal included, it is removed too."""
    saved = _on_stop(_stopped)
    lock = threading.Lock()
    root = os.path.expanduser(root)  # the chain passes `~/proj` on: each node's own home
    path = os.path.join(root, rel)
    parts = rel_parts(rel)
    child, fwd, downstream, child_err = None, None, [], None
    dfd = fd = tmp = None
    err = None  # (kind, message) once this node cannot write: it still forwards
    try:
        if chain:
            try:
                child = _start_next(chain[0], list(chain[1:]))
                fwd = threading.Thread(target=_forward, args=(child, lock, downstream), daemon=True)
                fwd.start()
            except OSError as e:
                child_err = "cannot start ssh to {}: {}".format(chain[0]["name"], e)
        try:
            if parts is None:
                raise DestinationError("%r is not a relative path inside %s" % (rel, root), "dest-path")
            dfd = open_dir(root, parts[:-1], create=True)
            tmp, fd = create_tmp(dfd, parts[-1])
        except DestinationError as e:
            err = (e.kind, str(e))
        except OSError as e:
            err = write_error(e, path)
        h = hashlib.sha256()
        done, last = 0, 0.0
        while done < size:
            chunk = stream.read(min(CHUNK, size - done))
            if not chunk:
                break
            if err is None:
                try:
                    write_all(fd, chunk)
                except OSError as e:
                    err = write_error(e, path)
                    discard(dfd, tmp, fd)  # give the space back now, not after the stream
                    tmp = fd = None
            h.update(chunk)
            done += len(chunk)
            if child is not None and child_err is None:
                try:
                    child.stdin.write(chunk)
                except (BrokenPipeError, OSError) as e:
                    child_err = "the next hop ({}) stopped reading: {}".format(chain[0]["name"], e)
            now = time.monotonic()
            if now - last > 0.25:
                last = now
                _emit(lock, f"{PROGRESS}{name} {done}")
        _emit(lock, f"{PROGRESS}{name} {done}")
        if child is not None:
            child_err = _finish_next(child, fwd, downstream, chain[0]["name"], child_err)
        result = {"node": name, "bytes": done, "ok": False, "next_error": child_err}
        if err is not None:
            result["kind"], result["error"] = err
        elif done != size:
            result["error"] = f"stream ended after {done} of {size} bytes"
        elif h.hexdigest() != digest:
            result["error"] = "sha256 mismatch after transfer"
        else:
            try:
                os.fchmod(fd, mode)
                os.utime(fd, ns=(mtime_ns, mtime_ns))
                os.close(fd)  # a network file system may say "full" only now
                fd = None
                os.replace(tmp, parts[-1], src_dir_fd=dfd, dst_dir_fd=dfd)
                tmp = None
                remember(root, rel, digest, os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False))
                result["ok"] = True
            except OSError as e:
                result["kind"], result["error"] = write_error(e, path)
        return result
    finally:
        discard(dfd, tmp, fd)
        if dfd is not None:
            os.close(dfd)
        if child is not None and child.poll() is None:
            _stop_next(child)
        _on_stop(saved)


def _tail(stream, keep: int = 64 * 1024) -> bytes:
    """All of ``stream`` read, its last ``keep`` bytes kept (the next hop's
    login shell decides how much it prints)."""
    tail = b""
    while True:
        chunk = stream.read(256 * 1024)
        if not chunk:
            return tail
        tail = (tail + chunk)[-keep:]


def _finish_next(child, fwd, downstream: list, name: str, child_err):
    """Close the next hop's input and wait for its result; why it failed, if it did."""
    try:
        child.stdin.close()
    except OSError:
        pass
    child.wait()
    if fwd is not None:
        fwd.join(10)
    if not downstream:
        err = _tail(child.stderr).decode(errors="replace").strip().splitlines()
        if err or child_err is None:
            child_err = "{}: {}".format(name, err[-1] if err else f"exit {child.returncode}")
    return child_err


def _stop_next(child) -> None:
    """This hop failed: the next one sees its input end (and cleans up), or is killed."""
    try:
        child.stdin.close()
    except OSError:
        pass
    try:
        child.wait(10)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
