"""A job's own temporary directory on the node (stdlib only, Python 3.8+).

Node-side, shipped with the agent: ``$TMPDIR/corral-<uid>/<run-id>-<attempt>``
holds everything the job leaves on the node (rank files, the rank hook,
torchrun's log directory) and is removed when the job ends.  Also what to
say about where it is: a temp dir Python fell back to, one that filled up.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile

try:  # on a node, modules are installed under their wire names
    from corral_agent_private import private_dir
except ImportError:  # imported as part of the corral package (tests, head)
    from corral.agent.private import private_dir

#: A failed job whose temporary directory has less free space than this filled it.
TMP_FULL_BYTES = 1 << 20


class JobDir:
    """Made by ``make`` when a job starts, removed by ``remove`` when it ends
    (unless ``keep``, for debugging)."""

    def __init__(self):
        self.path = None
        #: ``corral-<uid>``, removed too when the last job in it ends.
        self.root = None
        self.keep = False
        #: Said once on the job's stderr: the temp dir Python fell back to.
        self.note = None

    def make(self, spec: dict) -> str:
        """The job's directory, with its ``logs``, ``hook`` and (flight recorder
        on) ``flightrec`` for the ranks' dumps.

        ``corral-<uid>`` is removed too when the last job in it ends and
        nothing else is in it (another job's directory, the head's control
        sockets on the head's own machine).
        """
        self.root = None
        self.keep = bool(spec.get("keep_tmp"))
        tmp = spec.get("tmp_dir")
        if not tmp:
            # The job's own TMPDIR (`--env TMPDIR=...`, the cluster file's
            # `env`) first: where its files are meant to go on this node.
            base = (spec.get("env") or {}).get("TMPDIR") or tempfile.gettempdir()
            self.note = tmp_fallback_note(base, spec.get("env") or {}, os.environ)
            root = os.path.join(base, "corral-%d" % os.getuid())
            tmp = os.path.join(root, spec.get("tag", "run"))
            self.path = tmp
            self.root = root
            for _ in range(3):  # another job may remove an empty root between our mkdirs
                # Both made 0700 or checked (ours, not a symlink, writable only
                # by us): /tmp's `corral-<uid>` is a name anyone can take first.
                private_dir(root, base)
                try:
                    private_dir(tmp, root)  # an existing one: this job's own (same run id and attempt)
                    break
                except FileNotFoundError:
                    continue
            else:
                private_dir(tmp, root)  # raises with the reason
        else:
            self.path = tmp
            private_dir(tmp)
        for sub in ("logs", "hook") + (("flightrec",) if spec.get("flight_recorder") else ()):
            private_dir(os.path.join(tmp, sub), tmp)
        return tmp

    def write_hook(self, source: str) -> str:
        """The rank hook (``hook/sitecustomize.py``), a new file of ours; its directory."""
        hook_dir = os.path.join(self.path, "hook")
        fd = os.open(os.path.join(hook_dir, "sitecustomize.py"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(source)
        return hook_dir

    def remove(self) -> None:
        if self.path and not self.keep:
            shutil.rmtree(self.path, ignore_errors=True)
            if self.root:
                try:
                    # only when empty: never another job's files.  Whichever job
                    # ends last removes it, not only the one that made it.
                    os.rmdir(self.root)
                except OSError:
                    pass
        self.path = None
        self.root = None

    def full_line(self):
        """For a failed job whose directory's file system is full: its ranks
        died writing their output there, their last words (the traceback)
        unwritten.  The line to say so among the launcher's, with errno 28's
        words (which the diagnosis knows); None when there is room."""
        if not self.path:
            return None
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None
        free = st.f_bavail * st.f_frsize
        if free >= TMP_FULL_BYTES:
            return None
        return ("corral: %s: [Errno 28] No space left on device (%d bytes free on %s): the ranks' output "
                "goes there, so their last lines (a traceback) may be missing; free space there, or set "
                "TMPDIR for this host (`env` in the cluster file)"
                % (os.path.dirname(self.path), free, socket.gethostname()))


def tmp_fallback_note(base: str, job_env: dict, environ) -> str | None:
    """Python's ``tempfile`` silently moves on from an unusable /tmp (full,
    read-only) to /var/tmp, /usr/tmp, then the current directory (a home on
    NFS, perhaps).  Without any TMPDIR/TEMP/TMP set, a temp dir other than
    /tmp means that happened: the job's files and its ranks' temporary files
    are elsewhere than expected, so the node says so once."""
    if any(job_env.get(k) or environ.get(k) for k in ("TMPDIR", "TEMP", "TMP")):
        return None
    if os.path.realpath(base) == os.path.realpath("/tmp"):
        return None
    return ("/tmp is not usable on this node (full or read-only?): Python fell back to %s for the job's "
            "temporary files; free /tmp, or set TMPDIR for this host with `env` in the cluster file" % base)
