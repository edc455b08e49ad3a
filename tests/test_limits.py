"""The head's open-file limit: raised to what hundreds of nodes need, said, or refused up front."""

from __future__ import annotations

import subprocess
import sys
import textwrap

PROGRAM = textwrap.dedent("""
    import resource, sys
    from corral.errors import CorralError
    from corral.limits import ensure_open_files, files_needed
    soft, hard = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        ensure_open_files(files_needed(256), "a run on 256 nodes", say=lambda line: print("SAID", line))
    except CorralError as e:
        print("REFUSED", e.message, "|", e.hint)
    print("NOW", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
""")


def limited(soft: int, hard: int) -> str:
    res = subprocess.run([sys.executable, "-c", PROGRAM, str(soft), str(hard)], capture_output=True, text=True, check=False,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_256_nodes_need_more_than_a_default_login_allows() -> None:
    from corral.limits import files_needed

    assert files_needed(4) < 1024 < files_needed(256)


def test_the_soft_limit_is_raised_to_the_hard_one_and_said() -> None:
    out = limited(1024, 4096)
    assert "SAID raised this process's open-file limit (ulimit -n) from 1024 to 4096" in out
    assert "NOW 4096" in out


def test_a_hard_limit_too_low_is_refused_with_the_numbers() -> None:
    out = limited(1024, 1024)
    assert "REFUSED a run on 256 nodes needs about 1088 open files at once; this process may open 1024" in out
    assert "limits.conf" in out and "NOW 1024" in out


def test_nothing_is_said_when_the_limit_is_enough() -> None:
    out = limited(4096, 4096)
    assert "SAID" not in out and "REFUSED" not in out and "NOW 4096" in out


def test_pings_heartbeats_and_telemetry_slow_down_past_64_nodes_so_the_heads_work_stays_flat() -> None:
    from corral.limits import ping_interval, telemetry_interval

    assert [ping_interval(n) for n in (1, 4, 64, 128, 256, 500)] == [1.0, 1.0, 1.0, 2.0, 2.5, 2.5]
    assert ping_interval(256, timeout=4.0) == 1.0  # a short --node-timeout keeps 4 pings within it
    assert [telemetry_interval(n) for n in (4, 64, 128, 256, 500)] == [1.0, 1.0, 2.0, 4.0, 5.0]
    # per node and second, 256 nodes cost the head what 102 did at 1 s
    assert 256 / ping_interval(256) < 103


def test_a_pool_of_hundreds_of_nodes_pings_them_less_often() -> None:
    from corral.agent.session import AgentPool
    from corral.model import Cluster, Host

    big = Cluster(name="big", hosts=tuple(Host(name=f"n{i}") for i in range(256)))
    small = Cluster(name="small", hosts=tuple(Host(name=f"n{i}") for i in range(4)))
    assert {s.ping_s for s in AgentPool(big, tag="t").sessions} == {2.5}
    assert {s.ping_s for s in AgentPool(small, tag="t").sessions} == {1.0}
