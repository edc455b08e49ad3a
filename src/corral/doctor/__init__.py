"""Checking a cluster before (or instead of) a run: ``corral doctor`` and ``corral bench``.

- ``examine``: gathers every node's facts, clocks, ports and links
  (``corral doctor``'s evidence).
- ``checks/``: pure functions over that evidence, each a finding with the
  host and the fix.
- ``smoke``: a tiny all-reduce through ``corral run``'s own launch path.
- ``bench``: the link matrix and the all-reduce size sweep (``corral bench``).
- ``scripted``: runs one of ``workloads/`` (small scripts shipped to the
  nodes) through ``corral.run.runner`` and captures what it printed.
- ``fixenv``: writes the environment a doctor recommends into corral.toml.

This package sits above ``corral.run`` (it launches through it); nothing
in ``corral.run`` imports it.
"""
