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
from typing import Any

from corral.errors import HostError, PreflightError, UsageError
from corral.model import Cluster
from corral.sshsetup import keys, nodeside, plan
from corral.sshsetup.askpass import PasswordBroker
from corral.sshsetup.hostkeys import HostKeys
from corral.sshsetup.session import Session
from corral.sshsetup.steps import (
    ETC_HOSTS_HINT,
    Asker,
    SetupOptions,
    all_or_raise,
    check_host_keys,
    head_identity,
    head_known_hosts,
    log_in,
)
from corral.sshsetup.verify import Matrix, run_matrix

log = logging.getLogger(__name__)


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
    if cluster.name and nodeside._ID_RE.fullmatch(cluster.name):
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
            # What the nodes report (their host names) is checked before any
            # node changes: a first, read-only inspect; then the real one,
            # which generates the keys nodes lack.
            facts = await log_in(
                session,
                cluster,
                head_key,
                options,
                asker,
                fn="inspect",
                args={"cluster_id": cid, "dry_run": True},
            )
            _check_etc_hosts(cluster, facts, options)
            plan.peers(verdicts, facts)
            if not options.dry_run:
                facts = await all_or_raise(
                    list(cluster.hosts),
                    lambda h: session.call(h, "inspect", {"cluster_id": cid, "dry_run": False}),
                )
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
            applied = await all_or_raise(
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
            facts = await all_or_raise(
                list(cluster.hosts),
                lambda h: session.call(h, "inspect", {"cluster_id": cid, "dry_run": True}),
            )
            bare = {n: bool(f.get("has_block", {}).get("ssh_config")) for n, f in facts.items()}
            return await run_matrix(
                list(cluster.hosts), plan.peers(verdicts, facts), session.call, bare=bare
            )
        finally:
            session.close()
