"""What a run's telemetry says at a moment: stragglers, idle GPUs, saturated links."""

from __future__ import annotations

from corral.run.stragglers import flags, stragglers
from corral.run.telemetry import Gpu, Nic, RankUse, Sample


def _samples(seconds: int, *, slow_host: str | None = None, slow_from: int = 0, gpus: bool = False,
             nic_bps: float = 1e6, speed: float | None = 10000) -> dict[str, list[Sample]]:
    """4 hosts x 2 ranks, one sample a second; ranks write 10 lines/s, those
    of ``slow_host`` 1 line/s from ``slow_from`` on."""
    out: dict[str, list[Sample]] = {}
    for n in range(4):
        host = f"node{n + 1}"
        out[host] = []
        for t in range(seconds):
            slow = host == slow_host and t >= slow_from
            ranks = tuple(RankUse(rank=2 * n + i, cpu=90.0, rss_mib=500.0, lines_per_s=1.0 if slow else 10.0,
                                  bar_rate=None, bar_unit=None) for i in range(2))
            g = tuple(Gpu(index=i, util=(30.0 if slow else 97.0) if i == 0 else 0.0, mem_mib=1000, mem_total_mib=80000,
                          power_w=300, temp_c=60, sm_mhz=1980, throttle=0) for i in range(2)) if gpus else ()
            nics = (Nic(name="eth0", rx=nic_bps, tx=nic_bps / 2, speed_mbit=speed),)
            out[host].append(Sample(host=host, at=1000.0 + t + n * 0.01, gpus=g, ranks=ranks, nics=nics))
    return out


def test_the_ranks_of_a_node_persistently_behind_are_the_stragglers() -> None:
    found = stragglers(_samples(30, slow_host="node3"), 1029.5)
    assert [(f.host, f.what) for f in found] == [("node3", "rank 4"), ("node3", "rank 5")]
    assert "progress lines/s 1 vs its peers' median 10" in found[0].why


def test_a_rank_behind_for_a_few_seconds_only_is_no_straggler() -> None:
    # slow for the last 6 s: the last window's mean is behind, the one 4 s earlier is not
    assert stragglers(_samples(30, slow_host="node3", slow_from=24), 1029.5) == []
    assert stragglers(_samples(30, slow_host="node3", slow_from=12), 1029.5) != []


def test_a_job_without_peers_or_data_has_no_stragglers() -> None:
    one = {"node1": _samples(30)["node1"][:3]}
    assert flags(one, 1002.5) == []


def test_a_slow_gpu_an_idle_gpu_and_a_saturated_link() -> None:
    samples = _samples(30, slow_host="node2", gpus=True, nic_bps=1.2e9, speed=10000)
    found = {(f.kind, f.host, f.what) for f in flags(samples, 1029.5)}
    assert ("straggler", "node2", "gpu 0") in found
    assert ("straggler", "node1", "gpu 0") not in found
    assert {("idle-gpu", f"node{n}", "gpu 1") for n in range(1, 5)} <= found
    assert {("saturated-link", f"node{n}", "eth0") for n in range(1, 5)} <= found
    calm = _samples(30, nic_bps=1e6)
    assert not [f for f in flags(calm, 1029.5) if f.kind == "saturated-link"]
    unknown = _samples(30, nic_bps=1e12, speed=None)  # a virtual link says no speed
    assert not [f for f in flags(unknown, 1029.5) if f.kind == "saturated-link"]
