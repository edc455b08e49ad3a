#!/usr/bin/env python3
"""Scale: what corral costs from 4 to 256 nodes, on one sandbox of the largest size.

    sudo .venv/bin/python bench/bench_scale.py                      # 4,32,128,256 nodes
    sudo .venv/bin/python bench/bench_scale.py --sizes 4,32 --rounds 3
    sudo .venv/bin/python bench/bench_scale.py --sizes 256 --only exec

One sandbox of the largest size is started (real sshd per node, all on
this machine's cores); each size N uses the first N nodes through a cluster
file of its own.  For each N, in one run:

- **exec**: ``corral exec -- hostname``, cold (no ssh master alive: a fresh
  runtime dir) and warm (riding the masters the cold run left), against
  ``pdsh -R ssh -f 32`` (pdsh's default fan-out) and ``pdsh -f N``.  Wall
  time, and the head's CPU: the command and every process it starts on the
  head (ssh clients and masters included) run in a cgroup v1 ``cpuacct``
  group of their own; the nodes' sshd run outside it.  Median of rounds.
  corral runs twice: reaching every node itself (``--tree off``) and through
  relays (``--tree on``: the head logs in to about sqrt(N) nodes, each
  relays to its share; the sandbox's nodes log in to each other, as with a
  shared home, ``corral.sandbox.mesh``); a cold tree round ends the relays'
  own master connections first.  The relays' CPU is the nodes', not the
  head's, as on a real cluster.
- **launch**: ``corral run --launcher command -n 1`` of a script that prints
  the wall-clock time it reached user code: seconds from the command's start
  to the last node's line (and to the command's end).
- **head**: during a run of N nodes (a sleeping command), the head's
  resources, sampled every 0.5 s: the corral process's RSS and open fds,
  processes in its cgroup (ssh clients and masters), RSS of all of them, and
  the cgroup's CPU% over the run.  Under the soft ``ulimit -n`` of a default
  login (1024), to show no fd limit is hit.
- **lost**: the same run, one node partitioned (its link cut): seconds until
  corral names it lost.

Run as root (the sandbox, the cgroups).  Results go to docs/benchmarks.md by hand.
"""

from __future__ import annotations

import argparse
import compileall
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import tomllib

import corral as corral_pkg
from corral.model import Cluster, Host
from corral.sandbox import Sandbox
from corral.sandbox.mesh import mesh

BIN = Path(sys.executable).parent
CORRAL = str(BIN / "corral")
CGROOT = Path("/sys/fs/cgroup")
#: The soft fd limit of a default Linux login, which corral must live within.
DEFAULT_NOFILE = 1024


class Cgroup:
    """A cgroup v1 group in cpuacct, memory and pids for one measured command."""

    def __init__(self, tag: str) -> None:
        self.dirs = {c: CGROOT / c / f"corral-bench-{os.getpid()}-{tag}" for c in ("cpuacct", "memory", "pids")}
        for d in self.dirs.values():
            d.mkdir(exist_ok=True)

    def join(self) -> None:  # in the child, before exec
        for d in self.dirs.values():
            (d / "cgroup.procs").write_text(str(os.getpid()))

    def cpu_s(self) -> float:
        return int((self.dirs["cpuacct"] / "cpuacct.usage").read_text()) / 1e9

    def pids(self) -> list[int]:
        return [int(p) for p in (self.dirs["pids"] / "cgroup.procs").read_text().split()]

    def remove(self) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        time.sleep(0.2)
        for d in self.dirs.values():
            for _ in range(20):
                try:
                    d.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)


def rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def subset_cluster(full: Path, n: int, out: Path) -> Path:
    """A cluster file with the first ``n`` hosts of the sandbox's."""
    doc = tomllib.loads(full.read_text())
    c = doc["cluster"]
    lines = ["[cluster]"]
    for key in ("name", "python", "user"):
        lines.append(f'{key} = "{c[key]}"')
    lines += [f"slots = {c['slots']}", f"port = {c['port']}",
              "ssh_options = [" + ", ".join(f'"{o}"' for o in c["ssh_options"]) + "]"]
    for h in doc["hosts"][:n]:
        lines += ["[[hosts]]", f'name = "{h["name"]}"', f'address = "{h["address"]}"']
    out.write_text("\n".join(lines) + "\n")
    return out


def measured(argv: list[str], env: dict, tag: str, expect_lines: int = 0,
             timeout: float = 600, cwd: Path | None = None) -> tuple[float, float]:
    """(wall s, head CPU s) of ``argv`` run in a cgroup of its own."""
    cg = Cgroup(tag)
    try:
        t0 = time.perf_counter()
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False,
                              preexec_fn=cg.join, cwd=cwd)
        wall = time.perf_counter() - t0
        cpu = cg.cpu_s()
    finally:
        cg.remove()  # ssh masters a cold run left behind count until here: their share
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or len(lines) < expect_lines:
        raise SystemExit(f"{argv[:3]} failed (rc={proc.returncode}):\n{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}")
    return wall, cpu


def _forget_relay_masters(sb: Sandbox, cluster: Cluster) -> None:
    """A cold tree round: the relays' master connections to their members
    (kept a minute, as on the head) are ended first."""
    from corral.transport.tree import groups

    for group in groups(cluster.hosts):
        sb.exec(group[0].name, ["sh", "-c", "pkill -f '^ssh: /tmp/[c]orral-relay'; true"])


def bench_exec(sb: Sandbox, cluster: Path, n: int, rounds: int) -> dict:
    hosts = sb.nodes[:n]
    pdsh_env = dict(os.environ, PDSH_SSH_ARGS_APPEND=f"-F {sb.ssh_config}")
    modes = {"corral": "off", "corral tree": "on"}
    rows: dict[str, list[tuple[float, float]]] = {"pdsh -f 32": [], f"pdsh -f {n}": []}
    for name in modes:
        rows[f"{name} cold"], rows[f"{name} warm"] = [], []
    loaded = Cluster(hosts=tuple(Host(name=h) for h in hosts))
    for r in range(rounds):
        for f in (32, n):
            argv = ["pdsh", "-R", "ssh", "-f", str(f), "-w", ",".join(hosts), "hostname"]
            rows[f"pdsh -f {f}"].append(measured(argv, pdsh_env, f"pdsh{f}", n))
        for name, tree in modes.items():
            if tree == "on":
                _forget_relay_masters(sb, loaded)
            runtime = Path(tempfile.mkdtemp(prefix="sc", dir="/tmp"))
            env = dict(os.environ, XDG_RUNTIME_DIR=str(runtime))
            argv = [CORRAL, "exec", "--tree", tree, "-c", str(cluster), "--", "hostname"]
            cg = Cgroup("corral")  # cold and warm in one group: the masters live across both
            try:
                for kind in ("cold", "warm"):
                    before, t0 = cg.cpu_s(), time.perf_counter()
                    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600,
                                          preexec_fn=cg.join)
                    wall = time.perf_counter() - t0
                    back = re.search(r"(\d+) host\(s\) could not be reached through their relay", proc.stderr)
                    if back:  # reached from here all the same: counted, not fatal
                        print(f"    {name} {kind}: {back.group(0)} (reached from here)", flush=True)
                    if proc.returncode != 0:
                        raise SystemExit(f"corral exec --tree {tree} ({kind}) failed (rc={proc.returncode}):\n{proc.stdout[:1500]}\n{proc.stderr[-1500:]}")
                    rows[f"{name} {kind}"].append((wall, cg.cpu_s() - before))
            finally:
                cg.remove()
                shutil.rmtree(runtime, ignore_errors=True)
        print(f"    exec round {r + 1}: " + "  ".join(f"{k} {v[-1][0]:.2f}s/{v[-1][1]:.2f}cpu"
                                                     for k, v in rows.items()), flush=True)
    return {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in rows.items()}


LAUNCH_SCRIPT = "import time, socket; print('in-user-code', repr(time.time()), flush=True)\n"
SLEEP_SCRIPT = ("import sys, time; print('up', flush=True)\n"
                "time.sleep(float(sys.argv[1]))\n")


def bench_sync(cluster: Path, n: int, work: Path) -> tuple[float, float]:
    """The work dir (the scripts below) onto every node: (wall s, head CPU s).
    The runs below need it there (the nodes' /tmp is their own)."""
    (work / "t.py").write_text(LAUNCH_SCRIPT)
    (work / "s.py").write_text(SLEEP_SCRIPT)
    return measured([CORRAL, "sync", "-c", str(cluster)], dict(os.environ, PWD=str(work)),
                    f"sync{n}", cwd=work)


def bench_launch(cluster: Path, n: int, work: Path, rounds: int) -> tuple[float, float]:
    firsts, totals = [], []
    for _ in range(rounds):
        t0 = time.time()
        proc = subprocess.run([CORRAL, "run", "-c", str(cluster), "-n", "1", "--launcher", "command",
                               sys.executable, "t.py"], cwd=work, capture_output=True, text=True, timeout=600)
        total = time.time() - t0
        stamps = [float(x) for x in re.findall(r"in-user-code (\d+\.\d+)", proc.stdout)]
        if proc.returncode != 0 or len(stamps) != n:
            raise SystemExit(f"launch failed ({len(stamps)}/{n} lines):\n{proc.stderr[-2000:]}")
        firsts.append(max(stamps) - t0)
        totals.append(total)
    return statistics.median(firsts), statistics.median(totals)


def bench_run(sb: Sandbox, cluster: Path, n: int, work: Path) -> dict:
    """Head resources during a run, then one node partitioned: seconds to named."""
    cg = Cgroup("run")
    env = dict(os.environ)
    argv = ["prlimit", f"--nofile={DEFAULT_NOFILE}:", "--",  # the soft limit; the hard one as it is
            CORRAL, "run", "-c", str(cluster), "-n", "1", "--launcher", "command", sys.executable, "s.py", "600"]
    proc = subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=cg.join)
    out: list[str] = []
    err: list[str] = []
    threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True).start()
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    victim = sb.nodes[n - 1]
    try:
        t0 = time.monotonic()
        while sum(" up" in line for line in out) < n:
            if proc.poll() is not None or time.monotonic() - t0 > 600:
                raise SystemExit(f"run did not start on {n} nodes:\n{''.join(err)[-2000:]}")
            time.sleep(0.2)
        started = time.monotonic() - t0
        # steady state: 10 s of samples
        cpu0, s0 = cg.cpu_s(), time.monotonic()
        peak = {"corral_rss_mb": 0.0, "corral_fds": 0, "head_processes": 0, "all_rss_mb": 0.0}
        while time.monotonic() - s0 < 10:
            if proc.poll() is not None:
                raise SystemExit(f"run ended early (rc={proc.returncode}):\n{''.join(err)[-2000:]}")
            pids = cg.pids()
            if not any(_is_corral(p) for p in pids):
                time.sleep(0.1)
                continue
            peak["corral_rss_mb"] = max(peak["corral_rss_mb"], max(rss_kb(p) for p in pids if _is_corral(p)) / 1024)
            peak["corral_fds"] = max(peak["corral_fds"], max(fds(p) for p in pids if _is_corral(p)))
            peak["head_processes"] = max(peak["head_processes"], len(pids))
            peak["all_rss_mb"] = max(peak["all_rss_mb"], sum(rss_kb(p) for p in pids) / 1024)
            time.sleep(0.5)
        peak["cpu_percent"] = 100 * (cg.cpu_s() - cpu0) / (time.monotonic() - s0)
        cut = time.monotonic()
        sb.partition(victim)
        while f"{victim} was lost" not in "".join(out) + "".join(err):  # said live on stdout, then in the summary
            if time.monotonic() - cut > 120:
                raise SystemExit(f"{victim} not named lost within 120 s:\n{''.join(err)[-2000:]}")
            time.sleep(0.1)
        peak["lost_named_s"] = time.monotonic() - cut
        proc.wait(timeout=120)
        peak["exit_code"] = proc.returncode
        peak["started_s"] = started
        return peak
    finally:
        sb.heal(victim)
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
        cg.remove()


def _is_corral(pid: int) -> bool:
    try:
        return b"corral" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1]
    except (OSError, IndexError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="4,32,128,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", choices=["exec", "launch", "run"], action="append")
    ap.add_argument("--keep", action="store_true", help="leave the sandbox up")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    parts = args.only or ["exec", "launch", "run"]
    compileall.compile_dir(Path(corral_pkg.__file__).parent, quiet=1)
    sb = Sandbox(name="scale", prefix="sc")
    t0 = time.monotonic()
    sb.up(max(sizes), with_keys=True)
    mesh(sb)  # nodes log in to each other (a shared home): exec's relays need it
    up_s = time.monotonic() - t0
    per_node = node_rss_mb(sb)
    print(f"sandbox up {max(sizes)} nodes: {up_s:.1f}s (0 s when it was up already); its processes on an idle "
          f"node (init, sshd): {per_node:.1f} MB RSS", flush=True)
    work = Path(tempfile.mkdtemp(prefix="scale-"))
    results = {}
    try:
        for n in sizes:
            cluster = subset_cluster(sb.cluster_file, n, work / f"c{n}.toml")
            res: dict = {}
            print(f"\n== {n} nodes", flush=True)
            if "exec" in parts:
                res["exec"] = bench_exec(sb, cluster, n, args.rounds)
            res["sync"] = bench_sync(cluster, n, work)
            print(f"    sync (2 small files): {res['sync'][0]:.2f}s, head CPU {res['sync'][1]:.2f}s", flush=True)
            if "launch" in parts:
                res["launch"] = bench_launch(cluster, n, work, args.rounds)
                print(f"    launch: last node in user code {res['launch'][0]:.2f}s, command {res['launch'][1]:.2f}s",
                      flush=True)
            if "run" in parts:
                res["run"] = bench_run(sb, cluster, n, work)
                print("    run: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                              for k, v in res["run"].items()), flush=True)
            results[n] = res
        report(results, sizes)
        shutil.rmtree(work, ignore_errors=True)  # kept after a failure: its runs/ say what happened
    finally:
        if not args.keep:
            sb.down()


def report(results: dict, sizes: list[int]) -> None:
    print("\n| nodes | pdsh -f 32 wall / head CPU | pdsh -f N | corral cold | corral warm | "
          "corral tree cold | corral tree warm | cold CPU vs pdsh -f 32 (direct, tree) | "
          "launch to user code | lost named | corral RSS | corral fds | head procs |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for n in sizes:
        r = results[n]
        e = r.get("exec")
        cells = [str(n)]
        if e:
            pd, pn, cc, cw = e["pdsh -f 32"], e[f"pdsh -f {n}"], e["corral cold"], e["corral warm"]
            tc, tw = e["corral tree cold"], e["corral tree warm"]
            cells += [f"{v[0]:.2f}s / {v[1]:.2f}s" for v in (pd, pn, cc, cw, tc, tw)]
            cells.append(f"{cc[1] / pd[1]:.2f}x, {tc[1] / pd[1]:.2f}x")
        else:
            cells += ["-"] * 7
        cells.append(f"{r['launch'][0]:.2f}s" if "launch" in r else "-")
        if "run" in r:
            u = r["run"]
            cells += [f"{u['lost_named_s']:.1f}s", f"{u['corral_rss_mb']:.0f} MB", str(u["corral_fds"]),
                      str(u["head_processes"])]
        else:
            cells += ["-"] * 4
        print("| " + " | ".join(cells) + " |")
    if len(sizes) > 1 and all("launch" in results[n] for n in sizes):
        lo, hi = results[sizes[0]]["launch"][0], results[sizes[-1]]["launch"][0]
        print(f"\nlaunch {sizes[-1]} nodes / {sizes[0]} nodes: {hi / lo:.2f}x (goal <= 3x)")


def node_rss_mb(sb: Sandbox) -> float:
    """Mean RSS of the processes in one idle node's namespace (its init and sshd)."""
    from corral.sandbox import netns

    spec = sb.spec
    names = [spec.node(i).netns for i in range(1, min(spec.nodes, 16) + 1)]
    pids = netns.pids_by_netns(names)
    return statistics.mean(sum(rss_kb(p) for p in pids[n]) for n in names) / 1024


if __name__ == "__main__":
    main()
