"""Which files ``corral sync`` sends: the project, as git and .corralignore see it.

In a git repository the list is ``git ls-files --cached --others
--exclude-standard``: tracked files plus new files git does not ignore
(.gitignore, .git/info/exclude, core.excludesFile: git's own rules, not an
imitation).  Outside one, a walk that honours ``.gitignore`` files with the
same syntax.  Either way ``.corralignore`` (gitignore syntax, at the project
root) and corral's defaults (``DEFAULT_EXCLUDES``) are applied on top; a
``!pattern`` in .corralignore re-includes a default.

A PATH given on the command line narrows the project to that file or
directory; a directory that git ignores (``data/``) is walked anyway, with
the defaults and .corralignore only: naming it is asking for it.  A PATH
outside the project is its own tree, rooted at its parent directory.
"""

from __future__ import annotations

import logging
import os
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from corral.errors import UsageError
from corral.sync.ignore import IgnoreRules, parse
from corral.sync.nodedest import MARKER, PROBE

log = logging.getLogger(__name__)

IGNORE_FILE = ".corralignore"
#: Never synced unless re-included with !pattern in .corralignore.
DEFAULT_EXCLUDES = (
    ".git/",
    ".hg/",
    ".svn/",
    "/runs/",  # corral run's logs (per-run, per-machine)
    ".venv/",
    "venv/",
    ".tox/",
    ".nox/",
    "node_modules/",
    "__pycache__/",
    "*.py[cod]",
    ".pytest_cache/",
    ".mypy_cache/",
    ".ruff_cache/",
    ".ipynb_checkpoints/",
    ".DS_Store",
    MARKER,  # a sync destination's marker: per machine, never sent (_without_markers)
)


@dataclass(frozen=True, kw_only=True)
class Unit:
    """One tree to send: files under ``root`` go to ``dest`` on every node."""

    root: Path
    dest: str
    paths: tuple[str, ...]
    #: Relative directories where ``--delete`` may remove extra files ('' = all of root).
    scope: tuple[str, ...]
    rules: IgnoreRules
    git: bool
    source: str


def project_root(cwd: Path) -> tuple[Path, bool]:
    """The git top level containing ``cwd`` (and True), else ``cwd`` itself."""
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=False,
            timeout=30,
        )
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return cwd, False
    if proc.returncode == 0 and proc.stdout.strip():
        return Path(proc.stdout.strip()), True
    return cwd, False


def base_rules(root: Path, base: str = "") -> IgnoreRules:
    """corral's defaults, then the .corralignore of ``root/base``."""
    rules = IgnoreRules(parse(DEFAULT_EXCLUDES, origin="corral default"))
    ignore_file = root / base / IGNORE_FILE
    if ignore_file.is_file():
        rules.extend(
            parse(
                ignore_file.read_text(errors="replace").splitlines(),
                base=base,
                origin=str(ignore_file),
            )
        )
    return rules


def git_files(root: Path, under: str = "") -> list[str]:
    argv = [
        "git",
        "-c",
        "core.quotepath=off",
        "ls-files",
        "-z",
        "--cached",
        "--others",
        "--exclude-standard",
    ]
    if under:
        argv += ["--", under]
    proc = subprocess.run(argv, cwd=root, capture_output=True, check=False, timeout=120)
    if proc.returncode != 0:
        raise UsageError(
            f"git ls-files failed in {root}: {proc.stderr.decode(errors='replace').strip()}",
            hint="run `git status` there to see what is wrong",
        )
    return sorted({p for p in proc.stdout.decode(errors="surrogateescape").split("\0") if p})


def git_ignored(root: Path, paths: list[str]) -> set[str]:
    """The subset of ``paths`` git ignores (``git check-ignore``), e.g. extra files on a node."""
    if not paths:
        return set()
    proc = subprocess.run(
        ["git", "check-ignore", "-z", "--no-index", "--stdin"],
        cwd=root,
        input="\0".join(paths).encode(),
        capture_output=True,
        check=False,
        timeout=120,
    )
    return {p for p in proc.stdout.decode(errors="surrogateescape").split("\0") if p}


def walk(root: Path, start: str, rules: IgnoreRules, *, gitignore: bool) -> list[str]:
    """Files and symlinks under ``root/start`` that ``rules`` keep (symlinked dirs not followed)."""
    out: list[str] = []
    top = root / start if start else root
    for dirpath, dirnames, filenames in os.walk(top):
        rel_dir = os.path.relpath(dirpath, root)
        rel_dir = "" if rel_dir == "." else rel_dir.replace(os.sep, "/")
        if gitignore and ".gitignore" in filenames:
            text = (Path(dirpath) / ".gitignore").read_text(errors="replace").splitlines()
            rules.extend(parse(text, base=rel_dir, origin=f"{rel_dir}/.gitignore"))
        keep_dirs = []
        for d in sorted(dirnames):
            rel = f"{rel_dir}/{d}" if rel_dir else d
            if os.path.islink(os.path.join(dirpath, d)):
                if not rules.decide(rel, False):
                    out.append(rel)
            elif not rules.decide(rel, True) and not _is_runs_dir(Path(dirpath, d)):
                keep_dirs.append(d)
        dirnames[:] = keep_dirs
        for f in filenames:
            rel = f"{rel_dir}/{f}" if rel_dir else f
            if not rules.decide(rel, False):
                out.append(rel)
    return sorted(out)


def _is_runs_dir(path: Path) -> bool:
    """corral's run logs (``runs/<run-id>/run.json``), wherever ``corral run``
    was started: per-run, per-machine, never code.  ``/runs/`` in the default
    excludes covers only the project root."""
    if path.name != "runs":
        return False
    try:
        return any((child / "run.json").is_file() for child in path.iterdir() if child.is_dir())
    except OSError:
        return False


def _filter(paths: list[str], root: Path, rules: IgnoreRules) -> list[str]:
    kept = []
    for p in paths:
        full = root / p
        if not os.path.lexists(full) or (full.is_dir() and not full.is_symlink()):
            continue  # deleted but still in the index, or a submodule
        if not rules.ignored(p, False):
            kept.append(p)
    return kept


def project_unit(cwd: Path, to: str | None) -> Unit:
    root, in_git = project_root(cwd)
    rules = base_rules(root)
    if in_git:
        paths = _filter(git_files(root), root, rules)
        source = f"git ls-files in {root}"
    else:
        paths = walk(root, "", rules, gitignore=True)
        source = f"files under {root}"
    return Unit(
        root=root,
        dest=to or str(root),
        paths=tuple(paths),
        scope=("",),
        rules=rules,
        git=in_git,
        source=source,
    )


def left_out(cwd: Path, name: str) -> str | None:
    """``name`` (a file here) relative to the project root when it lies in the
    project but the project's sync leaves it out (git, .corralignore or the
    defaults ignore it), else None: `corral run --sync scratch/train.py` with
    ``scratch/`` in .gitignore would otherwise not send the script it runs."""
    path = Path(os.path.abspath(cwd / name))
    if not path.is_file():
        return None
    root, _ = project_root(cwd)
    if root not in path.parents:
        return None
    rel = path.relative_to(root).as_posix()
    return None if rel in project_unit(cwd, None).paths else rel


def path_units(cwd: Path, names: tuple[str, ...], to: str | None,
               project_to: str | None = None) -> list[Unit]:
    """Units for explicit PATHs: parts of the project (under ``to``, else
    ``project_to``, else the same path), or trees of their own (under ``to``,
    else the same path)."""
    root, in_git = project_root(cwd)
    inside: list[Path] = []
    outside: list[Path] = []
    for name in names:
        path = Path(os.path.abspath(cwd / name))
        if not os.path.lexists(path):
            raise UsageError(
                f"{name}: no such file or directory", hint="sync paths that exist on this machine"
            )
        (inside if path == root or root in path.parents else outside).append(path)
    units = []
    if inside:
        rules = base_rules(root)
        paths: set[str] = set()
        scope: list[str] = []
        for path in inside:
            rel = path.relative_to(root).as_posix() if path != root else ""
            if path.is_dir() and not path.is_symlink():
                scope.append(rel)
                if in_git and not (rel and git_ignored(root, [rel])):
                    listed = git_files(root, rel)
                    paths.update(_filter(listed, root, rules))
                else:
                    paths.update(walk(root, rel, rules, gitignore=not in_git))
            else:
                paths.add(rel)  # a named file is sent even if ignored
        units.append(
            Unit(
                root=root,
                dest=to or project_to or str(root),
                paths=tuple(sorted(paths)),
                scope=tuple(scope),
                rules=rules,
                git=in_git,
                source=f"{len(inside)} path(s) of {root}",
            )
        )
    for path in outside:
        parent = path.parent
        name = path.name
        rules = base_rules(parent, name if path.is_dir() else "")
        if path.is_dir() and not path.is_symlink():
            paths_list = walk(parent, name, rules, gitignore=True)
            scope_t: tuple[str, ...] = (name,)
        else:
            paths_list, scope_t = [name], ()
        units.append(
            Unit(
                root=parent,
                dest=to or str(parent),
                paths=tuple(paths_list),
                scope=scope_t,
                rules=rules,
                git=False,
                source=str(path),
            )
        )
    return units


def build_units(cwd: Path, names: tuple[str, ...] = (), to: str | None = None,
                project_to: str | None = None) -> list[Unit]:
    """What to send, as units (one per root); ``to`` replaces each root's destination,
    ``project_to`` (without ``to``) the project's."""
    if to is not None and not to.startswith(("/", "~")):
        raise UsageError(
            f"--to {to!r}: give an absolute path on the nodes (or ~/DIR, in the home there)",
            hint="e.g. --to /srv/project",
        )
    units = path_units(cwd, names, to, project_to) if names else [project_unit(cwd, to or project_to)]
    return [_without_markers(u) for u in units]


def _without_markers(unit: Unit) -> Unit:
    """Never send a destination marker, even one a ``.corralignore`` re-includes
    or a name asks for: it would make a directory look synced to ``--delete``.
    Nor a sharing probe (a source that is itself some node's destination)."""
    paths = tuple(p for p in unit.paths
                  if (name := p.rsplit("/", 1)[-1]) != MARKER and not name.startswith(PROBE))
    return unit if len(paths) == len(unit.paths) else replace(unit, paths=paths)


def protected(unit: Unit, extras: list[str]) -> set[str]:
    """Extra node files that ignore rules protect from ``--delete`` (outputs, caches, venvs)."""
    kept = {p for p in extras if unit.rules.ignored(p, False)}
    if unit.git:
        kept |= git_ignored(unit.root, [p for p in extras if p not in kept])
    return kept
