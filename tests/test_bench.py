"""`corral bench`: nccl-tests' bandwidth arithmetic, the link schedule, and real links.

The sandbox part runs on a 3-node sandbox of its own whose links are shaped
to 200 Mbit/s (tc), so what bench measures can be held against a known rate.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from itertools import permutations

import pytest

from corral.doctor.bench import (
    bus_bandwidth,
    nccl_network,
    parse_size,
    rows_from,
    schedule,
    size_sweep,
)
from corral.errors import UsageError
from corral.sandbox import Sandbox

RATE = 200e6
MIB = 1 << 20


# ---------------------------------------------------------------------------
# arithmetic and parsing


def test_bus_bandwidth_follows_nccl_tests() -> None:
    # 1 GiB in 10 ms on 8 ranks: algbw = S/t, busbw = algbw * 2(n-1)/n.
    algbw, busbw = bus_bandwidth(1 << 30, 0.010, 8)
    assert algbw == pytest.approx(107.374, rel=1e-4)
    assert busbw == pytest.approx(algbw * 14 / 8)
    assert bus_bandwidth(1000, 1.0, 1) == (1e-6, 0.0)  # one rank moves nothing over links
    with pytest.raises(ValueError):
        bus_bandwidth(1000, 0.0, 4)


def test_rows_carry_size_count_time_and_both_bandwidths() -> None:
    [row] = rows_from([{"size": 4 * MIB, "count": MIB, "type": "float", "seconds": 0.002,
                        "world_size": 4}])
    assert (row.size, row.count, row.dtype, row.redop, row.time_us) == (4 * MIB, MIB, "float", "sum", 2000.0)
    assert row.busbw_gbs == pytest.approx(row.algbw_gbs * 1.5)


def test_size_sweep_and_sizes() -> None:
    assert size_sweep(MIB, 8 * MIB) == [MIB, 2 * MIB, 4 * MIB, 8 * MIB]
    assert len(size_sweep(MIB, 1 << 30)) == 11
    assert [parse_size(s) for s in ("1MiB", "64M", "1G", "512k", "4096")] == [MIB, 64 * MIB, 1 << 30, 512 << 10, 4096]
    with pytest.raises(UsageError):
        parse_size("lots")
    with pytest.raises(UsageError):
        size_sweep(8 * MIB, MIB)


@pytest.mark.parametrize("n", [2, 3, 4, 7])
def test_schedule_measures_every_link_once_without_sharing_a_nic(n: int) -> None:
    hosts = [f"n{i}" for i in range(n)]
    rounds = schedule(hosts)
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == sorted(permutations(hosts, 2))
    for r in rounds:  # in a round, each node sends once and receives once
        assert sorted(s for s, _ in r) == sorted(hosts) and sorted(d for _, d in r) == sorted(hosts)
    assert all(len(r) == 1 for r in schedule(hosts, sequential=True))


def test_nccl_network_from_debug_output() -> None:
    socket_run = [
        "ip-172-31-12-210:45305:45305 [0] NCCL INFO NET/Plugin : No plugin found (libnccl-net.so).",
        "ip-172-31-12-210:45305:45305 [0] NCCL INFO NET/IB : No device found.",
        "ip-172-31-12-210:45305:45305 [0] NCCL INFO NET/Socket : Using [0]ens3:172.31.12.210<0>",
        "ip-172-31-12-210:45305:45305 [0] NCCL INFO Using network Socket",
    ]
    ib_run = ["gpu01:351578:351578 [0] NCCL INFO NET/IB : Using [0]mlx5_9:1/RoCE [RO]; OOB enp225s0f1:10.10.10.2<0>"]
    assert nccl_network(socket_run) == "Socket"
    assert nccl_network(ib_run) == "IB"
    assert nccl_network(["epoch 1 loss 0.3"]) is None


def test_cli_refuses_nothing_to_do_and_bad_sizes() -> None:
    from click.testing import CliRunner

    from corral.cli import cli

    result = CliRunner().invoke(cli, ["bench", "-H", "a,b", "--no-links", "--no-allreduce"])
    assert result.exit_code == 2 and "nothing to do" in result.output
    result = CliRunner().invoke(cli, ["bench", "-H", "a,b", "--max-size", "lots"])
    assert result.exit_code == 2 and "size 'lots'" in result.output


# ---------------------------------------------------------------------------
# on a shaped sandbox


@pytest.fixture(scope="module")
def shaped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sandbox]:
    if os.geteuid() != 0:
        pytest.skip("the sandbox needs root (network namespaces); CI runs as root")
    tag = f"b{os.getpid()}"
    sb = Sandbox(name=tag, prefix=f"{tag}n", state_dir=tmp_path_factory.mktemp("shaped") / "state")
    try:
        sb.up(3, with_keys=True, rate="200mbit")
        yield sb
    finally:
        sb.down()


def _bench(sb: Sandbox, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "corral", "bench", "-c", str(sb.cluster_file), *args],
                          capture_output=True, text=True, timeout=600, check=False)


@pytest.mark.sandbox
def test_links_measure_the_configured_rate(shaped: Sandbox) -> None:
    proc = _bench(shaped, "--no-allreduce", "--seconds", "2", "--json")
    assert proc.returncode == 0, proc.stderr + proc.stdout[-3000:]
    links = json.loads(proc.stdout)["links"]
    assert links["tool"] == "iperf3"  # installed on the nodes
    rates = {(m["src"], m["dst"]): m["bps"] for m in links["matrix"]}
    assert sorted(rates) == sorted(permutations(shaped.nodes, 2))
    for pair, bps in rates.items():
        assert abs(bps - RATE) <= 0.15 * RATE, (pair, bps)
    assert [f["severity"] for f in links["findings"]] == ["ok"]


@pytest.mark.sandbox
def test_a_slowed_node_is_singled_out(shaped: Sandbox) -> None:
    slow = shaped.nodes[2]
    shaped.slow(slow, "50mbit")
    try:
        proc = _bench(shaped, "--no-allreduce", "--seconds", "2", "--tool", "builtin", "--json")
    finally:
        shaped.slow(slow, "200mbit")
    assert proc.returncode == 0, proc.stderr
    links = json.loads(proc.stdout)["links"]
    flagged = [f for f in links["findings"] if f["severity"] == "warning"]
    assert [f["host_list"] for f in flagged] == [[slow]], links["findings"]
    for m in links["matrix"]:
        if slow in (m["src"], m["dst"]):
            assert 0.6 * 50e6 <= m["bps"] <= 1.15 * 50e6, m
        else:
            assert abs(m["bps"] - RATE) <= 0.15 * RATE, m


@pytest.mark.sandbox
def test_allreduce_table_through_the_launch_path(shaped: Sandbox) -> None:
    proc = _bench(shaped, "--no-links", "--max-size", "2MiB", "--iters", "3", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    out = proc.stdout
    assert "All-reduce (gloo, 3 ranks on 3 node(s)" in out
    assert re.search(r"#\s+size\s+count\s+type\s+redop\s+time\s+algbw\s+busbw", out)
    rows = [line.split() for line in out.splitlines() if re.match(r"^\s+\d+\s+\d+\s+float\s+sum", line)]
    assert [int(r[0]) for r in rows] == [MIB, 2 * MIB]
    for size, _count, _t, _op, time_us, algbw, busbw in rows:
        assert float(algbw) == pytest.approx(int(size) / (float(time_us) / 1e6) / 1e9, abs=6e-4)
        assert float(busbw) == pytest.approx(float(algbw) * 2 * 2 / 3, abs=2e-3)
        # A ring all-reduce cannot beat the links: busbw stays under 200 Mbit/s (+15%).
        assert float(busbw) * 8e9 <= 1.15 * RATE
