"""``corral sync``: code, data and model files to every node, verified.

Library use::

    from corral.sync import SyncOptions, sync

    report = asyncio.run(sync(cluster, SyncOptions(delete=True), cwd=Path.cwd()))
    report.head_hash, {n: r.hash for n, r in report.nodes.items()}

Modules: ``ignore`` (gitignore syntax), ``filelist`` (what to send: git
ls-files, .corralignore, defaults), ``nodetree`` (stdlib: manifests, tree
hash, node-side status/delete and the streaming hop), ``nodedest`` (stdlib:
no links below the destination, the --delete guard, temporary files),
``rsync`` (rsync over corral's ssh), ``pipeline`` (large files node to node),
``procs`` (stopping rsync and ssh with their process groups), ``engine`` (the
steps in order).  See docs/sync.md.
"""

from corral.sync.engine import NodeResult, SyncOptions, SyncReport, SyncView, sync

__all__ = ["NodeResult", "SyncOptions", "SyncReport", "SyncView", "sync"]
