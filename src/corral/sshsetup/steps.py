"""The steps ``setup``, ``teardown`` and ``check`` share: trusting host keys,
choosing this machine's key, logging in (by key, else once by password), and
corral's block in this machine's known_hosts.

``Asker`` is how these steps ask the user (the CLI prompts on the terminal,
tests answer); ``SetupOptions`` is what the user asked for.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from corral.errors import HostError, PreflightError, UsageError
from corral.model import Cluster, Host
from corral.sshsetup import hostkeys, keys, nodeside
from corral.sshsetup.hostkeys import HostKeys
from corral.sshsetup.remote import gather_hosts
from corral.sshsetup.session import Session

log = logging.getLogger(__name__)

#: Password attempts per host before giving up (interactive only).
PASSWORD_ATTEMPTS = 3
ETC_HOSTS_HINT = (
    'run setup as root for --etc-hosts (user = "root" in the cluster file), '
    "or leave --etc-hosts out and use --ssh-config"
)


class Asker(Protocol):
    """How the library asks the user (the CLI prompts; tests answer)."""

    interactive: bool

    def trust(self, new: list[HostKeys]) -> bool: ...
    def passwords(self, hosts: list[Host], *, retry: bool) -> dict[str, str]: ...
    def make_key(self, path: Path) -> bool: ...
    def step(self, text: str) -> None: ...


@dataclass(frozen=True, kw_only=True)
class SetupOptions:
    cluster_id: str
    identity: Path | None = None
    accept_new: bool = False
    ssh_config: bool = False
    etc_hosts: bool = False
    dry_run: bool = False
    connect_timeout: float = 10.0


async def check_host_keys(
    cluster: Cluster, options: SetupOptions, asker: Asker
) -> dict[str, HostKeys]:
    """Verdict per host, in cluster order; raises on changed keys or refused trust."""
    targets = hostkeys.resolve(cluster)
    asker.step(f"scanning host keys of {len(targets)} host(s)")

    async def one(host: Host) -> Any:
        target = next(t for t in targets if t.host.name == host.name)
        return hostkeys.judge(target, await hostkeys.scan(target))

    verdicts, problems = await gather_hosts(list(cluster.hosts), one)
    if problems:
        raise PreflightError(problems, what="host key scan")
    changed = [hostkeys.changed_error(v) for v in verdicts.values() if v.status == "changed"]
    if changed:
        raise PreflightError(changed, what="host key check")
    new = [v for v in verdicts.values() if v.status == "new"]
    if new and not options.accept_new and not asker.trust(new):
        raise UsageError(
            f"{len(new)} host key(s) not trusted: {', '.join(v.target.host.name for v in new)}",
            hint="check the fingerprints with the machines' owner (or their console: "
            "`ssh-keygen -lf /etc/ssh/ssh_host_ed25519_key.pub`), "
            "then answer yes or pass --accept-new",
        )
    return {h.name: verdicts[h.name] for h in cluster.hosts}


async def log_in(
    session: Session,
    cluster: Cluster,
    head_key: str | None,
    options: SetupOptions,
    asker: Asker,
    *,
    fn: str,
    args: dict[str, Any],
) -> dict[str, Any]:
    """Call ``fn`` on every node by key; where keys are refused, by password.

    Outside dry runs the password is used once per host, to install the
    head's key, and ``fn`` then runs over a key login like everywhere else.
    """
    hosts = list(cluster.hosts)
    values, problems = await gather_hosts(hosts, lambda h: session.call(h, fn, args))
    refused = [p for p in problems if p.kind == "auth-refused"]
    others = [p for p in problems if p.kind != "auth-refused"]
    if others:
        raise PreflightError(others, what="logging in")
    if not refused:
        return values
    need = [cluster.host(p.host) for p in refused]
    asker.step(
        f"{len(need)} host(s) refuse key login; logging in by password"
        + ("" if head_key is None or options.dry_run else " once, to install this machine's key")
    )
    use_password = options.dry_run or head_key is None
    passwords = asker.passwords(need, retry=False)
    for name, pw in passwords.items():
        session.broker.set(name, pw)
    for attempt in range(1, PASSWORD_ATTEMPTS + 1):
        if use_password:
            got, problems = await gather_hosts(
                need, lambda h: session.call(h, fn, args, password=True)
            )
        else:
            got, problems = await gather_hosts(
                need,
                lambda h: session.call(
                    h,
                    "add_authorized_key",
                    {
                        "cluster_id": options.cluster_id,
                        "key": head_key,
                        "etc_hosts": options.etc_hosts,
                    },
                    password=True,
                ),
            )
            for name, changes in got.items():
                session.extra_changes.setdefault(name, []).extend(changes)
        denied = [p for p in problems if p.kind == "auth-refused"]
        if [p for p in problems if p.kind != "auth-refused"]:
            raise PreflightError(
                [_hinted(p) for p in problems if p.kind != "auth-refused"], what="password login"
            )
        if not denied:
            break
        if attempt == PASSWORD_ATTEMPTS or not asker.interactive:
            raise PreflightError(
                [_password_refused(p, session.broker.refused.get(p.host)) for p in denied],
                what="password login",
            )
        need_again = [cluster.host(p.host) for p in denied]
        for name, pw in asker.passwords(need_again, retry=True).items():
            session.broker.set(name, pw)
        need = need_again
    pw_hosts = [cluster.host(p.host) for p in refused]
    if use_password:
        session.by_password.update(h.name for h in pw_hosts)
        values.update(await all_or_raise(pw_hosts, lambda h: session.call(h, fn, args)))
        return values
    after, problems = await gather_hosts(pw_hosts, lambda h: session.call(h, fn, args))
    if problems:
        raise PreflightError(
            [_still_refused(p) for p in problems], what="key login after installing the key"
        )
    values.update(after)
    return values


def _password_refused(err: HostError, prompt: str | None) -> HostError:
    if prompt:
        return HostError(
            err.host,
            f"ssh asked something corral does not answer: {prompt!r}",
            hint="log in by hand once (`ssh HOST`) to see what it wants",
            kind="auth-refused",
        )
    return HostError(
        err.host,
        "the password was refused (or password login is disabled there)",
        hint="check the password and user; sshd needs PasswordAuthentication "
        "(or KbdInteractiveAuthentication) for the first login",
        kind="auth-refused",
    )


def _still_refused(err: HostError) -> HostError:
    if err.kind != "auth-refused":
        return err
    return HostError(
        err.host,
        "the key was installed but key login is still refused",
        hint="sshd may read another AuthorizedKeysFile, or StrictModes rejects the "
        "permissions of the home directory or ~/.ssh",
        kind="auth-refused",
    )


async def all_or_raise(hosts: list[Host], work: Any) -> dict[str, Any]:
    values, problems = await gather_hosts(hosts, work)
    if problems:
        raise PreflightError(problems, what="ssh setup")
    return values


def head_identity(
    options: SetupOptions, verdicts: Mapping[str, HostKeys], asker: Asker
) -> tuple[keys.Identity | None, tuple[str, ...]]:
    found = keys.find(options.identity, [v.target for v in verdicts.values()])
    if found is not None:
        return found, ()
    path = keys.default_path()
    if options.dry_run:
        return None, (f"would create {path} (this machine has no SSH key)",)
    made = keys.generate(path, asker.make_key)
    return made, (f"generated {path}",)


# ---------------------------------------------------------------------------
# the head's known_hosts


#: First line of corral's block in a head known_hosts file that setup created:
#: teardown then removes the file instead of leaving an empty one behind.
CREATED_NOTE = "# this file was created by corral ssh setup"


def head_known_hosts(
    verdicts: Mapping[str, HostKeys], cid: str, *, dry_run: bool, remove: bool = False
) -> list[str]:
    """Add newly trusted keys to (or, ``remove``, drop) corral's block in the head's known_hosts.

    A file that did not exist before setup is marked as corral's (a comment in
    the block), so that teardown deletes it rather than leave an empty file.
    """
    by_file: dict[str, list[str]] = {}
    for v in verdicts.values():
        if not v.target.known_hosts:
            continue
        path = v.target.known_hosts[0]
        lines = by_file.setdefault(path, [])
        if v.status == "new":
            lines += hostkeys.known_hosts_lines(
                [v.target.key_name], v.target.port, v.keys, hashed=v.target.hash_known_hosts
            )
    changes = []
    for path, new_lines in by_file.items():
        text = nodeside.read(path)
        old = nodeside.block_lines(text, cid)
        if remove:
            if old is None:
                continue
            keys = [ln for ln in old if not ln.startswith("#")]
            rest = nodeside.strip_block(text, cid)
            if CREATED_NOTE in old and not rest.strip():
                changes.append(f"{path}: deleted (corral created it; {len(keys)} host key line(s))")
                if not dry_run:
                    Path(path).unlink(missing_ok=True)
                continue
            changes.append(f"{path}: removed corral's block ({len(keys)} host key line(s))")
            if not dry_run:
                nodeside.write(path, rest, 0o600)
            continue
        if not new_lines:
            continue
        changes.append(f"{path}: trusted {len(new_lines)} new host key line(s)")
        if dry_run:
            continue
        created = [CREATED_NOTE] if old is None and not os.path.exists(path) else []
        Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        text, _ = nodeside.set_block(text, cid, created + (old or []) + new_lines)
        nodeside.write(path, text, 0o600)
    return changes


def _hinted(err: HostError) -> HostError:
    if err.kind == "etc-hosts-denied" and not err.hint:
        return HostError(
            err.host, err.message[len(err.host) + 2 :], hint=ETC_HOSTS_HINT, kind=err.kind
        )
    return err
