"""Running a job: the launch pipeline, and what it leaves behind.

The modules follow the pipeline the README describes, in its order:

- ``plan``: the cluster and the user's command become one ``LaunchPlan``
  (ranks, ports, environment per node); ``launchers/`` hold what each
  launcher (torchrun, accelerate, deepspeed, lightning, a plain command)
  needs on a node, and ``scriptcheck`` reads the script for what a plan
  must match (Lightning's ``devices``, a missing ``--local_rank``).
- ``preflight``: what must be proven before anything starts (the
  rendezvous address and port reachable from every node).
- ``runner``: starts the job through the node agents and follows it to
  the end: first-failure teardown, lost nodes, restarts, Ctrl-C;
  ``result`` is what it returns, with corral's explanation of a failure.
- ``watch``: the job's state from the agents' events (who failed first,
  the echo failures, the root cause).
- ``control``: the run's control socket (``corral stacks`` of a live run).
- ``console``: what the terminal shows of the ranks' output.
- ``logs`` and ``record``: the run directory (per-rank logs, ``run.json``);
  ``history`` reads it back for ``corral runs`` and ``corral diagnose``.

Nothing here imports the CLI or the doctor; the doctor runs its workloads
through ``runner``.  Import the module you need (``corral.run.runner``):
this package's face stays empty so that reading a run directory does not
load the launch machinery.
"""
