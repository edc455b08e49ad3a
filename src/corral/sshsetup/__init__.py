"""``corral ssh setup``: passwordless SSH between the head and every node, both ways.

Library use::

    from corral.sshsetup import SetupOptions, setup, teardown, default_cluster_id

    options = SetupOptions(cluster_id=default_cluster_id(cluster))
    report = asyncio.run(setup(cluster, options, asker))
    report.matrix.ok        # every node logs in to every node

Modules: ``hostkeys`` (scan, fingerprints, known_hosts checks), ``keys`` (the
head's identity), ``askpass`` (passwords to ssh without argv/env/disk),
``nodeside`` (stdlib code run on the nodes: marked blocks, manifest, node
keys, login matrix), ``plan`` (what each node's blocks hold), ``session``
(pinned ssh calls), ``verify`` (the matrix), ``apply`` (the steps in order),
``steps`` (host keys, login, password), ``remote`` (one-shot node calls,
also used by ``corral.sync``).
See docs/ssh.md.
"""

from corral.sshsetup.apply import SetupReport, check, default_cluster_id, setup, teardown
from corral.sshsetup.steps import Asker, SetupOptions
from corral.sshsetup.verify import Matrix

__all__ = [
    "Asker",
    "Matrix",
    "SetupOptions",
    "SetupReport",
    "check",
    "default_cluster_id",
    "setup",
    "teardown",
]
