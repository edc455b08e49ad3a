"""`corral sync`: what is sent, how trees are described, and that every node ends up the same.

Pure parts (gitignore syntax, the file list of a real git repository, tree
manifests and the stat cache, node-side status/delete run here) need no
root; a local sync (this machine to another directory) runs the whole
command anywhere.  Sandbox tests sync a project with ignored files,
symlinks, deletions and a changed large file, and check each node's tree
with their own walk and sha256, not with corral's bookkeeping.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import pid_alive

from corral.sync import filelist, nodetree
from corral.sync.ignore import IgnoreRules, parse
from corral.sync.rsync import failure, parse_progress, rsh_word

REPO = Path(__file__).resolve().parents[1]
CORRAL = [sys.executable, "-m", "corral"]
ROOT = os.geteuid() == 0
MiB = 1 << 20


# ---------------------------------------------------------------------------
# gitignore syntax


@pytest.mark.parametrize(
    ("path", "is_dir", "ignored"),
    [
        ("m.pyc", False, True),
        ("d/keep.pyc", False, False),
        ("runs", True, True),
        ("sub/runs", True, False),
        ("runs/x", False, True),
        ("data/f", False, True),
        ("q/data/f", False, True),
        ("data", False, False),
        ("a/b", False, True),
        ("a/x/y/b", False, True),
        ("foo", False, True),
        ("z/foo", False, True),
        ("doc/a.txt", False, True),
        ("doc/s/a.txt", False, False),
        ("x/deep/er", False, True),
        ("#lit", False, True),
        ("sp ace ", False, True),
        ("f[1].c", False, False),
        ("f1.c", False, True),
    ],
)
def test_gitignore_semantics(path: str, is_dir: bool, ignored: bool) -> None:
    rules = IgnoreRules(
        parse(
            [
                "# comment",
                "*.pyc",
                "/runs/",
                "data/",
                "!keep.pyc",
                "a/**/b",
                "**/foo",
                "doc/*.txt",
                "x/**",
                "\\#lit",
                "sp ace\\ ",
                "f[0-9].c",
                "",
            ]
        )
    )
    assert rules.ignored(path, is_dir) is ignored


def test_no_reinclude_inside_an_excluded_directory() -> None:
    rules = IgnoreRules(parse(["build/", "!build/keep.txt"]))
    assert rules.ignored("build/keep.txt")


# ---------------------------------------------------------------------------
# the file list


def _git(root: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args],
        cwd=root,
        check=True,
        capture_output=True,
    )


def make_project(root: Path, *, big: int = 0) -> Path:
    """A git project with everything a sync must get right."""
    root.mkdir(parents=True, exist_ok=True)
    _git(root, "init", "-q", ".")
    files = {
        "train.py": "print('train')\n",
        "src/model.py": "x = 1\n",
        "src/util/io.py": "y = 2\n",
        "configs/a.yaml": "lr: 1\n",
        "gone.txt": "to be deleted\n",
        ".gitignore": "data/\n*.log\n",
        ".corralignore": "*.tmp\nscratch/\n",
        "notes.tmp": "no\n",
        "scratch/x.py": "no\n",
        "app.log": "no\n",
        "data/shard0.bin": "ignored by git\n",
        "runs/old/rank0.log": "corral's own logs\n",
        ".venv/bin/python": "venv\n",
        "src/__pycache__/model.cpython-311.pyc": "pyc\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    os.chmod(root / "train.py", 0o755)
    os.symlink("src/model.py", root / "model_link.py")
    os.symlink("/nonexistent/elsewhere", root / "dangling")
    if big:
        (root / "ckpt").mkdir()
        (root / "ckpt" / "big.bin").write_bytes(os.urandom(big))
    _git(root, "add", "-A")
    _git(root, "commit", "-qm", "init")
    (root / "untracked_new.py").write_text("new\n")
    return root


EXPECTED = {
    "train.py",
    "src/model.py",
    "src/util/io.py",
    "configs/a.yaml",
    "gone.txt",
    ".gitignore",
    ".corralignore",
    "model_link.py",
    "dangling",
    "untracked_new.py",
}


def test_git_project_file_list(tmp_path: Path) -> None:
    root = make_project(tmp_path / "p")
    (root / "gone.txt").unlink()  # deleted but still in git's index
    units = filelist.build_units(root / "src")  # from a subdirectory: the whole repository
    assert len(units) == 1 and units[0].root == root and units[0].git
    assert set(units[0].paths) == EXPECTED - {"gone.txt"}
    assert units[0].dest == str(root)


def test_walk_outside_git_honours_gitignore_files_and_negation(tmp_path: Path) -> None:
    root = tmp_path / "plain"
    for rel in ("a.py", "sub/b.py", "sub/b.dat", "sub/keep.dat", "runs/x", "deep/sub/c.dat"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    (root / "sub" / ".gitignore").write_text("*.dat\n!keep.dat\n")
    (root / ".corralignore").write_text("deep/\n")
    units = filelist.build_units(root)
    assert not units[0].git
    assert set(units[0].paths) == {
        "a.py",
        "sub/b.py",
        "sub/keep.dat",
        "sub/.gitignore",
        ".corralignore",
    }


def test_run_logs_in_a_subdirectory_are_not_synced(tmp_path: Path) -> None:
    # `corral run` started in data/ writes data/runs/<id>/...; a later sync
    # from the project root must not copy those logs to every node, but a
    # directory that merely happens to be called runs/ is the user's.
    root = tmp_path / "plain"
    for rel in ("a.py", "data/x.csv", "data/runs/20260101-000000-ab12/run.json",
                "data/runs/20260101-000000-ab12/node1/rank0.log", "exp/runs/tb/events.out"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    units = filelist.build_units(root)
    assert set(units[0].paths) == {"a.py", "data/x.csv", "exp/runs/tb/events.out"}


def test_named_paths_narrow_the_project_and_an_ignored_dir_is_walked(tmp_path: Path) -> None:
    root = make_project(tmp_path / "p")
    units = filelist.build_units(root, ("data", "app.log", "src/util"))
    assert [u.root for u in units] == [root]
    assert set(units[0].paths) == {"data/shard0.bin", "app.log", "src/util/io.py"}
    outside = tmp_path / "datasets" / "wiki"
    outside.mkdir(parents=True)
    (outside / "part0").write_text("w")
    (outside / "__pycache__").mkdir()
    (outside / "__pycache__" / "x.pyc").write_text("no")
    units = filelist.build_units(root, (str(outside),), to="/srv")
    assert (
        units[0].root == outside.parent
        and units[0].dest == "/srv"
        and units[0].paths == ("wiki/part0",)
    )
    with pytest.raises(Exception, match="absolute"):
        filelist.build_units(root, (), to="relative/dir")


def test_a_script_the_ignore_rules_leave_out_is_named(tmp_path: Path) -> None:
    # `corral run --sync scratch/x.py` must know the project's sync does not send x.py
    root = make_project(tmp_path / "p")
    (root / "data" / "prep.py").write_text("print('prep')\n")
    assert filelist.left_out(root, "scratch/x.py") == "scratch/x.py"  # .corralignore
    assert filelist.left_out(root / "data", "prep.py") == "data/prep.py"  # .gitignore, from a subdirectory
    assert filelist.left_out(root, "train.py") is None  # sent anyway
    assert filelist.left_out(root, "missing.py") is None
    assert filelist.left_out(root, "src") is None  # not a file
    outside = tmp_path / "elsewhere.py"
    outside.write_text("x")
    assert filelist.left_out(root, str(outside)) is None  # not in the project


def test_extra_files_that_ignore_rules_match_are_protected(tmp_path: Path) -> None:
    root = make_project(tmp_path / "p")
    unit = filelist.build_units(root)[0]
    extras = ["runs/new/rank0.log", "data/shard9.bin", "x.log", "stray.py", "src/__pycache__/a.pyc"]
    assert filelist.protected(unit, extras) == {
        "runs/new/rank0.log",
        "data/shard9.bin",
        "x.log",
        "src/__pycache__/a.pyc",
    }


# ---------------------------------------------------------------------------
# manifests, tree hash, stat cache, node-side calls run here


def test_manifest_describes_links_by_target_and_mode_matters(tmp_path: Path) -> None:
    root = make_project(tmp_path / "p")
    paths = sorted(EXPECTED)
    m1 = nodetree.manifest(str(root), paths)
    assert m1["entries"]["model_link.py"][0] == "l"
    assert m1["entries"]["dangling"][3] == hashlib.sha256(b"/nonexistent/elsewhere").hexdigest()
    assert m1["entries"]["train.py"][1] == 0o755
    os.chmod(root / "train.py", 0o644)
    assert nodetree.manifest(str(root), paths)["hash"] != m1["hash"]


def test_stat_cache_is_used_and_never_hides_a_rewrite(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "t"
    root.mkdir()
    f = root / "w.bin"
    f.write_bytes(b"A" * 1000)
    first = nodetree.manifest(str(root), ["w.bin"])
    reads: list[str] = []
    real = nodetree.file_digest
    monkeypatch.setattr(nodetree, "file_digest", lambda p, stop=None: reads.append(p) or real(p, stop))
    assert nodetree.manifest(str(root), ["w.bin"])["hash"] == first["hash"] and reads == []
    st = f.stat()
    f.write_bytes(b"B" * 1000)  # same size, and the mtime put back: only ctime tells
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert nodetree.manifest(str(root), ["w.bin"])["hash"] != first["hash"] and len(reads) == 1


def test_status_and_delete_on_a_tree(tmp_path: Path) -> None:
    head = make_project(tmp_path / "head")
    node = tmp_path / "node"
    paths = sorted(EXPECTED)
    want = nodetree.manifest(str(head), paths)["entries"]
    subprocess.run(["cp", "-a", f"{head}/.", str(node)], check=True)
    (node / "src" / "model.py").write_text("x = 2\n")
    (node / "gone.txt").unlink()
    (node / "extra" / "deep").mkdir(parents=True)
    (node / "extra" / "deep" / "e.txt").write_text("e")
    (tmp_path / "outside.txt").write_text("must survive")
    os.symlink(str(tmp_path), node / "escape")
    [st] = nodetree.status([{"root": str(node), "paths": paths, "scope": [""]}], dry_run=True)
    assert nodetree.differ(want, st["entries"]) == {
        "src/model.py": "content",
        "gone.txt": "missing",
    }
    assert "extra/deep/e.txt" in st["extra"] and "escape" in st["extra"]
    assert nodetree.delete(str(node), ["extra/deep/e.txt", "escape/outside.txt"]) == 1
    assert not (node / "extra").exists() and (tmp_path / "outside.txt").exists()


def test_rsync_helpers() -> None:
    assert rsh_word("ControlPath=/x/%C") == "ControlPath=/x/%C"
    assert rsh_word("IdentityFile=/my keys/id") == "'IdentityFile=/my keys/id'"
    assert parse_progress(b"     32,768  12%   31.25MB/s    0:00:00 (xfr#1, to-chk=0/1)") == 32768
    assert parse_progress(b"sending incremental file list") is None


# ---------------------------------------------------------------------------
# the whole command, locally (no root): this machine to another directory


def test_a_login_shell_that_prints_is_named_not_blamed_on_the_disk() -> None:
    from corral.model import Host

    # What rsync 3.x prints when ~/.bashrc on the node echoes a banner
    # (reproduced on the sandbox, 2026-11-23).
    stderr = ("protocol version mismatch -- is your shell clean?\n"
              "(see the rsync manpage for an explanation)\n"
              "rsync error: protocol incompatibility (code 2) at compat.c(625) [sender=3.5.0]\n")
    err = failure(Host(name="gpu2"), 2, stderr)
    assert err.host == "gpu2" and "login shell there writes to stdout" in err.message
    assert "ssh gpu2 true" in err.hint and "~/.bashrc" in err.hint
    assert "config.fish" in err.hint and "~/.cshrc" in err.hint  # rsync cannot tell which shell it is
    assert "free space" not in err.hint
    full = failure(Host(name="gpu2"), 11, "rsync: write failed on \"/srv/x\": No space left on device (28)\n"
                                           "rsync error: error in file IO (code 11) at receiver.c(381)")
    assert full.message == 'gpu2: the disk is full: cannot write /srv/x (No space left on device)'
    assert "`df -h` there" in full.hint and full.kind == "nospace"
    ro = failure(Host(name="gpu2"), 23, 'rsync: [receiver] mkstemp "/srv/proj/.t.py.LItuTM" failed: '
                                         "Read-only file system (30)\n")
    assert "read-only file system there" in ro.hint and "dmesg" in ro.hint


@pytest.mark.parametrize("said", [
    # what rsync printed (corral's ssh runs with LogLevel=ERROR, so ssh says
    # nothing) when the sandbox's node was partitioned or stopped in the
    # middle of `corral sync` (2026-11-23)
    "rsync error: unexplained error (code 255) at io.c(949) [sender=3.5.0]\n",
    "rsync: [sender] write error: Broken pipe (32)\n"
    "rsync error: unexplained error (code 255) at io.c(949) [sender=3.5.0]\n",
])
def test_a_node_lost_in_the_middle_of_a_sync_is_named_as_lost(said: str) -> None:
    from corral.model import Host

    err = failure(Host(name="gpu2"), 255, said)
    assert err.kind == "lost" and "connection was lost in the middle of the copy" in err.message
    assert "`ssh gpu2 true`" in err.hint
    # ssh's own words still win when there are some.
    refused = failure(Host(name="gpu2"), 255, "ssh: connect to host 10.0.0.2 port 22: Connection refused\n"
                                                "rsync: connection unexpectedly closed (0 bytes received so far) [sender]\n"
                                                "rsync error: unexplained error (code 255) at io.c(232) [sender=3.5.0]\n")
    assert refused.kind == "refused"


def _tree(root: Path) -> dict[str, list]:
    """An independent description: relative path -> [kind, mode, sha256 or link target]
    (without the marker a first sync writes into its destination)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if rel == nodetree.MARKER:
                continue
            if p.is_symlink():
                out[rel] = ["l", os.readlink(p)]
            else:
                out[rel] = [
                    "f",
                    oct(p.stat().st_mode & 0o777),
                    hashlib.sha256(p.read_bytes()).hexdigest(),
                ]
    return out


def test_local_sync_to_another_directory(tmp_path: Path) -> None:
    root = make_project(tmp_path / "p")
    dest = tmp_path / "copy"
    res = subprocess.run(
        [*CORRAL, "sync", "--to", str(dest), "--json"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["ok"] and report["mode"] == "star"
    want = {k: v for k, v in _tree(root).items() if k in EXPECTED}
    assert _tree(dest) == want
    assert (dest / nodetree.MARKER).is_file()  # a new destination: marked for later --delete runs


def test_ctrl_c_while_hashing_a_large_file_ends_at_once(tmp_path: Path) -> None:
    # The head hashes its tree in a thread that asyncio cannot cancel, and
    # asyncio.run waits for it: Ctrl-C used to wait until a large file was
    # read to its end (minutes for a checkpoint).  A sparse 64 GiB file:
    # no disk used, reading it takes far longer than the test allows.
    proj = tmp_path / "proj"
    proj.mkdir()
    (proj / "train.py").write_text("print(1)\n")
    with open(proj / "big.bin", "wb") as f:
        f.truncate(64 << 30)
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.Popen([*CORRAL, "sync"], cwd=proj, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "HOME": str(home)})
    try:
        time.sleep(3)  # the file list is made, the hashing under way
        assert proc.poll() is None, proc.communicate()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    cache = home / ".cache" / "corral" / "sync"
    assert not [p.name for p in cache.glob("*.tmp")] if cache.is_dir() else True


# ---------------------------------------------------------------------------
# on the sandbox

_NODE_TREE = r"""
import hashlib, json, os, sys
root = sys.argv[1]
out = {}
for dirpath, dirs, files in os.walk(root):
    for name in files + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
        p = os.path.join(dirpath, name)
        rel = os.path.relpath(p, root)
        if rel == ".corral-sync":  # the destination's marker
            continue
        if os.path.islink(p):
            out[rel] = ["l", os.readlink(p)]
        else:
            digest = hashlib.sha256(open(p, "rb").read()).hexdigest()
            out[rel] = ["f", oct(os.stat(p).st_mode & 0o777), digest]
print(json.dumps(out))
"""


def node_tree(sb, node: str, root: Path) -> dict[str, list]:
    proc = sb.exec(node, [sys.executable, "-I", "-c", _NODE_TREE, str(root)], check=True)
    return json.loads(proc.stdout)


def corral_sync(root: Path, cluster: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CORRAL, "sync", "-c", str(cluster), *args],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Under /tmp: private to each sandbox node, so every node starts empty.
    return make_project(tmp_path_factory.mktemp("sync") / "proj", big=6 * MiB)


def _expected(root: Path, names: set[str]) -> dict[str, list]:
    return {k: v for k, v in _tree(root).items() if k in names}


@pytest.mark.sandbox
def test_sync_a_project_and_verify_every_node(sandbox, project: Path) -> None:
    res = corral_sync(project, sandbox.cluster_file, "--pipeline-min", "1M", "--json")
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["ok"] and len({n["hash"] for n in report["nodes"].values()}) == 1
    # The sandbox nodes cannot log in to each other: the star, and it says so.
    assert "cannot log in to each other" in res.stderr and report["mode"] == "star"
    assert any("cannot log in to each other" in n for n in report["notes"])
    want = _expected(project, EXPECTED | {"ckpt/big.bin"})
    for node in sandbox.nodes:
        assert node_tree(sandbox, node, project) == want, node


@pytest.mark.sandbox
def test_deletions_links_and_a_changed_large_file_with_delete(sandbox, project: Path) -> None:
    first, last = sandbox.nodes[0], sandbox.nodes[-1]
    for rel, text in (
        ("runs/r1/rank0.log", "node output"),
        ("data/local.bin", "node data"),
        ("stray.py", "old"),
    ):
        sandbox.exec(
            first,
            ["sh", "-c", f"mkdir -p $(dirname {project}/{rel}) && echo {text!r} > {project}/{rel}"],
            check=True,
        )
    (project / "gone.txt").unlink()
    with open(project / "ckpt" / "big.bin", "r+b") as fh:  # same size, a few bytes changed
        fh.seek(3 * MiB)
        fh.write(b"changed!")
    os.unlink(project / "model_link.py")
    os.symlink("src/util/io.py", project / "model_link.py")
    dry = corral_sync(project, sandbox.cluster_file, "--delete", "--dry-run", "-v")
    assert dry.returncode == 0, dry.stderr
    assert "would delete 1" in dry.stdout and f"- {project}/stray.py" in dry.stdout
    assert f"- {project}/gone.txt" in dry.stdout  # gone from the list, so extra on the nodes
    assert node_tree(sandbox, last, project)["gone.txt"]  # dry run: still there
    res = corral_sync(project, sandbox.cluster_file, "--delete", "--json")
    assert res.returncode == 0, res.stderr
    want = _expected(project, EXPECTED - {"gone.txt"} | {"ckpt/big.bin"})
    for node in sandbox.nodes:
        got = node_tree(sandbox, node, project)
        kept = {k: v for k, v in got.items() if k.startswith(("runs/", "data/"))}
        assert {k: v for k, v in got.items() if k not in kept} == want, node
        if node == first:  # ignored files on a node are outputs: never deleted
            assert set(kept) == {"runs/r1/rank0.log", "data/local.bin"}


@pytest.mark.sandbox
def test_dry_run_changes_nothing(sandbox, project: Path) -> None:
    (project / "configs" / "b.yaml").write_text("lr: 2\n")
    before = {n: node_tree(sandbox, n, project) for n in sandbox.nodes}
    res = corral_sync(project, sandbox.cluster_file, "--delete", "--dry-run")
    assert res.returncode == 0 and "would copy 1 file(s)" in res.stdout
    assert {n: node_tree(sandbox, n, project) for n in sandbox.nodes} == before
    assert corral_sync(project, sandbox.cluster_file).returncode == 0


@pytest.mark.sandbox
def test_a_node_that_differs_is_named(sandbox, project: Path) -> None:
    assert corral_sync(project, sandbox.cluster_file).returncode == 0  # in step first (also when run alone)
    victim = sandbox.nodes[2]
    sandbox.exec(victim, ["sh", "-c", f"echo tampered >> {project}/src/model.py"], check=True)
    res = corral_sync(project, sandbox.cluster_file, "--check")
    assert res.returncode == 3
    assert (
        f"{victim}: tree hash" in res.stderr and f"{project}/src/model.py (differs)" in res.stderr
    )
    for other in set(sandbox.nodes) - {victim}:
        assert f"{other}:" not in res.stderr
    fixed = corral_sync(project, sandbox.cluster_file)
    assert fixed.returncode == 0 and "verified" in fixed.stdout
    assert corral_sync(project, sandbox.cluster_file, "--check").returncode == 0


@pytest.mark.sandbox
def test_unchanged_tree_is_up_to_date(sandbox, project: Path) -> None:
    assert corral_sync(project, sandbox.cluster_file).returncode == 0  # in step first (also when run alone)
    res = corral_sync(project, sandbox.cluster_file, "--json")
    assert res.returncode == 0
    report = json.loads(res.stdout)
    assert report["mode"] == "up to date" and report["bytes_sent"] == 0


@pytest.mark.sandbox
def test_run_sync_syncs_before_launching(sandbox, project: Path) -> None:
    (project / "marker.txt").write_text("synced-by-run\n")
    res = subprocess.run(
        [
            *CORRAL,
            "run",
            "--sync",
            "-c",
            str(sandbox.cluster_file),
            "--launcher",
            "command",
            "cat",
            "marker.txt",
        ],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "sync: every node has tree" in res.stderr
    assert res.stdout.count("synced-by-run") == len(sandbox.nodes)


@pytest.mark.sandbox
def test_run_sync_sends_the_script_even_when_ignored(sandbox, project: Path) -> None:
    # data/ is in .gitignore: the project's sync leaves it out, but the script to run goes
    (project / "data" / "hello.py").write_text("import os\nprint('hello from', os.environ['RANK'])\n")
    res = subprocess.run(
        [*CORRAL, "run", "--sync", "-c", str(sandbox.cluster_file), "-n", "1", "data/hello.py"],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "sync: data/hello.py is left out of the project by its ignore rules" in res.stderr
    assert sorted(ln.split()[-1] for ln in res.stdout.splitlines() if "hello from" in ln) == \
        [str(r) for r in range(len(sandbox.nodes))]


@pytest.fixture(scope="module")
def mesh_sandbox(tmp_path_factory: pytest.TempPathFactory):
    """Three nodes that can log in to each other (after `corral ssh setup`)."""
    if not ROOT:
        pytest.skip("the sandbox needs root (network/PID/mount namespaces); CI runs as root")
    from corral.sandbox import Sandbox

    tag = f"y{os.getpid()}"
    sb = Sandbox(
        name=f"{tag}-sync", prefix=f"{tag}n", state_dir=tmp_path_factory.mktemp("meshsb") / "state"
    )
    try:
        sb.up(3, with_keys=True)
        res = subprocess.run(
            [*CORRAL, "ssh", "setup", "-c", str(sb.cluster_file), "--json"],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=REPO,
            check=False,
        )
        assert res.returncode == 0, res.stderr
        yield sb
    finally:
        sb.down()


@pytest.mark.sandbox
def test_large_files_stream_node_to_node(
    mesh_sandbox, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = make_project(tmp_path_factory.mktemp("chain") / "proj", big=12 * MiB)
    res = corral_sync(root, mesh_sandbox.cluster_file, "--pipeline-min", "4M", "--json")
    assert res.returncode == 0, res.stderr
    assert "stream node to node" in res.stderr and json.loads(res.stdout)["mode"] == "chain+star"
    want = _expected(root, EXPECTED | {"ckpt/big.bin"})
    for node in mesh_sandbox.nodes:
        assert node_tree(mesh_sandbox, node, root) == want, node


def test_the_project_goes_to_the_cluster_files_workdir() -> None:
    from corral.cli.sync import with_cluster_workdir
    from corral.errors import UsageError
    from corral.model import Cluster, Host
    from corral.sync import SyncOptions

    plain = Cluster(hosts=(Host(name="a"), Host(name="b")))
    assert with_cluster_workdir(plain, SyncOptions()).to is None  # same path as here
    shared = Cluster(hosts=(Host(name="a"), Host(name="b")), workdir="/srv/proj")
    assert with_cluster_workdir(shared, SyncOptions()).to == "/srv/proj"
    assert with_cluster_workdir(shared, SyncOptions(to="/elsewhere")).to == "/elsewhere"
    # Named parts of the project too: `corral sync data/` sent data/ to the
    # same path as here, and runs (in /srv/proj) read the stale copy.
    named = with_cluster_workdir(shared, SyncOptions(paths=("data",)))
    assert (named.to, named.project_to) == (None, "/srv/proj")
    mixed = Cluster(hosts=(Host(name="a"), Host(name="b", workdir="/srv/other")), workdir="/srv/proj")
    with pytest.raises(UsageError) as e:
        with_cluster_workdir(mixed, SyncOptions())
    assert "a: /srv/proj, b: /srv/other" in e.value.message and "--to" in (e.value.hint or "")


def test_a_destination_that_is_a_dangling_link_or_a_file_is_named(tmp_path: Path) -> None:
    # Seen on the sandbox: `corral sync --to /srv/proj` where /srv/proj on one
    # node was a link to a directory that no longer exists said only
    # "FileExistsError: [Errno 17] File exists: '/srv/proj'".
    link = tmp_path / "proj"
    link.symlink_to(tmp_path / "gone")
    with pytest.raises(nodetree.DestinationError) as e:
        nodetree.status([{"root": str(link), "paths": ["a.py"], "scope": None}])
    assert str(e.value).startswith(f"{link} is a symbolic link to {tmp_path / 'gone'}, which does not exist")
    assert e.value.kind == "destination"  # shown to the user as is, without the class name
    link.unlink()
    link.write_text("x")
    with pytest.raises(nodetree.DestinationError, match="exists and is not a directory"):
        nodetree.status([{"root": str(link), "paths": ["a.py"], "scope": None}])
    # A link to a directory that exists is followed, as before.
    (tmp_path / "real").mkdir()
    link.unlink()
    link.symlink_to(tmp_path / "real")
    [got] = nodetree.status([{"root": str(link), "paths": ["a.py"], "scope": None}])
    assert got["root"] == str(link)


def test_a_stat_cache_that_cannot_be_written_leaves_no_half_written_file(tmp_path: Path, monkeypatch) -> None:
    # A node whose home directory is full: the cache is skipped, and its
    # temporary file must not stay behind after every sync.
    monkeypatch.setenv("HOME", str(tmp_path))

    def full(obj, fh, **kw) -> None:
        fh.write('{"a": ')
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(nodetree.json, "dump", full)
    nodetree.save_cache(str(tmp_path / "proj"), {"a": [1, 2]})
    assert list((tmp_path / ".cache" / "corral" / "sync").iterdir()) == []


def test_a_destination_in_the_home_directory_is_each_nodes_own(tmp_path: Path) -> None:
    # `workdir = "~/proj"` (homes differ between nodes: /home/ubuntu, /root)
    # is accepted by the cluster file and `corral run`, but sync refused it
    # ("--to '~/proj': give an absolute path") and, on a node, rsync wrote to
    # a literal `~` (it gets the path through its protocol, not a shell).
    root = make_project(tmp_path / "p")
    res = subprocess.run([*CORRAL, "sync", "--to", "~/proj", "--json"], cwd=root,
                         capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == 0, res.stderr
    assert _tree(Path.home() / "proj") == {k: v for k, v in _tree(root).items() if k in EXPECTED}
    assert not (root / "~").exists() and not (tmp_path / "~").exists()


@pytest.mark.sandbox
def test_a_destination_in_the_home_directory_reaches_every_node(sandbox, tmp_path: Path) -> None:
    project = make_project(tmp_path / "proj")
    name = f"corral-test-home-{os.getpid()}"
    home = Path(sandbox.exec(sandbox.nodes[0], ["sh", "-c", "echo ~"], check=True).stdout.strip())
    try:
        res = corral_sync(project, sandbox.cluster_file, "--to", f"~/{name}", "--json")
        assert res.returncode == 0, res.stderr
        want = _expected(project, EXPECTED)
        for node in sandbox.nodes:
            assert node_tree(sandbox, node, home / name) == want, node
        # The sandbox's /root is one directory for every node, like a home on
        # NFS: four rsyncs into it raced ("symlink ... failed: File exists").
        # It is written once, from the first node, and verified from each.
        nodes = json.loads(res.stdout)["nodes"]
        first, *rest = sandbox.nodes
        assert nodes[first]["shared_with"] == {} and nodes[first]["copy"]
        for node in rest:
            assert nodes[node]["shared_with"] == {f"~/{name}": first}, node
            assert nodes[node]["copy"] == [] and nodes[node]["hash"] == nodes[first]["hash"]
        assert "is the same directory as on" in res.stderr
        assert not [n for n in os.listdir(home / name) if n.startswith(".corral-probe-")]
    finally:
        for node in sandbox.nodes:
            sandbox.exec(node, ["rm", "-rf", str(home / name)])


def test_node_private_destinations_are_each_written(sandbox, tmp_path: Path) -> None:
    project = make_project(tmp_path / "proj")
    res = corral_sync(project, sandbox.cluster_file, "--to", "/srv/private-each", "--json")
    assert res.returncode == 0, res.stderr
    nodes = json.loads(res.stdout)["nodes"]
    assert all(nodes[n]["copy"] and nodes[n]["shared_with"] == {} for n in sandbox.nodes)
    for node in sandbox.nodes:
        assert not sandbox.exec(node, ["sh", "-c", "ls -a /srv/private-each | grep corral-probe"]).stdout


def test_nodes_that_see_each_others_probe_share_a_directory(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    # node 0 probes first and sees nobody; node 1 sees node 0 in the same directory
    assert nodetree.share_probe([str(one), str(two)], "t0k", 0, 3) == [[], []]
    assert nodetree.share_probe([str(one)], "t0k", 1, 3) == [[0]]
    assert nodetree.share_probe([str(two / "missing")], "t0k", 2, 3) == [None]
    assert sorted(os.listdir(one)) == [".corral-probe-t0k-0", ".corral-probe-t0k-1"]
    assert (one / ".corral-probe-t0k-1").stat().st_mode & 0o777 == 0o600
    # never an extra file for --delete, never sent
    assert nodetree._walk_extra(str(one), [""], set()) == []
    nodetree.share_unprobe([str(one), str(two)], "t0k", 0)
    nodetree.share_unprobe([str(one)], "t0k", 1)
    assert os.listdir(one) == [] and os.listdir(two) == []


def test_a_probe_left_by_an_interrupted_sync_is_removed_an_hour_later(tmp_path: Path) -> None:
    old, recent = tmp_path / ".corral-probe-old-0", tmp_path / ".corral-probe-new-1"
    old.write_text("")
    recent.write_text("")
    os.utime(old, (time.time() - 7200,) * 2)
    nodetree.share_probe([str(tmp_path)], "now", 0, 1)
    assert sorted(os.listdir(tmp_path)) == [".corral-probe-new-1", ".corral-probe-now-0"]


def test_a_probe_is_never_written_through_a_link(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "dest").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "dest" / ".corral-probe-t-0")
    assert nodetree.share_probe([str(tmp_path / "dest")], "t", 0, 2) == [None]
    assert os.listdir(tmp_path / "elsewhere") == []


def test_shared_groups_join_what_nodes_saw_and_ignore_what_no_node_of_this_sync_could_be() -> None:
    from corral.sync.shared import _seen, share_groups

    # 1 saw 0, 3 saw 2, 4 saw 3: {0,1} {2,3,4}; 5 alone
    assert share_groups(6, [[], [0], [], [2], [3], []]) == [[0, 1], [2, 3, 4], [5]]
    # a node's answer is untrusted: indices out of range, booleans, strings, repeats
    answer = [[1, 1, -1, 7, True, "0", 2.0], None]
    assert _seen(answer, 0, 3) == [1]
    assert _seen(answer, 1, 3) == [] and _seen("junk", 0, 3) == [] and _seen([[0]], 5, 3) == []


def test_named_parts_of_the_project_go_to_its_destination_other_trees_keep_their_path(tmp_path: Path) -> None:
    root = make_project(tmp_path / "p")
    (tmp_path / "datasets").mkdir()
    (tmp_path / "datasets" / "a.bin").write_bytes(b"x")
    units = filelist.build_units(root, ("data", str(tmp_path / "datasets")), None, "/srv/proj")
    assert [(u.dest, u.paths) for u in units] == [
        ("/srv/proj", ("data/shard0.bin",)), (str(tmp_path), ("datasets/a.bin",))]
    assert filelist.build_units(root, ("data",), "/x", "/srv/proj")[0].dest == "/x"


# ---------------------------------------------------------------------------
# destinations: links, --delete's guard, permissions (issue 16)


def _corral_here(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CORRAL, "sync", *args], cwd=root, capture_output=True, text=True,
                          timeout=120, check=False)


def test_a_chain_hop_never_writes_through_a_linked_directory(tmp_path: Path) -> None:
    # Seen on nodes: /srv/proj2/bigdir -> /srv/victim, and the chain wrote
    # bigdir/big.bin into /srv/victim/big.bin (then reported "verified").
    (tmp_path / "victim").mkdir()
    (tmp_path / "victim" / "big.bin").write_bytes(b"victim's own")
    (tmp_path / "proj").mkdir()
    os.symlink(tmp_path / "victim", tmp_path / "proj" / "bigdir")
    data = os.urandom(3 * MiB)
    got = nodetree.receive(io.BytesIO(data), "n1", str(tmp_path / "proj"), "bigdir/big.bin", len(data),
                           hashlib.sha256(data).hexdigest(), 0o644, 0)
    assert not got["ok"] and got["kind"] == "dest-link"
    assert got["error"].startswith(f"{tmp_path / 'proj' / 'bigdir'} is a symbolic link to {tmp_path / 'victim'}")
    assert (tmp_path / "victim" / "big.bin").read_bytes() == b"victim's own"
    assert sorted(os.listdir(tmp_path / "victim")) == ["big.bin"]  # no partial file either


def test_delete_never_leaves_the_tree_by_a_path_that_only_looks_inside(tmp_path: Path) -> None:
    # `/x/proj-other` starts with `/x/proj`: a string prefix test let
    # ../proj-other/file be deleted from /x/proj.
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj-other").mkdir()
    (tmp_path / "proj-other" / "file").write_text("not ours")
    (tmp_path / "proj" / "mine").write_text("extra")
    assert nodetree.delete(str(tmp_path / "proj"), ["../proj-other/file", "mine"]) == 1
    assert (tmp_path / "proj-other" / "file").read_text() == "not ours"
    assert not (tmp_path / "proj" / "mine").exists()


@pytest.mark.parametrize("to", ["home", "tilde", "root"])
def test_delete_refuses_a_home_or_the_root_even_in_a_dry_run(tmp_path: Path, to: str) -> None:
    # `corral sync --to ~ --delete --dry-run` listed ~/.ssh and ~/.bashrc among
    # 180,000 files to delete.
    root = make_project(tmp_path / "p")
    home = Path.home()
    (home / ".ssh").mkdir(exist_ok=True)
    (home / ".ssh" / "id_ed25519").write_text("key")
    dest = {"home": str(home), "tilde": "~", "root": "/"}[to]
    res = _corral_here(root, "--to", dest, "--delete", "--dry-run")
    assert res.returncode != 0
    shown = "/" if to == "root" else str(home)
    why = "it is the root directory" if to == "root" else "it is a home directory"
    assert f"refusing --delete in {shown}: {why}" in res.stderr
    assert "--force-delete" in res.stderr and "id_ed25519" not in res.stdout
    assert (home / ".ssh" / "id_ed25519").exists()


def test_delete_refuses_a_directory_corral_did_not_sync_to_until_forced(tmp_path: Path) -> None:
    root = make_project(tmp_path / "p")
    dest = tmp_path / "checkout"
    dest.mkdir()
    (dest / "mine.txt").write_text("someone's work")
    res = _corral_here(root, "--to", str(dest), "--delete")
    assert res.returncode != 0 and f"refusing --delete in {dest}: it is not empty" in res.stderr
    assert "--force-delete" in res.stderr
    assert (dest / "mine.txt").exists() and not (dest / "train.py").exists()
    # The user confirms once: the extra file goes, and the directory is marked ...
    forced = _corral_here(root, "--to", str(dest), "--force-delete")
    assert forced.returncode == 0, forced.stderr
    assert not (dest / "mine.txt").exists() and (dest / nodetree.MARKER).is_file()
    # ... so a plain --delete works from then on (and keeps the marker).
    (dest / "stray.py").write_text("old")
    again = _corral_here(root, "--to", str(dest), "--delete")
    assert again.returncode == 0, again.stderr
    assert not (dest / "stray.py").exists() and (dest / nodetree.MARKER).is_file()
    # A new (or empty) destination is marked by its first sync.
    fresh = tmp_path / "fresh"
    assert _corral_here(root, "--to", str(fresh)).returncode == 0
    (fresh / "stray.py").write_text("old")
    assert _corral_here(root, "--to", str(fresh), "--delete").returncode == 0
    assert not (fresh / "stray.py").exists()


@pytest.mark.skipif(not ROOT, reason="drops root's right to write anywhere (setpriv)")
def test_a_destination_the_user_cannot_create_has_a_hint(tmp_path: Path) -> None:
    # `corral sync --to /srv/proj` where the login user cannot write /srv said
    # "cannot create /srv/proj: Permission denied" and nothing else.  Root
    # without CAP_DAC_OVERRIDE is refused like any user.
    root = make_project(tmp_path / "p")
    locked = tmp_path / "srv"
    locked.mkdir()
    os.chown(locked, 65534, 65534)
    res = subprocess.run(
        ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner", "--", *CORRAL, "sync",
         "--to", str(locked / "proj")],
        cwd=root, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode != 0
    assert f"cannot create {locked / 'proj'}: Permission denied" in res.stderr
    assert "hint:" in res.stderr and "--to ~/proj" in res.stderr and "Traceback" not in res.stderr


def _sh(sb, node: str, script: str) -> str:
    return sb.exec(node, ["sh", "-c", script], check=True).stdout


@pytest.mark.sandbox
@pytest.mark.parametrize("cluster", ["sandbox", "mesh_sandbox"])
def test_a_linked_directory_on_the_nodes_is_refused_for_rsync_and_the_chain(
    request: pytest.FixtureRequest, tmp_path: Path, cluster: str
) -> None:
    # With /srv/proj2/bigdir -> /srv/victim on the nodes, the chain wrote
    # bigdir/big.bin into /srv/victim on every node and said "verified"
    # (rsync replaced the link).  Both now refuse, naming node and link.
    sb = request.getfixturevalue(cluster)
    root = make_project(tmp_path / "proj")
    (root / "bigdir").mkdir()
    (root / "bigdir" / "big.bin").write_bytes(os.urandom(6 * MiB))
    for node in sb.nodes:
        _sh(sb, node, "mkdir -p /srv/victim /srv/proj2 && echo theirs > /srv/victim/big.bin && "
                      "ln -sfn /srv/victim /srv/proj2/bigdir")
    try:
        res = corral_sync(root, sb.cluster_file, "--to", "/srv/proj2", "--pipeline-min", "4M")
        assert res.returncode != 0
        assert "/srv/proj2/bigdir is a symbolic link to /srv/victim" in res.stderr
        assert "hint: remove the link" in res.stderr
        for node in sb.nodes:
            assert _sh(sb, node, "ls -A /srv/victim; cat /srv/victim/big.bin") == "big.bin\ntheirs\n", node
            assert _sh(sb, node, "readlink /srv/proj2/bigdir") == "/srv/victim\n", node
    finally:
        for node in sb.nodes:
            sb.exec(node, ["rm", "-rf", "/srv/proj2", "/srv/victim"])


@pytest.mark.sandbox
def test_delete_into_the_nodes_home_is_refused(sandbox, tmp_path: Path) -> None:
    # `workdir = "~"` in a cluster file made the home the default destination
    # of `corral sync --delete`.
    root = make_project(tmp_path / "proj")
    res = corral_sync(root, sandbox.cluster_file, "--to", "~", "--delete", "--dry-run")
    assert res.returncode != 0
    home = _sh(sandbox, sandbox.nodes[0], "echo ~").strip()
    assert f"refusing --delete in {home}: it is a home directory" in res.stderr
    assert "--force-delete" in res.stderr and "would delete" not in res.stdout


@pytest.mark.sandbox
@pytest.mark.parametrize("how", ["chain", "rsync"])
def test_a_full_disk_on_a_chain_hop_is_named_and_leaves_no_partial_file(
    mesh_sandbox, tmp_path: Path, how: str
) -> None:
    # A full disk on a node left `.big.bin.corral-NNN` (100 MB) behind, the
    # disk full, and an error that blamed a broken pipe (rsync's too: its
    # sender's last line is "write error: Broken pipe").
    sb = mesh_sandbox
    first, full, last = sb.nodes
    root = make_project(tmp_path / "proj", big=40 * MiB)
    for node in sb.nodes:
        _sh(sb, node, "mkdir -p /srv/full")
    _sh(sb, full, "mount -t tmpfs -o size=20m tmpfs /srv/full")
    try:
        res = corral_sync(root, sb.cluster_file, "--to", "/srv/full/proj", "--pipeline-min", "4M",
                          *(["--no-pipeline"] if how == "rsync" else []))
        assert res.returncode != 0
        assert f"{full}: the disk is full: cannot write /srv/full/proj/ckpt/big.bin" in res.stderr
        assert "df -h` there" in res.stderr and "Broken pipe" not in res.stderr
        assert _sh(sb, full, "find /srv/full -name '.big.bin*'") == ""
        # The full node (a hop passes the file on all the same) is the only one that failed.
        want = _expected(root, {"ckpt/big.bin"})
        for node in (first, last):
            assert {k: v for k, v in node_tree(sb, node, Path("/srv/full/proj")).items()
                    if k == "ckpt/big.bin"} == want, node
    finally:
        sb.exec(full, ["umount", "/srv/full"])
        for node in sb.nodes:
            sb.exec(node, ["rm", "-rf", "/srv/full"])


def _descendants(pid: int) -> dict[int, str]:
    """pid -> command name of every process below ``pid`` (from /proc)."""
    parents: dict[int, tuple[int, str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    head, rest = fh.read().rsplit(")", 1)
                parents[int(entry)] = (int(rest.split()[1]), head.split("(", 1)[1])
            except (OSError, ValueError, IndexError):
                continue
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        for child, (ppid, name) in parents.items():
            if ppid == p and child not in found:
                found[child] = name
                todo.append(child)
    return found


@pytest.mark.sandbox
@pytest.mark.parametrize(("how", "sig"), [("rsync", signal.SIGINT), ("rsync", signal.SIGTERM),
                                          ("chain", signal.SIGINT)])
def test_a_stopped_sync_leaves_nothing_running_and_nothing_written(
    request: pytest.FixtureRequest, tmp_path: Path, how: str, sig: int
) -> None:
    # Ctrl-C during an rsync of a large file: corral exited 130 at once, its
    # rsync and ssh went on (reparented to init) and replaced the file on
    # every node 30 s later.
    sb = request.getfixturevalue("sandbox" if how == "rsync" else "mesh_sandbox")
    root = make_project(tmp_path / "proj", big=24 * MiB)
    dest = f"/srv/stopped-{how}-{sig}"
    for node in sb.nodes:
        sb.slow(node, "16mbit")  # 24 MiB: about 12 s a link
    flags = ["--no-pipeline"] if how == "rsync" else ["--pipeline-min", "4M"]
    proc = subprocess.Popen([*CORRAL, "sync", "-c", str(sb.cluster_file), "--to", dest, *flags],
                            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen: dict[int, str] = {}

    def partial(node: str) -> str:
        return _sh(sb, node, f"find {dest} -name '.big.bin*' -o -name big.bin 2>/dev/null || true")

    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and not partial(sb.nodes[0]):
            seen.update(_descendants(proc.pid))
            time.sleep(0.2)
        assert partial(sb.nodes[0]), proc.communicate(timeout=60)  # under way
        time.sleep(1)
        seen.update(_descendants(proc.pid))
        assert {"rsync" if how == "rsync" else "ssh"} <= set(seen.values())
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        left = {p: n for p, n in seen.items() if pid_alive(p) and n in ("rsync", "ssh")}
        assert left == {}, f"still running after corral exited: {left}"
        # The nodes notice their input end: no copy goes on, no partial file stays.
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(partial(n) for n in sb.nodes):
            time.sleep(0.5)
        time.sleep(2)
        assert {n: partial(n) for n in sb.nodes} == {n: "" for n in sb.nodes}
    finally:
        for p, n in seen.items():
            if n in ("rsync", "ssh") and pid_alive(p):
                os.kill(p, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for node in sb.nodes:
            sb.slow(node, None)
            sb.exec(node, ["rm", "-rf", dest])


def test_a_destination_marker_is_never_sent(tmp_path: Path) -> None:
    # A cloned repository with `.corral-sync` (re-included by its
    # .corralignore) would mark any directory it is synced to as safe for --delete.
    root = make_project(tmp_path / "p")
    (root / nodetree.MARKER).write_text("planted")
    (root / "src" / nodetree.MARKER).write_text("planted")
    (root / ".corralignore").write_text("!.corral-sync\n")
    [unit] = filelist.build_units(root)
    assert not [p for p in unit.paths if p.endswith(nodetree.MARKER)]
    assert not [p for p in filelist.build_units(root, ("src",))[0].paths if p.endswith(nodetree.MARKER)]


def test_a_sharing_probe_is_never_sent(tmp_path: Path) -> None:
    # A source that is itself a node's destination (one NFS directory) holds
    # that node's probe while a sync runs.
    root = make_project(tmp_path / "p")
    (root / ".corral-probe-abc-3").write_text("")
    [unit] = filelist.build_units(root)
    assert unit.paths and not [p for p in unit.paths if ".corral-probe-" in p]


# ---------------------------------------------------------------------------
# what the head reads from the chain is believed for the chain's nodes only


def test_a_hop_cannot_report_for_a_node_outside_the_chain_or_garble_the_head() -> None:
    from corral.sync.pipeline import _record

    results: dict = {}
    _record(results, {"value": {"node": "../../x", "ok": True}}, {"n1", "n2"})
    _record(results, {"value": {"node": "n2", "ok": False, "error": "e" * 10_000}}, {"n1", "n2"})
    assert list(results) == ["n2"] and len(results["n2"].error) == 2000
