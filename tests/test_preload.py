"""Preloaded ranks (agent/preload.py): a forked rank must start as a fresh one would.

The end-to-end tests run the same probe script twice on this machine, once
preloaded (the default) and once with ``--fresh-ranks``, and compare what
each rank saw of its own start: argv, ``__file__``, ``sys.path[0]``, its
parent, session, stdio, thread settings, exit codes and tracebacks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from corral.agent.preload import env_mismatch, script_blocker

CORRAL = [sys.executable, "-m", "corral"]


def corral(args: list[str], cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(CORRAL + args, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def write(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


# -- what counts as a difference ------------------------------------------


def test_env_mismatch_names_start_up_variables_only() -> None:
    base = {"PATH": "/bin", "OMP_NUM_THREADS": "4", "HOME": "/root"}
    assert env_mismatch(base, dict(base, RANK="3", MASTER_ADDR="x", NCCL_DEBUG="INFO")) is None
    assert env_mismatch(base, dict(base, TORCHELASTIC_RUN_ID="r", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")) is None
    # read per torch.cuda.is_available() call; set by importing Lightning (a head that did forwards it)
    assert env_mismatch(base, dict(base, PYTORCH_NVML_BASED_CUDA_CHECK="1")) is None
    assert env_mismatch(base, dict(base, TORCH_LOGS="+dynamo")) == "TORCH_LOGS"
    assert env_mismatch(base, dict(base, LD_PRELOAD="/x.so")) == "LD_PRELOAD"
    assert env_mismatch(base, dict(base, PYTHONHASHSEED="0")) == "PYTHONHASHSEED"
    assert env_mismatch(base, dict(base, OMP_NUM_THREADS="1")) == "OMP_NUM_THREADS"
    assert env_mismatch(base, dict(base, OMP_NUM_THREADS="1"), skip=("OMP_NUM_THREADS",)) is None
    gone = dict(base)
    del gone["OMP_NUM_THREADS"]
    assert env_mismatch(base, gone) == "OMP_NUM_THREADS"


def test_env_mismatch_allows_corral_hook_in_front_of_pythonpath() -> None:
    assert env_mismatch({}, {"PYTHONPATH": "/tmp/hook"}, hook_dir="/tmp/hook") is None
    assert env_mismatch({"PYTHONPATH": "/a"}, {"PYTHONPATH": "/tmp/hook:/a"}, hook_dir="/tmp/hook") is None
    assert env_mismatch({"PYTHONPATH": "/a"}, {"PYTHONPATH": "/tmp/hook:/b"}, hook_dir="/tmp/hook") == "PYTHONPATH"
    assert env_mismatch({}, {"PYTHONPATH": "/tmp/hook"}, hook_dir=None) == "PYTHONPATH"
    assert env_mismatch({"LANG": "C"}, {"LANG": "C.UTF-8"}, prefixes=("PYTHON",)) is None


@pytest.mark.parametrize("body, why", [
    ("import os\nos.environ['OMP_NUM_THREADS'] = '4'\nimport torch\n", "OMP_NUM_THREADS"),
    ("import os\nos.environ.setdefault('MKL_NUM_THREADS', '4')\nimport torch\n", "MKL_NUM_THREADS"),
    ("import os\nos.environ.update(X='1')\nfrom torch import nn\n", "os.environ.update"),
    ("import os\nk = 'A'\nos.environ[k] = '1'\nimport transformers\n", "os.environ"),
    ("import sys\nsys.path.insert(0, '/opt/torch-fork')\nimport torch\n", "sys.path"),
    ("import os\nos.putenv('TORCH_LOGS', 'x')\nimport torch\n", "putenv"),
    ("import os\nif True:\n    os.environ['TORCH_LOGS'] = 'x'\nimport torch\n", "TORCH_LOGS"),
])
def test_script_blocker_finds_start_up_changes_before_torch(tmp_path: Path, body: str, why: str) -> None:
    reason = script_blocker(str(write(tmp_path / "s.py", body)))
    assert reason is not None and why in reason


def test_script_blocker_follows_modules_next_to_the_script(tmp_path: Path) -> None:
    (tmp_path / "config.py").write_text("import os\nos.environ['OMP_NUM_THREADS'] = '8'\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("import os\nimport config\n")
    (tmp_path / "model.py").write_text("import torch\n")
    reason = script_blocker(str(write(tmp_path / "a.py", "import config\nimport torch\n")))
    assert reason == "config.py: sets os.environ['OMP_NUM_THREADS'] before importing torch"
    (tmp_path / "pkg2").mkdir()
    (tmp_path / "pkg2" / "__init__.py").write_text("import os\nos.environ.setdefault('KMP_AFFINITY', 'x')\n")
    assert script_blocker(str(write(tmp_path / "b.py", "from pkg import x\nimport torch\n"))).startswith("config.py")
    assert script_blocker(str(write(tmp_path / "b2.py", "import pkg2\nimport torch\n"))) == (
        "pkg2/__init__.py: sets os.environ['KMP_AFFINITY'] before importing torch")
    # A module next to the script that imports torch first: what comes after is harmless.
    assert script_blocker(str(write(tmp_path / "c.py", "import model\nimport config\n"))) is None
    # Circular local imports end.
    (tmp_path / "loop1.py").write_text("import loop2\n")
    (tmp_path / "loop2.py").write_text("import loop1\n")
    assert script_blocker(str(write(tmp_path / "d.py", "import loop1\nimport torch\n"))) is None


@pytest.mark.parametrize("body", [
    "import torch\nimport os\nos.environ['OMP_NUM_THREADS'] = '4'\n",             # after torch
    "import os\nos.environ['CUDA_VISIBLE_DEVICES'] = '0'\nimport torch\n",          # read at CUDA init
    "import os\nos.environ['NCCL_DEBUG'] = 'INFO'\nimport torch\n",                 # read at PG init
    "import os\ndef main():\n    os.environ['OMP_NUM_THREADS'] = '4'\nimport torch\n",  # not top level
    "import os\nimport helper\nos.environ['OMP_NUM_THREADS'] = '4'\n",             # local module first
    "this is not python\n",                                                           # the rank reports it
])
def test_script_blocker_lets_harmless_scripts_through(tmp_path: Path, body: str) -> None:
    (tmp_path / "helper.py").write_text("import torch\n")
    assert script_blocker(str(write(tmp_path / "s.py", body))) is None


# -- end to end: preloaded and fresh ranks see the same start --------------

PROBE = """
    import ctypes, io, json, logging, os, signal, sys, warnings
    import torch
    import torch.distributed as dist

    def blas_threads():
        # numpy's OpenBLAS, loaded with torch: its pool size follows OMP_NUM_THREADS
        for line in open("/proc/self/maps"):
            parts = line.split()
            if len(parts) >= 6 and "openblas" in parts[5].lower():
                lib = ctypes.CDLL(parts[5])
                for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads64_",
                             "openblas_get_num_threads"):
                    if hasattr(lib, name):
                        return getattr(lib, name)()
        return None

    facts = {
        "argv": sys.argv,
        "file": __file__,
        "name": __name__,
        "main_file": sys.modules["__main__"].__file__,
        "path0": sys.path[0],
        "path": sys.path,
        "orig_argv": getattr(sys, "orig_argv", None),
        "environ": sorted(os.environ.items()),
        "main_attrs": sorted(k for k in vars(sys.modules["__main__"]) if k.startswith("__")),
        "main_meta": [repr(__spec__), repr(__package__), type(__loader__).__name__],
        "stdio": [sys.stdout.encoding, sys.stdout.errors, sys.stderr.errors, sys.stdout.line_buffering,
                  sys.stdout.write_through, sys.stdin.encoding],
        "cwd": os.getcwd(),
        "parent_is_torchrun": b"torch.distributed.run" in open(f"/proc/{os.getppid()}/cmdline", "rb").read(),
        "session_leader": os.getsid(0) == os.getpid(),
        "cmdline": open("/proc/self/cmdline", "rb").read().split(b"\\0")[1:3] == [b"-u", sys.argv[0].encode()],
        "threads": torch.get_num_threads(),
        "blas_threads": blas_threads(),
        "root_logger": [logging.getLogger().level, len(logging.getLogger().handlers)],
        "warning_filters": len(warnings.filters),
        "signals": [str(signal.getsignal(s)) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP,
                                                      signal.SIGPIPE, signal.SIGUSR1, signal.SIGCHLD)],
        "omp": os.environ.get("OMP_NUM_THREADS"),
        "user_env": os.environ.get("PROBE_VALUE"),
        "stdout_raw": isinstance(sys.stdout.buffer, io.FileIO),
        "stdin_empty": sys.stdin.read() == "",
        "rank_env": (os.environ["RANK"], os.environ["LOCAL_RANK"], os.environ["WORLD_SIZE"]),
        # The launcher's module is imported in the zygote, never by a fresh rank.
        "preloaded": any(m in sys.modules for m in ("torch.distributed.run", "accelerate.commands.launch")),
    }
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    facts["sum"] = t.item()
    dist.destroy_process_group()
    # What differs from run to run, not between preloaded and fresh ranks:
    # (the error file is in the job's directory, whose name has the run id: replaced first)
    text = json.dumps(facts, sort_keys=True).replace(os.environ["TORCHELASTIC_ERROR_FILE"], "<error-file>")
    text = text.replace(os.environ["CORRAL_RUN_ID"], "<run>")
    print("FACTS " + text.replace('"' + os.environ["MASTER_PORT"] + '"', '"<port>"'))
    if os.environ["RANK"] == "1":
        raise SystemExit(int(sys.argv[1]))
"""


def facts_of(out: str) -> dict[str, dict]:
    found = {}
    for line in out.splitlines():
        tag, _, rest = line.partition(" FACTS ")
        if rest:
            found[tag.strip()] = json.loads(rest)
    return found


def preloaded_and_fresh(options: list[str], program: list[str], cwd: Path, ranks: int,
                        cluster: list[str] = ()) -> tuple[dict, dict, list[str]]:
    """Run the probe preloaded, then with --fresh-ranks: (facts, facts, both stdouts).

    The ``preloaded`` fact is checked and taken out, so the rest can be compared.
    """
    runs, outs = {}, []
    for extra in ([], ["--fresh-ranks"]):
        res = subprocess.run(CORRAL + ["run", *cluster, *options, *extra, *program], cwd=cwd,
                             capture_output=True, text=True, timeout=240)
        assert res.returncode == 0, res.stdout + res.stderr
        facts = facts_of(res.stdout)
        assert len(facts) == ranks, res.stdout
        for tag, f in facts.items():
            assert f.pop("preloaded") is (not extra), (tag, res.stderr[-3000:])
        runs["fresh" if extra else "preloaded"] = facts
        outs.append(res.stdout)
    return runs["preloaded"], runs["fresh"], outs


def test_preloaded_ranks_start_like_fresh_ones(tmp_path: Path) -> None:
    sub = tmp_path / "code"
    sub.mkdir()
    write(sub / "probe.py", PROBE)
    preloaded, fresh_runs, _ = preloaded_and_fresh(["-n", "2", "-e", "PROBE_VALUE=42"], ["code/probe.py", "0"],
                                                   tmp_path, ranks=2)
    for rank in ("[r0]", "[r1]"):
        pre, fresh = preloaded[rank], fresh_runs[rank]
        assert pre == fresh
        assert fresh["parent_is_torchrun"] and fresh["session_leader"] and fresh["stdout_raw"]
        assert fresh["argv"] == ["code/probe.py", "0"] and fresh["user_env"] == "42" and fresh["sum"] == 2.0


def test_accelerate_ranks_are_preloaded_and_start_like_fresh(tmp_path: Path) -> None:
    """`accelerate launch` runs torchrun's agent in-process: its ranks are preloaded the same way."""
    write(tmp_path / "probe.py", PROBE)
    preloaded, fresh_runs, outs = preloaded_and_fresh(["--launcher", "accelerate", "-n", "2"], ["probe.py", "0"],
                                                      tmp_path, ranks=2)
    assert not any("fresh interpreters" in out for out in outs)
    for rank in ("[r0]", "[r1]"):
        pre, fresh = preloaded[rank], fresh_runs[rank]
        # The one known difference (docs/run.md): importing accelerate's launcher
        # adds its warning filter (UserWarning from torch.optim.lr_scheduler),
        # which a script written for accelerate gets anyway when it imports it.
        assert pre.pop("warning_filters") == fresh.pop("warning_filters") + 1
        assert pre == fresh
        assert ["ACCELERATE_USE_CPU", "1"] in fresh["environ"] and fresh["sum"] == 2.0


RANDOM_PROBE = """
    import json, os, random, sys, tempfile, uuid
    import numpy as np
    import torch
    from torch.utils.data import DataLoader

    def worker_seed(_):
        return torch.initial_seed()  # what a DataLoader worker seeds numpy/random from

    facts = {
        "torch_seed": torch.initial_seed(),
        "torch_rand": torch.rand(1).item(),
        "numpy": float(np.random.rand()),
        "random": random.random(),
        "uuid4": str(uuid.uuid4()),
        "tempfile": os.path.basename(tempfile.mktemp()),
        "pid": os.getpid(),
        "authkey": __import__("multiprocessing").current_process().authkey.hex(),
        "worker_seed": next(iter(DataLoader(range(1), num_workers=1, collate_fn=worker_seed))),
        "preloaded": "torch.distributed.run" in sys.modules,
    }
    print("FACTS " + json.dumps(facts))
"""


def test_preloaded_ranks_draw_their_own_random_state(tmp_path: Path) -> None:
    """Every rank on a node draws its own seeds, numbers, uuids and temp names,
    preloaded as fresh: ranks that shared torch's generator repeated each
    other's dropout masks and DataLoader workers' augmentations, silently."""
    write(tmp_path / "rnd.py", RANDOM_PROBE)
    preloaded, fresh_runs, outs = preloaded_and_fresh(["-n", "3"], ["rnd.py"], tmp_path, ranks=3)
    assert not any("fresh interpreters" in out for out in outs)
    for facts in (preloaded, fresh_runs):
        for key in facts["[r0]"]:
            values = [facts[rank][key] for rank in ("[r0]", "[r1]", "[r2]")]
            assert len(set(values)) == 3, (key, facts)


def test_preloaded_rank_exit_code_and_traceback_match_fresh(tmp_path: Path) -> None:
    write(tmp_path / "probe.py", PROBE)
    write(tmp_path / "boom.py", """
        import os
        import torch
        def inner():
            raise ValueError("boom on rank " + os.environ["RANK"])
        if os.environ["RANK"] == "1":
            inner()
    """)
    for mode in ([], ["--fresh-ranks"]):
        res = corral(["run", "-n", "2", *mode, "probe.py", "7"], tmp_path)
        assert res.returncode == 7, res.stdout + res.stderr
        res = corral(["run", "-n", "2", *mode, "boom.py"], tmp_path)
        assert res.returncode == 1
        lines = [ln for ln in res.stdout.splitlines() if ln.startswith("[r1]")]
        tb = [ln[5:] for ln in lines]
        start = tb.index("Traceback (most recent call last):")
        # Exactly the script's frames, as a fresh interpreter prints them.
        assert [ln.strip() for ln in tb[start + 1:] if ln.strip().startswith("File")] == [
            f'File "{tmp_path / "boom.py"}", line 7, in <module>',
            f'File "{tmp_path / "boom.py"}", line 5, in inner',
        ], res.stdout
        assert tb[-1] == "ValueError: boom on rank 1"


def test_script_that_sets_threads_before_torch_gets_fresh_ranks(tmp_path: Path) -> None:
    write(tmp_path / "first.py", """
        import os, sys
        os.environ["OMP_NUM_THREADS"] = "1"
        import torch
        print("preloaded", "torch.distributed.run" in sys.modules)
    """)
    res = corral(["run", "-n", "2", "first.py"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "starting ranks as fresh interpreters: first.py sets os.environ['OMP_NUM_THREADS']" in res.stdout
    assert res.stdout.count("preloaded False") == 2


def test_a_start_up_variable_in_the_jobs_env_says_why_ranks_are_fresh(tmp_path: Path) -> None:
    """PYTHONHASHSEED is read when the interpreter starts: the prewarmed one
    cannot be used, and the node says so, as it does for TORCH_LOGS."""
    write(tmp_path / "seed.py", """
        import os, sys
        print("preloaded", "torch" in sys.modules, "seed", os.environ["PYTHONHASHSEED"], hash("abc") == hash("abc"))
    """)
    res = corral(["run", "-n", "1", "-e", "PYTHONHASHSEED=1", "seed.py"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "starting ranks as fresh interpreters: PYTHONHASHSEED differs from the preloaded interpreter's" in res.stdout
    assert "preloaded False seed 1" in res.stdout


def test_module_ranks_are_preloaded_too(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write(pkg / "__main__.py", """
        import os, sys
        import torch
        print("mod", sys.argv[1:], __name__, __spec__.name, sys.path[0] == os.getcwd(),
              "torch.distributed.run" in sys.modules)
    """)
    res = corral(["run", "-n", "2", "-m", "pkg", "a", "b"], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("mod ['a', 'b'] __main__ pkg.__main__ True True") == 2, res.stdout


@pytest.mark.sandbox
def test_ranks_are_preloaded_on_every_sandbox_node(sandbox) -> None:
    """Over ssh, with the nodes' own login environment: 4 nodes x 2 ranks, all preloaded, all alike."""
    repo = Path(__file__).resolve().parents[1]
    work = repo / "scratch" / f"preload-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    try:
        write(work / "probe.py", PROBE)
        preloaded, fresh_runs, outs = preloaded_and_fresh(["-n", "2"], ["probe.py", "0"], work, ranks=8,
                                                          cluster=["-c", str(sandbox.cluster_file)])
        assert not any("fresh interpreters" in out for out in outs)
        for tag, pre in preloaded.items():
            fresh = fresh_runs[tag]
            assert pre == fresh, tag
            assert pre["sum"] == 8.0
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- when the zygote fails ---------------------------------------------------


def _popen_with(preloader, script: Path, env: dict[str, str]):
    from corral.agent.preload import _popen_class

    cls = _popen_class(preloader)
    return cls([sys.executable, "-u", str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
               start_new_session=True)


def test_dead_zygote_means_fresh_ranks_with_a_line(tmp_path: Path, capfd) -> None:
    import socket

    from corral.agent.preload import Preloader

    ours, theirs = socket.socketpair()
    theirs.close()  # the zygote is gone
    script = write(tmp_path / "hello.py", "import sys\nprint('fresh', 'torch' in sys.modules)\n")
    env = dict(os.environ)
    pre = Preloader(ours, zygote_pid=-1, start_env=env, hook_dir=None)
    proc = _popen_with(pre, script, env)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0 and out.decode().strip() == "fresh False"
    assert "starting ranks as fresh interpreters: the preloaded interpreter failed" in capfd.readouterr().err
    ours.close()


def test_silent_zygote_fails_the_start_instead_of_risking_a_second_rank(tmp_path: Path, monkeypatch) -> None:
    import socket

    from corral.agent import preload

    monkeypatch.setattr(preload, "SPAWN_TIMEOUT_S", 0.5)
    ours, theirs = socket.socketpair()  # a zygote that takes the request and never answers
    stuck = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    script = write(tmp_path / "hello.py", "print('should not run')\n")
    env = dict(os.environ)
    pre = preload.Preloader(ours, zygote_pid=stuck.pid, start_env=env, hook_dir=None)
    with pytest.raises(preload.ZygoteStuck, match="--fresh-ranks"):
        _popen_with(pre, script, env)
    assert stuck.wait(timeout=10) == -9  # the zygote was killed, not left to deliver late
    assert pre.broken
    ours.close()
    theirs.close()
