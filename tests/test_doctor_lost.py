"""`corral doctor` when a node goes away in the middle (no sandbox: the phases are faked).

On the sandbox (`corral sandbox stop` a few seconds into `corral doctor`), a
node lost during the pairwise tests threw the whole report away ("error:
f5n2: ssh failed ..."), and one lost during the smoke test did too
("error: connecting failed on 1 host(s)").
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from corral.doctor import examine as doctor
from corral.doctor.checks import ERROR, run_checks
from corral.doctor.checks.base import LinkProbe, PortProbe
from corral.errors import HostError, PreflightError
from corral.model import Cluster, Host

NODES = ("n1", "n2", "n3")


class _Session:
    def __init__(self, name: str) -> None:
        self.name = name
        self.closed = False


class _Pool:
    def __init__(self) -> None:
        self.sessions = [_Session(n) for n in NODES]

    def __getitem__(self, name: str) -> _Session:
        return next(s for s in self.sessions if s.name == name)

    async def close(self) -> None:
        pass


def _gather(monkeypatch: pytest.MonkeyPatch, pairs) -> doctor.Evidence:
    pool = _Pool()

    async def open_reachable(cluster, timeout):
        return pool, {}

    async def facts(pool, cluster, options, head_cwd):
        return {n: {"host": n, "env": {}} for n in NODES}, {}

    async def clock(pool, facts):
        return {}

    async def fake_pairs(pool, cluster, options, ev, progress):
        return pairs(pool, ev)

    monkeypatch.setattr(doctor, "_open_reachable", open_reachable)
    monkeypatch.setattr(doctor, "_facts", facts)
    monkeypatch.setattr(doctor, "_clock", clock)
    monkeypatch.setattr(doctor, "_pairs", fake_pairs)
    cluster = Cluster(hosts=tuple(Host(name=n) for n in NODES))
    return asyncio.run(doctor.gather(cluster, doctor.DoctorOptions(), head_env={}, head_cwd="/",
                                     progress=lambda _: None))


def test_a_node_lost_during_the_port_tests_is_named_and_the_rest_reported(monkeypatch) -> None:
    def pairs(pool, ev):
        raise HostError("n2", "ssh failed: exit code 255 without a message", hint="check n2")

    ev = _gather(monkeypatch, pairs)
    assert ev.reachable == ("n1", "n3")
    assert ev.unreachable["n2"].startswith("lost while testing the links between nodes: ssh failed")
    assert ev.unreachable_hints["n2"] == "check n2" and ev.ports is None
    [agent] = [f for f in run_checks(ev) if f.check == "connectivity.agent" and f.severity == ERROR]
    assert str(agent.hosts) == "n2"


def test_a_node_lost_while_links_were_measured_is_named_not_blamed_on_its_links(monkeypatch) -> None:
    def pairs(pool, ev):
        pool["n2"].closed = True
        ports = tuple(PortProbe(src=a, dst=b, address="10.0.0.1", port=1, result="ok")
                      for a in NODES for b in NODES if a != b)
        links = tuple(LinkProbe(src=a, dst=b, address="10.0.0.1", bps=None if "n2" in (a, b) else 1e9,
                                error="refused" if "n2" in (a, b) else None)
                      for a in NODES for b in NODES if a != b)
        return replace(ev, ports=ports, links=links)

    ev = _gather(monkeypatch, pairs)
    assert ev.reachable == ("n1", "n3") and "its connection closed" in ev.unreachable["n2"]
    assert {(p.src, p.dst) for p in ev.links} == {("n1", "n3"), ("n3", "n1")}
    assert all("n2" not in (p.src, p.dst) for p in ev.ports)


def test_a_node_gone_before_the_smoke_test_is_its_outcome_not_an_error(monkeypatch) -> None:
    from corral.doctor import scripted
    from corral.doctor.smoke import outcome

    class Gone:
        def __init__(self, cluster, **kw) -> None:
            pass

        async def open(self) -> None:
            raise PreflightError([HostError("n2", "connection refused (no sshd listening on that port)")],
                                 what="connecting")

    monkeypatch.setattr(scripted, "AgentPool", Gone)
    run = asyncio.run(scripted.run_workload(Cluster(hosts=tuple(Host(name=n) for n in NODES)),
                                            "smoke_allreduce.py", marker="M", timeout=30,
                                            head_env={}, head_cwd="/"))
    assert run.result is None and run.preflight is not None
    got = outcome(run, doctor.Evidence(hosts=NODES, facts={}), backend="gloo", timeout=30)
    assert got.status == "failed" and got.host == "n2"
    assert got.message == "connection refused (no sshd listening on that port)"
