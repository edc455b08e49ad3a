"""The checks behind ``corral doctor``: pure functions from ``Evidence`` to ``Finding``s.

One module per family (``software``, ``gpus``, ``system``, ``network``,
``connectivity``); each exports ``CHECKS``.  ``run_checks`` runs them all in
report order.  Library use::

    from corral.doctor.checks import Evidence, run_checks
    findings = run_checks(Evidence.from_json(saved["evidence"]))
"""

from __future__ import annotations

import logging

from corral.doctor.checks import connectivity, gpuhealth, gpus, network, software, system
from corral.doctor.checks.base import (
    ERROR,
    OK,
    SEVERITIES,
    WARNING,
    Check,
    ClockSample,
    Evidence,
    Finding,
    LinkProbe,
    PortProbe,
    SmokeOutcome,
    SshProbe,
)
from corral.doctor.checks.nics import NicChoice, choose_nics, recommend_env
from corral.hostrange import HostSet

__all__ = [
    "ALL_CHECKS", "ERROR", "FAMILIES", "OK", "SEVERITIES", "WARNING", "Check", "ClockSample",
    "Evidence", "Finding", "LinkProbe", "NicChoice", "PortProbe", "SmokeOutcome", "SshProbe",
    "choose_nics", "recommend_env", "run_checks",
]

log = logging.getLogger(__name__)

#: Report order: family name -> title.
FAMILIES = {
    "connectivity": "Connectivity",
    "software": "Software",
    "gpus": "GPUs",
    "system": "System",
    "network": "Network",
    "smoke": "Smoke test",
}

ALL_CHECKS: tuple[Check, ...] = (
    connectivity.agents,
    *software.CHECKS,
    *gpus.CHECKS,
    *gpuhealth.CHECKS,
    *system.CHECKS,
    *network.CHECKS,
    connectivity.ports,
    connectivity.ssh_mesh,
    connectivity.login_output,
    connectivity.links,
    connectivity.smoke,
)


def run_checks(ev: Evidence, checks: tuple[Check, ...] = ALL_CHECKS) -> list[Finding]:
    """Every check's findings; a check that crashes becomes an error finding, not a traceback."""
    out: list[Finding] = []
    for check in checks:
        try:
            out.extend(check(ev))
        except Exception as e:  # a bug in one check must not hide the others
            log.debug("check %s crashed", check.__name__, exc_info=True)
            out.append(Finding(
                check=f"{check.__module__.rsplit('.', 1)[-1]}.{check.__name__}", severity=ERROR,
                hosts=HostSet.of(ev.hosts), message=f"this check crashed: {type(e).__name__}: {e}",
                hint="please report it with `corral doctor --json` output attached",
            ))
    return out
