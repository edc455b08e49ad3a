"""The supervisor of a detached job: corral's own run loop, on node 0.

``corral run --detach`` sends the job (cluster, spec, options: ``job_document``)
to the first node and starts ``main`` there in a session of its own
(``corral.agent.jobs.op_launch``); from then on it is the head of the run,
exactly as an attended ``corral run`` would be (``Runner``: first-failure
teardown, a lost node named and the job torn down within 15 s,
``--max-restarts``, per-rank logs, run.json), except that:

- node 0 is this machine (reached through the local agent) and the other
  nodes are reached with node 0's own ssh setup (its keys, known_hosts and
  ~/.ssh/config: ``corral ssh setup`` makes them); options that name files
  on the user's machine (an IdentityFile, a known_hosts file, ``-F``) do
  not apply here and are left out;
- the console is ``console.log`` in the job's directory (``corral attach``
  follows it), and the file ``ready`` says when every rank is in user code
  (``corral run --detach`` returns then);
- ``corral stop`` is SIGINT to this process: Ctrl-C of an attended run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from corral.errors import CorralError, PreflightError
from corral.model import Cluster
from corral.run.jobcodec import from_json, to_json
from corral.run.options import RunOptions
from corral.run.plan import RunSpec, env_from_head
from corral.run.runner import Runner

#: ssh options that name a file on the machine that wrote the cluster file.
PATH_OPTIONS = frozenset({"identityfile", "userknownhostsfile", "globalknownhostsfile", "certificatefile",
                          "controlpath", "identityagent", "include", "controlmaster", "controlpersist"})


# ---------------------------------------------------------------------------
# the job, as it travels


def cluster_to_json(cluster: Cluster) -> dict[str, Any]:
    return to_json(cluster)


def cluster_from_json(data: Mapping[str, Any]) -> Cluster:
    return from_json(Cluster, data)


def job_document(cluster: Cluster, spec: RunSpec, options: RunOptions, *, head_env: Mapping[str, str],
                 head_cwd: str) -> dict[str, Any]:
    """What node 0 needs to run the job as this machine would.  Of this
    machine's environment only what would travel anyway (the allow-list,
    never a secret-looking name) is sent; ``--env`` values are in the spec."""
    env = env_from_head(head_env)
    if cluster.is_local and "CUDA_VISIBLE_DEVICES" in head_env:
        env["CUDA_VISIBLE_DEVICES"] = head_env["CUDA_VISIBLE_DEVICES"]  # this machine's own choice
    opts = to_json(options)
    del opts["runs_dir"]  # node 0 keeps the run in the job's own directory
    return {"cluster": cluster_to_json(cluster), "spec": to_json(spec), "options": opts, "head_env": env,
            "head_cwd": head_cwd, "user": os.environ.get("USER") or str(os.getuid())}


def node0_view(cluster: Cluster) -> Cluster:
    """The cluster as node 0 reaches it: itself locally, the others by ssh
    with its own setup (options naming the head's files left out)."""
    def keep(opts: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(o for o in opts if o.split("=", 1)[0].strip().lower() not in PATH_OPTIONS)

    first = cluster.hosts[0].with_(local=True, ssh_options=())
    others = tuple(h.with_(ssh_options=keep(h.ssh_options)) for h in cluster.hosts[1:])
    # One connection per node for the whole run, and no shared master that
    # would outlive the job on node 0 (ControlPersist): a user's option
    # comes before corral's, and ssh takes the first value it reads.
    return dataclasses.replace(cluster, hosts=(first, *others), ssh_config=None,
                               ssh_options=("ControlMaster=no", *keep(cluster.ssh_options)))


# ---------------------------------------------------------------------------
# the run loop, watched from node 0


class SupervisedRunner(Runner):
    """The run loop, marking ``ready`` once every rank is in user code (each
    node's agent reports a rank when its hook starts, before the script's
    first line), or, for ``--launcher command``, once every node started."""

    def __init__(self, *args: Any, ready_file: Path, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.ready_file = ready_file
        self._started_ranks: set[int] = set()
        self._started_nodes: set[str] = set()

    def _control_path(self) -> Path:
        # in the job's private directory: nothing in the node's /tmp, even
        # when this process is killed
        sock = self.ready_file.parent / "ctl.sock"
        return sock if len(os.fsencode(sock)) < 100 else super()._control_path()

    def _on_event(self, session, ev: dict) -> None:
        super()._on_event(session, ev)
        kind = ev.get("ev")
        if kind == "rank_start":
            self._started_ranks.add(ev["r"])
        elif kind == "started":
            self._started_nodes.add(session.name)
        else:
            return
        plan = self.attempt.plan if self.attempt is not None else None
        if plan is None or self.ready_file.exists():
            return
        if (len(self._started_ranks) >= plan.world_size
                or (self.spec.launcher == "command" and len(self._started_nodes) >= len(plan.nodes))):
            self.ready_file.write_text(json.dumps({"at": time.time()}))


def _reach_hint(cluster: Cluster) -> str:
    first = cluster.hosts[0].name
    return (f"the supervisor runs on {first} and reaches the other nodes with {first}'s own ssh keys and "
            f"known_hosts: `corral ssh setup -c {cluster.path or 'CLUSTER'}` sets them up (node-to-node), and "
            f"`ssh {first} ssh {cluster.hosts[-1].name} true` must work; or run without --detach")


def _remove_empty_control_dir(sock: Path | None) -> None:
    """The run's control socket directory on node 0 (``/tmp/corral-<uid>/ctl``
    without an XDG_RUNTIME_DIR), when nothing else is in it: an attended head
    keeps it on the user's machine; a node is left as it was found."""
    if sock is None:
        return
    for d in (sock.parent, sock.parent.parent):
        if d.name.startswith("corral-") or d.name == "ctl":
            try:
                d.rmdir()
            except OSError:
                return  # not empty: another run's, or the node's jobs


def main(jobdir: str) -> int:
    """Run the job of ``jobdir`` to its end; its outcome goes to run.json and end.json."""
    from corral import ui
    from corral.run.console import RunConsole

    where = Path(jobdir)
    job = json.loads((where / "job.json").read_text())
    user_cluster = cluster_from_json(job["cluster"])
    cluster = node0_view(user_cluster)
    spec = from_json(RunSpec, job["spec"])
    options = from_json(RunOptions, {**job["options"], "runs_dir": str(where)})
    shown = options.shown_ranks
    view = RunConsole(multi_host=len(cluster.hosts) > 1, status_ranks=None if shown is None else set(shown),
                      out=sys.stderr, color=False)
    runner = SupervisedRunner(cluster, spec, options, view=view, head_env=job["head_env"],
                              head_cwd=job["head_cwd"], ready_file=where / "ready")
    ui.notice(f"supervisor of run {spec.run_id} on {user_cluster.hosts[0].name} (pid {os.getpid()}); connecting...")
    end: dict[str, Any]
    try:
        result = asyncio.run(runner.run())
        end = {"status": result.status, "exit_code": result.exit_code,
               "error": result.failure.describe() if result.failure else None}
        ui.notice(f"run {spec.run_id} {result.status}"
                  + (f": {result.failure.describe()}" if result.failure else "")
                  + f" after {result.duration_s:.1f}s (exit code {result.exit_code})")
    except CorralError as e:
        message, hint = str(e), e.hint
        first = user_cluster.hosts[0].name
        if (isinstance(e, PreflightError) and message.startswith("connecting failed")
                and all(p.host != first for p in e.problems)):
            from corral.hostrange import fold

            message = (f"{first}, where the supervisor runs, cannot reach "
                       f"{fold(dict.fromkeys(p.host for p in e.problems))} over ssh: {message}")
            hint = _reach_hint(user_cluster)
        end = {"status": "failed", "exit_code": e.exit_code, "error": message, "hint": hint}
        ui.notice(f"error: {message}" + (f"\n  hint: {hint}" if hint else ""))
    except Exception as e:  # noqa: BLE001 - a bug of ours: said, and recorded as the job's end
        import traceback

        traceback.print_exc()
        end = {"status": "failed", "exit_code": 1,
               "error": f"corral's supervisor failed: {type(e).__name__}: {e} (please report this, with console.log)"}
        ui.notice(f"error: {end['error']}")
    finally:
        view.close()
        _remove_empty_control_dir(getattr(runner, "control", None))
    (where / "end.json").write_text(json.dumps(end))
    return int(end["exit_code"] or 0)
