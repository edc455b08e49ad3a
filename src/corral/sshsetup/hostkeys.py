"""Host keys: scan them, show their fingerprints, check them against known_hosts.

The head is where trust starts.  For every host, ``ssh -G`` says where ssh
will look up its key (``UserKnownHostsFile``, ``GlobalKnownHostsFile``) and
under which name (``HostKeyAlias``, else ``HostName``, as ``[name]:port``
for other ports than 22); ``ssh-keyscan`` fetches the keys the host offers;
``ssh-keygen -F`` finds what the head already knows (hashed entries
included).  Then each host is:

- ``known``: a key it offers is already trusted: only trusted keys are used;
- ``new``: nothing is known: first contact, the user checks the
  fingerprints (``ssh-keygen -l``) or passes ``--accept-new``;
- ``changed``: a key of a type it offers is known and differs: an error
  naming the host, never bypassed.

The keys that come out of this are the only ones a setup session trusts
(ssh is pinned to them through a session known_hosts file) and the only ones
written into the nodes' known_hosts.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import logging
import os
import pwd
import re
import socket
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from corral.errors import HostError
from corral.model import Cluster, Host
from corral.transport.ssh import SSHTransport

log = logging.getLogger(__name__)

KEYSCAN_TIMEOUT_S = 5


@dataclass(frozen=True, kw_only=True)
class Target:
    """How ssh on the head reaches one host, from ``ssh -G``."""

    host: Host
    hostname: str
    port: int
    user: str
    #: The name ssh looks the key up under (HostKeyAlias, else HostName).
    key_name: str
    known_hosts: tuple[str, ...]
    global_known_hosts: tuple[str, ...]
    hash_known_hosts: bool
    identity_files: tuple[str, ...] = ()

    @property
    def lookup(self) -> str:
        return host_pattern(self.key_name, self.port)


@dataclass(frozen=True, kw_only=True)
class HostKeys:
    """The verdict on one host's keys."""

    target: Target
    status: str  # "known" | "new" | "changed"
    #: (type, base64 blob) the session may trust: verified ones, or first-contact ones.
    keys: tuple[tuple[str, str], ...] = ()
    fingerprints: tuple[str, ...] = field(default=())
    detail: str = ""


def host_pattern(name: str, port: int) -> str:
    return name if port == 22 else f"[{name}]:{port}"


def ssh_home() -> str:
    """The home ssh expands ``~`` to: the password database's, not $HOME."""
    try:
        return pwd.getpwuid(os.getuid()).pw_dir
    except KeyError:
        return os.path.expanduser("~")


def expand(path: str) -> str:
    if path == "~" or path.startswith("~/"):
        return ssh_home() + path[1:]
    return path.replace("%d", ssh_home()).replace("%%", "%")


def resolve(cluster: Cluster) -> list[Target]:
    """``ssh -G`` for every host (in parallel; no network I/O)."""
    with ThreadPoolExecutor(max_workers=min(16, len(cluster.hosts))) as pool:
        return list(pool.map(lambda h: _target(cluster, h), cluster.hosts))


def _target(cluster: Cluster, host: Host) -> Target:
    # Exactly the options corral's transport passes, so -G answers for the real connection.
    base = SSHTransport(cluster).base_argv(host)
    argv = [base[0], "-G", *base[1:]]
    proc = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=15, check=False
    )
    if proc.returncode != 0:
        raise HostError(
            host.name,
            f"ssh cannot read its configuration: {proc.stderr.strip()}",
            hint=f"`{' '.join(argv)}` shows the problem",
        )
    fields: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        key, _, value = line.partition(" ")
        fields.setdefault(key.lower(), []).append(value.strip())

    def one(key: str, default: str = "") -> str:
        return fields.get(key, [default])[0]

    hostname = one("hostname", host.name)
    return Target(
        host=host,
        hostname=hostname,
        port=int(one("port", "22")),
        user=one("user"),
        key_name=one("hostkeyalias") or hostname,
        known_hosts=tuple(
            expand(p) for p in " ".join(fields.get("userknownhostsfile", [])).split()
        ),
        global_known_hosts=tuple(" ".join(fields.get("globalknownhostsfile", [])).split()),
        hash_known_hosts=one("hashknownhosts", "no") == "yes",
        identity_files=tuple(expand(p) for p in fields.get("identityfile", [])),
    )


async def scan(target: Target) -> list[tuple[str, str]]:
    """The host keys ``target`` offers, as (type, blob); HostError when none."""
    argv = ["ssh-keyscan", "-T", str(KEYSCAN_TIMEOUT_S), "-p", str(target.port), target.hostname]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    keys = parse_keys(out.decode(errors="replace"))
    if not keys:
        reason = [
            l for l in err.decode(errors="replace").splitlines() if l and not l.startswith("#")
        ]
        hint = ("check that the host is up and sshd listens on that port "
                "(containers often use `port = 2222` in corral.toml)")
        if reason and re.search(r"Name or service not known|Could not resolve|nodename nor servname|"
                                r"Temporary failure in name resolution", reason[-1]):
            # Nothing was dialled: sshd and its port are not the question.
            hint = (f"the name {target.hostname!r} does not resolve: check the spelling, /etc/hosts "
                    "or DNS, or give the host's `address` in corral.toml")
        elif reason and re.search(r"Connection (closed|reset) by|kex_exchange_identification", reason[-1]):
            # It answered, then dropped the connections before the key
            # exchange: ssh-keyscan opens one per key type at once.
            hint = ("its sshd dropped the connections before the key exchange: too many at once "
                    "(its MaxStartups; ssh-keyscan opens one per key type, so a MaxStartups under 4 "
                    "or a busy sshd is enough), or an /etc/hosts.deny rule; raise MaxStartups in its "
                    "sshd_config, or retry when it is less busy")
        raise HostError(
            target.host.name,
            f"no SSH host key from {target.hostname}:{target.port}"
            + (f" ({reason[-1]})" if reason else ""),
            hint=hint,
            kind="unreachable",
        )
    return keys


def parse_keys(text: str) -> list[tuple[str, str]]:
    """(type, blob) pairs from known_hosts-format lines (markers and comments skipped)."""
    keys: list[tuple[str, str]] = []
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#") or fields[0].startswith("@"):
            continue
        if len(fields) >= 3 and (fields[1], fields[2]) not in keys:
            keys.append((fields[1], fields[2]))
    return keys


def known_keys(target: Target) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(trusted, revoked) keys the head has for ``target`` (``ssh-keygen -F``)."""
    trusted: list[tuple[str, str]] = []
    revoked: list[tuple[str, str]] = []
    for path in (*target.known_hosts, *target.global_known_hosts):
        if not os.path.isfile(path):
            continue
        proc = subprocess.run(
            ["ssh-keygen", "-F", target.lookup, "-f", path],
            capture_output=True,
            text=True,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        for line in proc.stdout.splitlines():
            fields = line.split()
            if not fields or fields[0].startswith("#"):
                continue
            if fields[0] == "@revoked" and len(fields) >= 4:
                revoked.append((fields[2], fields[3]))
            elif fields[0] == "@cert-authority":
                continue
            elif len(fields) >= 3:
                trusted.append((fields[1], fields[2]))
    return trusted, revoked


def judge(target: Target, offered: list[tuple[str, str]]) -> HostKeys:
    """Compare what a host offers with what the head knows."""
    trusted, revoked = known_keys(target)
    bad = [k for k in offered if k in revoked]
    if bad:
        return HostKeys(
            target=target, status="changed", detail=f"its {bad[0][0]} key is marked @revoked"
        )
    matching = [k for k in offered if k in trusted]
    if matching:
        return HostKeys(target=target, status="known", keys=tuple(matching))
    if trusted:
        known_types = sorted({t for t, _ in trusted})
        return HostKeys(
            target=target,
            status="changed",
            detail=f"it offers {', '.join(t for t, _ in offered)} key(s) that differ from the "
            f"{', '.join(known_types)} key(s) known for {target.lookup}",
        )
    return HostKeys(
        target=target, status="new", keys=tuple(offered), fingerprints=tuple(fingerprints(offered))
    )


def fingerprints(keys: list[tuple[str, str]]) -> list[str]:
    """``ssh-keygen -l`` lines ("256 SHA256:... (ED25519)") for each key."""
    text = "".join(f"key {t} {b}\n" for t, b in keys)
    proc = subprocess.run(
        ["ssh-keygen", "-l", "-f", "-"], input=text, capture_output=True, text=True, check=False
    )
    out = []
    for line in proc.stdout.splitlines():
        fields = line.split()
        if len(fields) >= 3:
            out.append(f"{fields[1]} ({fields[-1].strip('()')})")
    return out


def changed_error(verdict: HostKeys) -> HostError:
    t = verdict.target
    return HostError(
        t.host.name,
        f"its host key has CHANGED: {verdict.detail}",
        hint=f"if {t.host.name} was reinstalled, check the new key out of band, then "
        f"`ssh-keygen -R '{t.lookup}'` and run again; otherwise this may be an attack",
        kind="host-key-changed",
    )


# ---------------------------------------------------------------------------
# known_hosts lines


def patterns(names: list[str], port: int) -> list[str]:
    """Unique ``name`` / ``[name]:port`` patterns, in order."""
    out: list[str] = []
    for name in names:
        pat = host_pattern(name, port)
        if name and pat not in out:
            out.append(pat)
    return out


def known_hosts_lines(
    names: list[str], port: int, keys: tuple[tuple[str, str], ...], *, hashed: bool = False
) -> list[str]:
    """known_hosts lines for one host under all its names (hashed like ssh does)."""
    pats = patterns(names, port)
    if not hashed:
        return [f"{','.join(pats)} {t} {b}" for t, b in keys]
    return [f"{hash_pattern(p)} {t} {b}" for p in pats for t, b in keys]


def hash_pattern(pattern: str, salt: bytes | None = None) -> str:
    """OpenSSH's hashed host name: ``|1|base64(salt)|base64(HMAC-SHA1(salt, name))``."""
    salt = salt if salt is not None else os.urandom(20)
    digest = hmac.new(salt, pattern.encode(), hashlib.sha1).digest()
    return f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"


def address_of(target: Target) -> str | None:
    """An IP address for ``target`` (its HostName, resolved here when a name)."""
    try:
        ipaddress.ip_address(target.hostname)
        return target.hostname
    except ValueError:
        pass
    try:
        return socket.getaddrinfo(target.hostname, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, IndexError):
        return None
