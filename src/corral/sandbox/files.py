"""The files a sandbox writes: per-node configuration and the head's cluster files.

Text builders are pure functions (tested without root); the few writers
set the permissions sshd's StrictModes and the ssh client insist on.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shlex
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import tomlkit

from corral.errors import SandboxError
from corral.sandbox.spec import TEST_USER, SandboxSpec

ETC_HOSTS = Path("/etc/hosts")
#: The state file in a sandbox's state directory (its presence means "this is a sandbox").
STATE_FILE = "sandbox.json"
#: Directories bind-mounted over their namesakes inside a node, with their modes;
#: ``etc`` seeds the upper layer of the node's /etc overlay.
NODE_DIRS = {"ssh": 0o700, "tmp": 0o1777, "var-tmp": 0o1777, "srv": 0o755, "home": 0o755,
             "etc": 0o755}
SFTP_SERVERS = ("/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server", "/usr/libexec/sftp-server")


@dataclass(frozen=True, kw_only=True)
class HostEntry:
    """One line of the hosts block: an address and the node name it answers to."""

    address: str
    name: str


def write_text(path: Path, text: str, mode: int = 0o644, group: int | None = None) -> None:
    """Write atomically (tmp + rename) with ``mode``: readers never see half a file."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
        if group is not None:
            os.fchown(fh.fileno(), -1, group)
        os.fchmod(fh.fileno(), mode)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# /etc/hosts


def _marker(name: str, which: str) -> str:
    return f"# corral-sandbox {name} {which}"


def strip_blocks(text: str, name: str | None = None) -> str:
    """``text`` without the corral-sandbox block of ``name`` (every block if None)."""
    who = re.escape(name) if name else r"\S+"
    pattern = re.compile(
        rf"^# corral-sandbox ({who}) begin\n.*?^# corral-sandbox \1 end\n?", re.MULTILINE | re.DOTALL
    )
    return pattern.sub("", text)


def block_names(text: str) -> list[str]:
    """Names of the sandboxes that have a block in ``text``."""
    return re.findall(r"^# corral-sandbox (\S+) begin$", text, re.MULTILINE)


def hosts_block(name: str, entries: Sequence[HostEntry], state_dir: Path | None = None) -> str:
    """The sandbox's block; ``state_dir`` is recorded in it (``# state-dir PATH``)
    so commands run by another user, or without ``--state-dir``, find the sandbox."""
    lines = [_marker(name, "begin")]
    if state_dir is not None and not re.search(r"[\x00-\x1f]", str(state_dir)):
        lines.append(f"# state-dir {state_dir}")
    lines += [f"{e.address}\t{e.name}" for e in entries]
    lines.append(_marker(name, "end"))
    return "\n".join(lines) + "\n"


def recorded_state_dir(name: str) -> Path | None:
    """Where sandbox ``name`` keeps its state, as its /etc/hosts block says."""
    try:
        return block_state_dirs(ETC_HOSTS.read_text()).get(name)
    except OSError:
        return None


def block_state_dirs(text: str) -> dict[str, Path]:
    """Sandbox name -> the state directory its /etc/hosts block records."""
    found = {}
    pattern = re.compile(r"^# corral-sandbox (\S+) begin\n# state-dir (/.*)$", re.MULTILINE)
    for match in pattern.finditer(text):
        found[match.group(1)] = Path(match.group(2))
    return found


def names_claimed(text: str, *, exclude: str) -> dict[str, str]:
    """Host names in ``text`` outside the block of sandbox ``exclude``: name -> owner.

    The owner is ``sandbox <other>`` for another sandbox's block, else
    ``/etc/hosts``.  ``up`` refuses node names that are already claimed.
    """
    claimed: dict[str, str] = {}
    owner = "/etc/hosts"
    for line in text.splitlines():
        begin = re.match(r"^# corral-sandbox (\S+) begin", line)
        if begin:
            owner = f"sandbox {begin.group(1)}"
            continue
        if re.match(r"^# corral-sandbox \S+ end", line):
            owner = "/etc/hosts"
            continue
        if owner == f"sandbox {exclude}":
            continue
        fields = line.split("#", 1)[0].split()
        for host in fields[1:]:
            claimed.setdefault(host, owner)
    return claimed


@contextmanager
def locked_etc_hosts(path: Path = ETC_HOSTS) -> Iterator[tuple[str, _Writer]]:
    """Hold an exclusive lock on /etc/hosts: it is also the machine-wide lock
    under which sandboxes pick subnets, so two ``up`` never take the same one."""
    try:
        fh = open(path, "r+")  # noqa: SIM115 - closed by the `with fh` below, after the error path
    except OSError as err:
        raise SandboxError(
            f"{path}: cannot open for writing ({err.strerror})",
            hint="the sandbox adds its node names to /etc/hosts; run it as root",
        ) from None
    with fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        text = fh.read()
        yield text, _Writer(fh)


class _Writer:
    """Rewrites /etc/hosts in place (it may be a bind mount that rename cannot replace)."""

    def __init__(self, fh):  # type: ignore[no-untyped-def]
        self._fh = fh

    def __call__(self, text: str) -> None:
        self._fh.seek(0)
        self._fh.write(text)
        self._fh.truncate()
        self._fh.flush()


def with_block(text: str, name: str, entries: Sequence[HostEntry],
               state_dir: Path | None = None) -> str:
    base = strip_blocks(text, name)
    if base and not base.endswith("\n"):
        base += "\n"
    return base + hosts_block(name, entries, state_dir) if entries else base


# ---------------------------------------------------------------------------
# per-node files


def node_nsswitch(head: str | None) -> str:
    """A node's /etc/nsswitch.conf: the head's, with host names from /etc/hosts only.

    Nodes have no route to a DNS server, so a lookup that misses /etc/hosts
    failed with "temporary failure in name resolution" where a real network's
    DNS answers "no such name" at once.  torch's TCPStore asks for the name of
    every client (``::ffff:10.x.y.z``: the files resolver does not unmap it)
    and warned "The hostname of the client socket cannot be retrieved" for
    every rank of every run; now the lookup falls back to the address.
    """
    lines = [l for l in (head or "").splitlines() if not re.match(r"\s*hosts\s*:", l)]
    lines += ["# corral sandbox: nodes have no DNS server; host names come from /etc/hosts",
              "hosts: files"]
    return "\n".join(lines) + "\n"


def sshd_config(spec: SandboxSpec, *, run_dir: str) -> str:
    """A distro-like sshd_config: keys for root, passwords only for the test user."""
    sftp = next((p for p in SFTP_SERVERS if os.path.exists(p)), "internal-sftp")
    lines = [
        f"# corral sandbox {spec.name}: one sshd per node, like a fresh server.",
        f"Port {spec.ssh_port}",
        "AddressFamily inet",
        "ListenAddress 0.0.0.0",
        f"HostKey {run_dir}/ssh_host_ed25519_key",
        f"PidFile {run_dir}/sshd.pid",
        "UsePAM no",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "AuthorizedKeysFile .ssh/authorized_keys",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitEmptyPasswords no",
        "StrictModes yes",
        "PrintMotd no",
        "AcceptEnv LANG LC_*",
        f"Subsystem sftp {sftp}",
    ]
    if spec.password_auth:
        lines += [f"Match User {TEST_USER}", "    PasswordAuthentication yes"]
    return "\n".join(lines) + "\n"


def accounts(
    passwd: str, shadow: str, group: str, *, test_user: tuple[int, str, str] | None
) -> tuple[str, str, str]:
    """Node-private copies of the account files.

    Root keeps its entry, but a locked password field (``!``) becomes ``*``:
    with ``UsePAM no`` sshd refuses *key* logins to locked accounts, which a
    real server with PAM would allow.  ``test_user`` is ``(uid, home, hash)``.
    """
    shadow_lines = []
    for line in shadow.splitlines():
        fields = line.split(":")
        if fields[0] == "root" and len(fields) > 1 and fields[1].startswith("!"):
            fields[1] = "*"
        if fields[0] != TEST_USER:
            shadow_lines.append(":".join(fields))
    passwd_lines = [l for l in passwd.splitlines() if l.split(":")[0] != TEST_USER]
    group_lines = [l for l in group.splitlines() if l.split(":")[0] != TEST_USER]
    if test_user is not None:
        uid, home, hashed = test_user
        passwd_lines.append(f"{TEST_USER}:x:{uid}:{uid}:corral sandbox test user:{home}:/bin/bash")
        group_lines.append(f"{TEST_USER}:x:{uid}:")
        shadow_lines.append(f"{TEST_USER}:{hashed}:19000:0:99999:7:::")
    return tuple("\n".join(ls) + "\n" for ls in (passwd_lines, shadow_lines, group_lines))  # type: ignore[return-value]


def free_uid(passwd: str, group: str, start: int = 2000) -> int:
    used = {int(l.split(":")[2]) for l in passwd.splitlines() + group.splitlines() if l.count(":") >= 2 and l.split(":")[2].isdigit()}
    uid = start
    while uid in used:
        uid += 1
    return uid


def hash_password(password: str) -> str:
    """SHA-512 crypt hash (``$6$``) of ``password``, as /etc/shadow wants it."""
    try:
        proc = subprocess.run(
            ["openssl", "passwd", "-6", "-stdin"],
            check=False,
            input=password + "\n",
            capture_output=True,
            text=True,
            timeout=10,
        )
    except FileNotFoundError:
        proc = None
    if proc is not None and proc.returncode == 0 and proc.stdout.startswith("$6$"):
        return proc.stdout.strip()
    raise SandboxError(
        "cannot hash the test user's password: `openssl passwd -6` is not available",
        hint="apt-get install openssl",
    )


def generate_host_keys(node_dirs: Sequence[Path], comments: Sequence[str]) -> None:
    """One ed25519 host key per node that has none yet (in parallel: 32 nodes, one wait)."""
    procs = []
    for node_dir, comment in zip(node_dirs, comments):
        key = node_dir / "ssh_host_ed25519_key"
        if key.exists() and key.with_suffix(".pub").exists():
            continue
        key.unlink(missing_ok=True)
        procs.append((key, subprocess.Popen(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )))
    for key, proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise SandboxError(f"ssh-keygen for {key} failed: {out.strip()}")


def generate_user_key(path: Path, comment: str) -> None:
    if path.exists() and Path(str(path) + ".pub").exists():
        return
    path.unlink(missing_ok=True)
    proc = subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, check=False,
    )
    if proc.returncode != 0:
        raise SandboxError(f"ssh-keygen for {path} failed: {(proc.stderr or proc.stdout).strip()}")


# ---------------------------------------------------------------------------
# head-side cluster files


def hostfile(spec: SandboxSpec) -> str:
    lines = [f"# corral sandbox {spec.name} (DeepSpeed/OpenMPI hostfile format)"]
    lines += [f"{n.name} slots={spec.slots}" for n in spec.all_nodes()]
    return "\n".join(lines) + "\n"


def known_host_patterns(name: str, address: str, port: int) -> str:
    if port == 22:
        return f"{name},{address}"
    return f"[{name}]:{port},[{address}]:{port}"


def known_hosts(spec: SandboxSpec, host_keys: dict[str, str]) -> str:
    """``host_keys``: node name -> the ``ssh-ed25519 AAAA...`` public key line."""
    lines = []
    for node in spec.all_nodes():
        key = " ".join(host_keys[node.name].split()[:2])
        lines.append(f"{known_host_patterns(node.name, spec.address(node.index), spec.ssh_port)} {key}")
    return "\n".join(lines) + "\n"


def ssh_options(spec: SandboxSpec, state_dir: Path) -> list[str]:
    """The ``-o`` options that make the head's ssh use the sandbox's own files.

    Host keys always come from ``<state>/known_hosts`` (empty without
    ``--with-keys``, i.e. a true first contact), so nothing is ever written to
    the user's own ``~/.ssh/known_hosts``.
    """
    opts = [f"UserKnownHostsFile={state_dir / 'known_hosts'}"]
    if spec.with_keys:
        opts += [f"IdentityFile={state_dir / 'id_ed25519'}", "IdentitiesOnly=yes"]
    return opts


def corral_toml(spec: SandboxSpec, state_dir: Path, python: str) -> str:
    doc = tomlkit.document()
    doc.add(tomlkit.comment(f"Written by `corral sandbox up` for sandbox {spec.name!r}; rewritten by every `up`."))
    doc.add(tomlkit.comment(f"Use: corral run --cluster {state_dir / 'corral.toml'} train.py"))
    cluster = tomlkit.table()
    cluster["name"] = spec.name
    cluster["python"] = python
    cluster["slots"] = spec.slots
    cluster["user"] = spec.login_user
    cluster["port"] = spec.ssh_port
    cluster["ssh_options"] = ssh_options(spec, state_dir)
    doc["cluster"] = cluster
    hosts = tomlkit.aot()
    for node in spec.all_nodes():
        entry = tomlkit.table()
        entry["name"] = node.name
        entry["address"] = spec.address(node.index)
        hosts.append(entry)
    doc["hosts"] = hosts
    return tomlkit.dumps(doc)


def _quote(value: str) -> str:
    return f'"{value}"' if re.search(r"\s", value) else value


def ssh_config(spec: SandboxSpec, state_dir: Path) -> str:
    names = [n.name for n in spec.all_nodes()]
    lines = [
        f"# corral sandbox {spec.name}: use with `ssh -F {_quote(str(state_dir / 'ssh_config'))} {names[0]}`",
        "# or `Include` it from ~/.ssh/config.",
    ]
    for node in spec.all_nodes():
        lines += [f"Host {node.name}", f"    HostName {spec.address(node.index)}"]
    lines += [f"Host {' '.join(names)}", f"    User {spec.login_user}", f"    Port {spec.ssh_port}"]
    lines.append("    StrictHostKeyChecking yes")
    for opt in ssh_options(spec, state_dir):
        key, value = opt.split("=", 1)
        lines.append(f"    {key} {_quote(value)}")
    return "\n".join(lines) + "\n"


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except PermissionError:
        raise SandboxError(f"{path}: not readable by you (uid {os.getuid()}): it is root's",
                           hint="run it with sudo, or have root start the sandbox for you: "
                                "sudo corral sandbox up N --with-keys --for $USER") from None
    except (OSError, ValueError) as err:
        raise SandboxError(f"{path}: unreadable sandbox state ({err})", hint="corral sandbox down, then up again") from None


def shell_join(argv: Sequence[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)
