"""``corral ssh setup`` / ``teardown``, in order, as a library.

Setup:

1. host keys: ``ssh -G`` + ``ssh-keyscan`` for every host, judged against the
   head's known_hosts; a changed key stops everything, new ones need the
   user's confirmation (``Asker.trust``) or ``accept_new``;
2. the head's identity (``--identity``, ssh's own, or a new one);
3. login: a key login to every host; where it is refused, the password
   (asked once, ``Asker.passwords``) installs the head's key, then keys;
4. inspect every node (generating its own key there when it has none);
5. plan the blocks and apply them on every node, in parallel;
6. record newly trusted host keys in the head's known_hosts (a marked block);
7. verify: the all-to-all login matrix.

Teardown runs 1-3, then removes every node's blocks and what corral created
there, then the head's block.  The library never prints: ``Asker`` is how it
asks, ``SetupReport`` is what it did.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from corral.errors import HostError, PreflightError, UsageError
from corral.model import Cluster, Host
from corral.sshsetup import hostkeys, keys, nodeside, plan
from corral.sshsetup.askpass import PasswordBroker
from corral.sshsetup.hostkeys import HostKeys
from corral.sshsetup.remote import gather_hosts
from corral.sshsetup.session import Session
from corral.sshsetup.verify import Matrix, run_matrix

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


@dataclass(frozen=True, kw_only=True)
class SetupReport:
    cluster_id: str
    dry_run: bool
    #: node name -> changes made (or, dry run, that would be made) there.
    nodes: Mapping[str, tuple[str, ...]]
    head: tuple[str, ...] = ()
    by_password: tuple[str, ...] = ()
    matrix: Matrix | None = None
    warnings: tuple[str, ...] = ()
    trusted: tuple[str, ...] = field(default=())

    @property
    def changed(self) -> bool:
        return bool(self.head) or any(self.nodes.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "cluster_id": self.cluster_id,
            "dry_run": self.dry_run,
            "changed": self.changed,
            "nodes": {k: list(v) for k, v in self.nodes.items()},
            "head": list(self.head),
            "by_password": list(self.by_password),
            "trusted_new_host_keys": list(self.trusted),
            "warnings": list(self.warnings),
            "matrix": self.matrix.to_json() if self.matrix else None,
        }


def default_cluster_id(cluster: Cluster) -> str:
    """The cluster's name, else a hash of its host names (stable across runs)."""
    if cluster.name and nodeside._ID_RE.match(cluster.name):
        return cluster.name
    digest = hashlib.sha256("\n".join(sorted(cluster.names)).encode()).hexdigest()[:10]
    return f"c{digest}"


def _check_cluster(cluster: Cluster) -> None:
    local = [h.name for h in cluster.hosts if h.local]
    if local:
        raise UsageError(
            f"ssh setup needs remote hosts; {', '.join(local)} is this machine",
            hint="give the nodes with -c FILE or -H LIST",
        )


# ---------------------------------------------------------------------------
# steps shared by setup and teardown


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
        values.update(await _all(pw_hosts, lambda h: session.call(h, fn, args)))
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


async def _all(hosts: list[Host], work: Any) -> dict[str, Any]:
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


def head_known_hosts(
    verdicts: Mapping[str, HostKeys], cid: str, *, dry_run: bool, remove: bool = False
) -> list[str]:
    """Add newly trusted keys to (or, ``remove``, drop) corral's block in the head's known_hosts."""
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
            changes.append(f"{path}: removed corral's block ({len(old)} host key line(s))")
            if not dry_run:
                nodeside.write(path, nodeside.strip_block(text, cid), 0o600)
            continue
        if not new_lines:
            continue
        changes.append(f"{path}: trusted {len(new_lines)} new host key line(s)")
        if dry_run:
            continue
        Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        text, _ = nodeside.set_block(text, cid, (old or []) + new_lines)
        nodeside.write(path, text, 0o600)
    return changes


# ---------------------------------------------------------------------------
# setup and teardown


async def setup(cluster: Cluster, options: SetupOptions, asker: Asker) -> SetupReport:
    """Key logins head -> node and node <-> node, known_hosts everywhere; verified."""
    _check_cluster(cluster)
    cid = nodeside.check_id(options.cluster_id)
    verdicts = await check_host_keys(cluster, options, asker)
    identity, head_changes = head_identity(options, verdicts, asker)
    head_key = identity.public_key if identity else None
    async with PasswordBroker(max_answers=8) as broker:
        session = Session(
            cluster,
            verdicts,
            broker,
            identity=identity.path if identity else None,
            connect_timeout=options.connect_timeout,
        )
        try:
            asker.step("logging in to every node")
            facts = await log_in(
                session,
                cluster,
                head_key,
                options,
                asker,
                fn="inspect",
                args={"cluster_id": cid, "dry_run": options.dry_run},
            )
            _check_etc_hosts(cluster, facts, options)
            all_peers = plan.peers(verdicts, facts)
            facts_with_key = {
                n: {**f, "public_key": f.get("public_key") or f"(new key of {n})"}
                for n, f in facts.items()
            }
            wanted = plan.blocks(
                head_key or "(this machine's new key)",
                all_peers,
                facts_with_key,
                want_ssh_config=options.ssh_config,
                want_etc_hosts=options.etc_hosts,
            )
            asker.step(
                "writing authorized_keys, known_hosts"
                + (", ssh config" if options.ssh_config else "")
                + (", /etc/hosts" if options.etc_hosts else "")
                + " on every node"
            )
            applied = await _all(
                list(cluster.hosts),
                lambda h: session.call(
                    h,
                    "apply",
                    {"cluster_id": cid, "blocks": wanted[h.name], "dry_run": options.dry_run},
                ),
            )
            head_changes += tuple(head_known_hosts(verdicts, cid, dry_run=options.dry_run))
            matrix = None
            if not options.dry_run:
                asker.step("verifying: every node logs in to every node")
                bare = {n: "ssh_config" in wanted[n] for n in wanted}
                matrix = await run_matrix(list(cluster.hosts), all_peers, session.call, bare=bare)
        finally:
            session.close()
    nodes = {
        h.name: tuple(
            dict.fromkeys(
                [
                    *session.extra_changes.get(h.name, []),
                    *facts[h.name].get("changes", []),
                    *applied[h.name],
                ]
            )
        )
        for h in cluster.hosts
    }
    return SetupReport(
        cluster_id=cid,
        dry_run=options.dry_run,
        nodes=nodes,
        head=head_changes,
        by_password=tuple(sorted(broker.used)),
        matrix=matrix,
        warnings=tuple(_warnings(cluster, verdicts, wanted)),
        trusted=tuple(v.target.host.name for v in verdicts.values() if v.status == "new"),
    )


def _check_etc_hosts(cluster: Cluster, facts: Mapping[str, dict], options: SetupOptions) -> None:
    if not options.etc_hosts:
        return
    denied = [
        HostError(
            n,
            f"/etc/hosts is not writable for {f.get('user')}",
            hint=ETC_HOSTS_HINT,
            kind="etc-hosts-denied",
        )
        for n, f in facts.items()
        if not f.get("etc_hosts_writable")
    ]
    if denied:
        raise PreflightError(denied, what="--etc-hosts")


def _hinted(err: HostError) -> HostError:
    if err.kind == "etc-hosts-denied" and not err.hint:
        return HostError(
            err.host, err.message[len(err.host) + 2 :], hint=ETC_HOSTS_HINT, kind=err.kind
        )
    return err


def _warnings(
    cluster: Cluster, verdicts: Mapping[str, HostKeys], wanted: Mapping[str, dict]
) -> list[str]:
    out = []
    ports = sorted({v.target.port for v in verdicts.values()} - {22})
    if ports and not all("ssh_config" in w for w in wanted.values()):
        out.append(
            f"nodes listen on port {', '.join(map(str, ports))}: tools on the nodes (pdsh, "
            "DeepSpeed's runner, plain `ssh NAME`) dial 22 unless told; add --ssh-config"
        )
    return out


async def teardown(cluster: Cluster, options: SetupOptions, asker: Asker) -> SetupReport:
    """Remove what setup added, on every node and in the head's known_hosts."""
    _check_cluster(cluster)
    cid = nodeside.check_id(options.cluster_id)
    verdicts = await check_host_keys(cluster, options, asker)
    found = keys.find(options.identity, [v.target for v in verdicts.values()])
    async with PasswordBroker(max_answers=8) as broker:
        session = Session(
            cluster,
            verdicts,
            broker,
            identity=found.path if found else None,
            connect_timeout=options.connect_timeout,
        )
        try:
            asker.step("removing corral's blocks on every node")
            # Teardown never installs a key: a refused key login falls back to the password.
            changes = await log_in(
                session,
                cluster,
                None,
                options,
                asker,
                fn="teardown",
                args={"cluster_id": cid, "dry_run": options.dry_run},
            )
            if not options.dry_run:
                await session.close_masters()
        finally:
            session.close()
    head = tuple(head_known_hosts(verdicts, cid, dry_run=options.dry_run, remove=True))
    return SetupReport(
        cluster_id=cid,
        dry_run=options.dry_run,
        nodes={h.name: tuple(changes[h.name]) for h in cluster.hosts},
        head=head,
        by_password=tuple(sorted(broker.used)),
    )


async def check(cluster: Cluster, options: SetupOptions, asker: Asker) -> Matrix:
    """Only the login matrix (read-only): keys must already be trusted and installed."""
    _check_cluster(cluster)
    cid = nodeside.check_id(options.cluster_id)
    verdicts = await check_host_keys(cluster, options, asker)
    found = keys.find(options.identity, [v.target for v in verdicts.values()])
    async with PasswordBroker() as broker:
        session = Session(
            cluster,
            verdicts,
            broker,
            identity=found.path if found else None,
            connect_timeout=options.connect_timeout,
        )
        try:
            facts = await _all(
                list(cluster.hosts),
                lambda h: session.call(h, "inspect", {"cluster_id": cid, "dry_run": True}),
            )
            bare = {n: bool(f.get("has_block", {}).get("ssh_config")) for n, f in facts.items()}
            return await run_matrix(
                list(cluster.hosts), plan.peers(verdicts, facts), session.call, bare=bare
            )
        finally:
            session.close()
