"""corral installs like a real tool: sdist -> wheel -> a fresh venv, as a user who is not root.

The wheel is built from the sdist (as `python -m build` does), so a file
missing from the sdist shows up here; it is installed with pip into a new
virtual environment by uid 65534 with its own HOME (no compiler, no torch:
only corral's own dependencies), and the installed console script must
answer --version, show this machine as a cluster, run a command through the
local launcher and print its shell completion.  Package data (the diagnosis
rules, the rank hook, the doctor's workloads) must be in the wheel.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NOBODY = 65534

#: Files the installed corral reads at run time, besides its modules.
PACKAGE_DATA = ("corral/diagnose/rules.toml", "corral/agent/hook/sitecustomize.py",
                "corral/doctor/workloads/smoke_allreduce.py", "corral/doctor/workloads/allreduce_perf.py",
                "corral/interop/ds_keys.json", "corral/py.typed")


def _build(backend_call: str, cwd: Path, out: Path) -> Path:
    """Call setuptools' PEP 517 hook in ``cwd`` (what `python -m build` calls,
    without its isolated environment: this works offline)."""
    code = f"from setuptools import build_meta as b; print(b.{backend_call}({str(out)!r}))"
    res = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    # pyproject's `license = { text = ... }` built with a SetuptoolsDeprecationWarning
    # (such builds stop being supported in 2027-02): the metadata must build clean.
    assert "DeprecationWarning" not in res.stderr, res.stderr[-3000:]
    return out / res.stdout.strip().splitlines()[-1]


@pytest.fixture
def user_dir():
    """A directory the unprivileged user owns (pytest's tmp_path is root's, 0700)."""
    path = Path(tempfile.mkdtemp(prefix="corral-install-"))
    path.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(path, NOBODY, NOBODY)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_the_wheel_built_from_the_sdist_installs_and_runs_as_a_plain_user(user_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "src-copy"  # never build in the checkout: build/ and egg-info stay out of it
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    sdist = _build("build_sdist", src, tmp_path)
    with tarfile.open(sdist) as tar:
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(tmp_path / "unpacked", **extra)
    [root] = (tmp_path / "unpacked").iterdir()
    wheel = _build("build_wheel", root, tmp_path)
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name  # pure Python: no compiler on the machine
    names = set(zipfile.ZipFile(wheel).namelist())
    assert set(PACKAGE_DATA) <= names, sorted(set(PACKAGE_DATA) - names)
    shutil.copy(wheel, user_dir / wheel.name)
    home = user_dir / "home"
    venv = user_dir / "venv"
    script = (f"set -e; mkdir -p {home}; cd {home}; python3 -m venv {venv}; "
              f"{venv}/bin/pip install -q --disable-pip-version-check {user_dir / wheel.name}; "
              f"{venv}/bin/corral --version; "
              f"{venv}/bin/corral hosts --json; "
              f"{venv}/bin/corral run --launcher command -- sh -c 'echo ran as $(id -u)'; "
              f"_CORRAL_COMPLETE=bash_source {venv}/bin/corral; "
              f"{venv}/bin/python -c 'import torch' 2>/dev/null && echo HAS-TORCH || true")
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
    env.update({k: v for k, v in os.environ.items() if k.startswith(("PIP_", "http", "HTTP", "no_proxy"))})
    user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"] if os.geteuid() == 0 else []
    if user:
        for path in (user_dir / wheel.name,):
            os.chown(path, NOBODY, NOBODY)
    res = subprocess.run([*user, "bash", "-c", script], cwd=user_dir, env=env, capture_output=True, text=True,
                         timeout=240, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    out = res.stdout
    assert "corral, version" in out
    assert '"schema": "corral.hosts/1"' in out and f"{venv}/bin/python" in out
    assert f"[r0] ran as {os.geteuid() if not user else NOBODY}" in out, out[-2000:]
    assert "_corral_completion()" in out and "HAS-TORCH" not in out


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if "__pycache__" not in p.parts}


@pytest.mark.slow
def test_make_demo_leaves_nothing_of_root_in_the_checkout(tmp_path: Path) -> None:
    """`make demo` as root left src/corral.egg-info (root's) in the checkout, and a
    second user's `pip install -e .` from it stopped there.  The Makefile's own
    rule runs in a copy of the checkout, with pip from the configured index (the
    demo's requirements emptied and --no-deps: torch is not what is tested)."""
    if shutil.which("make") is None:
        pytest.skip("needs make(1)")
    copy = tmp_path / "checkout"
    copy.mkdir()
    for name in ("Makefile", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, copy / name)
    shutil.copytree(REPO / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (copy / "requirements-demo.txt").write_text("")
    before = _tree(copy)
    venv = tmp_path / "venv"
    pip = f"{venv}/bin/python -m pip install -q --disable-pip-version-check --no-deps"
    res = subprocess.run(["make", "-s", f"VENV={venv}", f"PIP={pip}", f"{venv}/.demo-installed"], cwd=copy,
                         capture_output=True, text=True, timeout=240, check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert (venv / ".demo-installed").is_file()
    assert _tree(copy) - before == set()
