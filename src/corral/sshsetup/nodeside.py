"""What ``corral ssh setup`` does *on* a node (stdlib only, Python 3.8+).

Shipped as source over ssh (see ``remote.py``) and also imported by the head
for its own known_hosts.  Every change lives in a marked block::

    # corral begin <cluster-id>
    ...
    # corral end <cluster-id>

in ``~/.ssh/authorized_keys``, ``~/.ssh/known_hosts``, ``~/.ssh/config`` and
``/etc/hosts``, and a manifest (``~/.ssh/corral-manifest.json``) records
which files, directories and keys corral *created*, for which cluster id.
``teardown`` removes exactly the blocks and the things it created (a key only
when corral generated it and no other cluster id still uses it), so a node
goes back to how it was.  Nothing here reads or sends a private key: only
``.pub`` files leave the node.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import socket
import subprocess
import threading

MANIFEST = "corral-manifest.json"
KEY_NAME = "id_ed25519"
ETC_HOSTS = "/etc/hosts"
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # fullmatch: `$` takes a "\n"
#: Files a setup may hold a block in: kind -> (path relative to ~ or absolute, mode if created).
FILES = {
    "authorized_keys": (".ssh/authorized_keys", 0o600),
    "known_hosts": (".ssh/known_hosts", 0o644),
    "ssh_config": (".ssh/config", 0o600),
    "etc_hosts": (ETC_HOSTS, 0o644),
}


class NodeError(Exception):
    """A problem the head reports under this node's name (``kind`` for the hint)."""

    def __init__(self, message: str, kind: str = "error"):
        super().__init__(message)
        self.kind = kind


# ---------------------------------------------------------------------------
# marked blocks (pure)


def begin_marker(cid: str) -> str:
    return f"# corral begin {cid}"


def end_marker(cid: str) -> str:
    return f"# corral end {cid}"


def check_id(cid: str) -> str:
    if not isinstance(cid, str) or not _ID_RE.fullmatch(cid):
        raise NodeError(f"bad cluster id {cid!r}: use letters, digits, '.', '_' and '-'", "usage")
    return cid


def find_block(text: str, cid: str):
    """(start, end) of the block of ``cid`` (end after its newline), or None."""
    begin, end = begin_marker(cid), end_marker(cid)
    pos = 0
    while True:
        start = text.find(begin, pos)
        if start < 0:
            return None
        line_end = text.find("\n", start)
        whole = text[start : line_end if line_end >= 0 else len(text)]
        if (start == 0 or text[start - 1] == "\n") and whole.rstrip() == begin:
            stop = text.find("\n" + end, start)
            if stop < 0:
                raise NodeError(f"unterminated corral block {cid!r} (no {end!r} line)", "corrupt")
            stop = text.find("\n", stop + 1)
            return start, (len(text) if stop < 0 else stop + 1)
        pos = start + 1


def block_lines(text: str, cid: str):
    """The lines inside the block of ``cid`` (None when there is no block)."""
    span = find_block(text, cid)
    if span is None:
        return None
    inner = text[span[0] : span[1]].splitlines()[1:-1]
    return inner


def render_block(cid: str, lines) -> str:
    return "\n".join([begin_marker(cid)] + list(lines) + [end_marker(cid)]) + "\n"


def set_block(text: str, cid: str, lines):
    """``text`` with the block of ``cid`` holding ``lines``: (new text, newline added).

    An existing block is replaced where it is; a new one is appended.  When
    ``text`` does not end with a newline one is added before the block, and
    reported, so that ``strip_block`` can take it away again.
    """
    span = find_block(text, cid)
    block = render_block(cid, lines)
    if span is not None:
        return text[: span[0]] + block + text[span[1] :], False
    if text and not text.endswith("\n"):
        return text + "\n" + block, True
    return text + block, False


def strip_block(text: str, cid: str, newline_added: bool = False) -> str:
    """``text`` without the block of ``cid`` (and the newline ``set_block`` added)."""
    span = find_block(text, cid)
    if span is None:
        return text
    start, end = span
    if newline_added and end == len(text) and start > 0 and text[start - 1] == "\n":
        start -= 1
    return text[:start] + text[end:]


# ---------------------------------------------------------------------------
# files and the manifest


def home() -> str:
    """The login user's home, as sshd and ssh see it (the password database)."""
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return os.path.expanduser("~")


def path_of(kind: str) -> str:
    rel, _ = FILES[kind]
    return rel if rel.startswith("/") else os.path.join(home(), rel)


def read(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except FileNotFoundError:
        return ""


def write(path: str, text: str, mode: int) -> None:
    """Replace ``path`` atomically, keeping its mode; in place for /etc/hosts
    (often a bind mount that rename cannot replace)."""
    if path == ETC_HOSTS:
        try:
            with open(path, "r+", encoding="utf-8") as fh:
                fh.write(text)
                fh.truncate()
            return
        except PermissionError:
            raise NodeError(f"cannot write {path} as {_user()}", "etc-hosts-denied") from None
    try:
        mode = os.stat(path).st_mode & 0o7777
    except FileNotFoundError:
        pass
    tmp = f"{path}.corral-tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _user() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def manifest_path() -> str:
    return os.path.join(home(), ".ssh", MANIFEST)


def load_manifest() -> dict:
    text = read(manifest_path())
    if not text.strip():
        return {"version": 1, "blocks": {}, "created": {}, "newline": {}}
    data = json.loads(text)
    for key in ("blocks", "created", "newline"):
        data.setdefault(key, {})
    return data


def save_manifest(data: dict) -> None:
    if not data["blocks"] and not data["created"]:
        if os.path.exists(manifest_path()):
            os.unlink(manifest_path())
        return
    write(manifest_path(), json.dumps(data, indent=1, sort_keys=True) + "\n", 0o600)


def _note_created(man: dict, path: str, cid: str) -> None:
    users = man["created"].setdefault(path, [])
    if cid not in users:
        users.append(cid)


def _uses(man: dict, path: str, cid: str) -> None:
    """``cid`` relies on ``path``: if corral created it, teardown of others keeps it."""
    if path in man["created"] and cid not in man["created"][path]:
        man["created"][path].append(cid)


def ensure_ssh_dir(man: dict, cid: str, dry_run: bool) -> list:
    d = os.path.join(home(), ".ssh")
    if os.path.isdir(d):
        _uses(man, d, cid)
        return []
    if not dry_run:
        os.makedirs(d, mode=0o700)
        os.chmod(d, 0o700)
        _note_created(man, d, cid)
    return ["created ~/.ssh"]


# ---------------------------------------------------------------------------
# calls from the head


def _public_key(key: str) -> str:
    pub = key + ".pub"
    if os.path.exists(pub):
        return read(pub).strip()
    proc = subprocess.run(
        ["ssh-keygen", "-y", "-P", "", "-f", key],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise NodeError(
            f"{key} has no .pub and has a passphrase; node-to-node logins need a key without one",
            "key-passphrase",
        )
    return proc.stdout.strip()


def inspect(cluster_id: str, dry_run: bool = False) -> dict:
    """Facts the plan needs, and this node's key (generated here when absent)."""
    cid = check_id(cluster_id)
    man = load_manifest()
    changes = ensure_ssh_dir(man, cid, dry_run)
    key = os.path.join(home(), ".ssh", KEY_NAME)
    pub = None
    if os.path.exists(key):
        pub = _public_key(key)
        _uses(man, key, cid)
        _uses(man, key + ".pub", cid)
    elif dry_run:
        changes.append(f"generated ~/.ssh/{KEY_NAME}")
    else:
        comment = f"corral@{socket.gethostname()}"
        proc = subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", key],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise NodeError(f"ssh-keygen failed: {proc.stdout.strip()}", "keygen")
        _note_created(man, key, cid)
        _note_created(man, key + ".pub", cid)
        pub = read(key + ".pub").strip()
        changes.append(f"generated ~/.ssh/{KEY_NAME}")
    if not dry_run:
        save_manifest(man)
    names = [socket.gethostname()]
    fqdn = socket.getfqdn()
    if fqdn and fqdn not in names and fqdn != "localhost":
        names.append(fqdn)
    return {
        "user": _user(),
        "uid": os.getuid(),
        "home": home(),
        "hostnames": names,
        "public_key": pub,
        "changes": changes,
        "etc_hosts_writable": os.access(ETC_HOSTS, os.W_OK),
        "has_block": {k: block_lines(read(path_of(k)), cid) is not None for k in FILES},
    }


def apply(cluster_id: str, blocks: dict, dry_run: bool = False) -> list:
    """Make each named file's block hold exactly the given lines; the changes.

    ``blocks`` maps a kind of ``FILES`` to its lines; kinds left out are not
    touched.  Returns human-readable changes ("known_hosts: +3 -0 lines").
    """
    cid = check_id(cluster_id)
    man = load_manifest()
    changes = ensure_ssh_dir(man, cid, dry_run)
    for kind, lines in sorted(blocks.items()):
        path = path_of(kind)
        _, mode = FILES[kind]
        existed = os.path.exists(path)
        text = read(path)
        old = block_lines(text, cid)
        if old == list(lines):
            _uses(man, path, cid)
            continue
        if kind == "etc_hosts" and not os.access(path, os.W_OK):
            raise NodeError(f"{path} is not writable for {_user()}", "etc-hosts-denied")
        new_text, newline = set_block(text, cid, lines)
        added = len(set(lines) - set(old or []))
        removed = len(set(old or []) - set(lines))
        what = "updated" if old is not None else "added block"
        changes.append(f"{_short(path)}: {what} (+{added} -{removed} lines)")
        if dry_run:
            continue
        write(path, new_text, mode)
        if not existed:
            _note_created(man, path, cid)
        else:
            _uses(man, path, cid)
        if newline:
            man["newline"].setdefault(path, [])
            if cid not in man["newline"][path]:
                man["newline"][path].append(cid)
        if path not in man["blocks"].setdefault(cid, []):
            man["blocks"][cid].append(path)
    if not dry_run:
        save_manifest(man)
    return changes


def add_authorized_key(
    cluster_id: str, key: str, dry_run: bool = False, etc_hosts: bool = False
) -> list:
    """Put the head's key into this cluster's authorized_keys block (kept: the rest).

    The one thing done over a password connection; everything else then
    runs over key logins.
    """
    cid = check_id(cluster_id)
    if etc_hosts and not os.access(ETC_HOSTS, os.W_OK):  # say so before changing anything
        raise NodeError(f"{ETC_HOSTS} is not writable for {_user()}", "etc-hosts-denied")
    lines = block_lines(read(path_of("authorized_keys")), cid) or []
    if key.strip() in lines:
        return []
    return apply(cid, {"authorized_keys": lines + [key.strip()]}, dry_run)


def _short(path: str) -> str:
    h = home()
    return "~" + path[len(h) :] if path.startswith(h + "/") else path


def teardown(cluster_id: str, dry_run: bool = False) -> list:
    """Remove the blocks of ``cluster_id`` and whatever corral created for it only."""
    cid = check_id(cluster_id)
    man = load_manifest()
    changes = []
    paths = list(man["blocks"].get(cid, []))
    for kind in FILES:  # also blocks a lost manifest no longer lists
        if path_of(kind) not in paths and block_lines(read(path_of(kind)), cid) is not None:
            paths.append(path_of(kind))
    after = {}
    for path in paths:
        text = read(path)
        if find_block(text, cid) is None:
            continue
        after[path] = strip_block(text, cid, cid in man["newline"].get(path, []))
        changes.append(f"{_short(path)}: removed block")
        if not dry_run:
            write(path, after[path], 0o600)
    # Forget this id; what no other id uses any more is corral's to delete.
    man["blocks"].pop(cid, None)
    orphans = []
    for path in list(man["created"]):
        if cid not in man["created"][path]:
            continue
        users = [u for u in man["created"][path] if u != cid]
        if users:
            man["created"][path] = users
        else:
            del man["created"][path]
            orphans.append(path)
    for path in list(man["newline"]):
        man["newline"][path] = [u for u in man["newline"][path] if u != cid]
        if not man["newline"][path]:
            del man["newline"][path]
    deleted = set()
    for path in sorted(p for p in orphans if os.path.isfile(p) or os.path.islink(p)):
        content = after.get(path, None)
        is_key = os.path.basename(path) in (KEY_NAME, KEY_NAME + ".pub")
        if is_key or not (read(path) if content is None else content).strip():
            changes.append(f"deleted {_short(path)}")
            deleted.add(path)
            if not dry_run:
                os.unlink(path)
    manifest_goes = not man["blocks"] and not man["created"]
    if not dry_run:
        save_manifest(man)
    for path in sorted((p for p in orphans if os.path.isdir(p)), reverse=True):
        left = [
            n
            for n in os.listdir(path)
            if os.path.join(path, n) not in deleted and not (n == MANIFEST and manifest_goes)
        ]
        if not left:
            changes.append(f"deleted {_short(path)}")
            if not dry_run:
                os.rmdir(path)
    return changes


def matrix(targets: list, timeout: float = 10.0) -> dict:
    """Log in to every target in parallel (``argv`` each); name -> "ok" | reason."""
    out = {}

    def one(target: dict) -> None:
        try:
            proc = subprocess.run(
                target["argv"],
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            out[target["name"]] = f"timed out after {timeout:.0f}s"
            return
        except OSError as e:
            out[target["name"]] = f"cannot run ssh: {e}"
            return
        if proc.returncode == 0:
            out[target["name"]] = "ok"
        else:
            lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
            out[target["name"]] = lines[-1] if lines else f"exit code {proc.returncode}"

    threads = [threading.Thread(target=one, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
