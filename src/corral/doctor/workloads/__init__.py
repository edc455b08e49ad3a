"""Scripts corral runs *on the nodes* through its own launch path.

They are read as text (``script_text``) and written into a private scratch
directory on every node for one run: nodes need torch, never corral.

- ``smoke_allreduce.py``: ``corral doctor``'s smoke test, a checked all-reduce;
- ``allreduce_perf.py``: ``corral bench``'s all-reduce timing over a size sweep.
"""

from __future__ import annotations

from importlib import resources

SCRIPTS = ("smoke_allreduce.py", "allreduce_perf.py")


def script_text(name: str) -> str:
    """The source of one of ``SCRIPTS``."""
    if name not in SCRIPTS:
        raise KeyError(name)
    return resources.files("corral.doctor.workloads").joinpath(name).read_text()
