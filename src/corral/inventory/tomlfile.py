"""``corral.toml``: a cluster file for what a hostfile cannot say.

Ports, users, interpreters, working directories, environment and ssh options
per host, in one reviewed file (see ``examples/corral.toml`` for every key).
Unknown keys are errors with a did-you-mean: a misspelt ``slot = 8`` that
silently meant "one process per GPU" would cost a whole job.

``tomllib`` reports no line numbers for keys, so ``_KeyLines`` scans the raw
text for ``key =`` lines under each table header; messages then read
``corral.toml:12: [[hosts]] #2: port must be an integer, got "22"``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from corral.errors import InventoryError
from corral.inventory._common import (
    MAX_SLOTS,
    DuplicateCheck,
    at_most,
    check_address,
    check_env_key,
    check_ssh_option,
    check_user,
    decode_text,
    did_you_mean,
    expand_names,
    make_host,
    port_number,
    read_bytes,
    read_text,
)
from corral.inventory.hostfile import parse_hostfile
from corral.model import DEFAULT_PYTHON, Cluster, Host, parse_gpus

if TYPE_CHECKING:
    from corral.inventory.trust import Risk

# key -> expected type, for [cluster] and each [[hosts]] entry.
CLUSTER_KEYS = {
    "name": str, "python": str, "workdir": str, "user": str, "port": int, "slots": int,
    "ssh_options": list, "ssh_config": str, "env": dict, "hostfile": str,
}
HOST_KEYS = {
    "name": str, "address": str, "port": int, "user": str, "slots": int, "labels": list,
    "python": str, "workdir": str, "ssh_options": list, "env": dict, "gpus": str, "spare": bool,
}
TOP_KEYS = {"cluster": dict, "hosts": list}
_TYPE_NAMES = {str: "a string", int: "an integer", list: "an array", dict: "a table", bool: "true or false"}


def read_corral_toml(path: Path, *, label: str | None = None, implicit: bool = False) -> Cluster:
    """Read and validate a corral.toml into a Cluster.

    ``implicit``: the file was found (./corral.toml), not named; lines that
    make this machine run commands then need the user's trust
    (``corral.inventory.trust``), checked against the very bytes read here.
    """
    label = label or str(path)
    data = read_bytes(path, label=label, what="cluster file")
    text = decode_text(data, label=label, what="cluster file")
    try:
        doc = tomllib.loads(text)
    except RecursionError:
        raise InventoryError(
            "invalid TOML: arrays or tables nested too deeply", path=label,
            hint="a cluster file needs two levels ([[hosts]] and env); "
            "check that this is the right file",
        ) from None
    except tomllib.TOMLDecodeError as err:
        match = re.search(r"at line (\d+), column (\d+)", str(err))
        message = re.sub(r"\s*\(at line \d+, column \d+\)", "", str(err))
        line = int(match.group(1)) if match else None
        col = f" (column {match.group(2)})" if match else ""
        raise InventoryError(f"invalid TOML: {message}{col}", path=label, line=line) from None
    reader = _TomlReader(doc, _KeyLines(text), label=label, base=path.parent)
    cluster = reader.cluster(path)
    if implicit:
        from corral.inventory.trust import require

        require(path, data, reader.risks(cluster, text), label=label)
    return cluster


def _line_with(raw: list[str], start: int | None, needle: str) -> int | None:
    """The first line from ``start`` on that holds ``needle`` (a multi-line array's item)."""
    if start is None:
        return None
    for lineno in range(start, min(len(raw), start + 200) + 1):
        if needle in raw[lineno - 1]:
            return lineno
    return start


class _KeyLines:
    """Line numbers of table headers and keys, found in the raw TOML text."""

    # Linear on any line: no two adjacent parts can match the same characters
    # (`\s*([^\]]+?)\s*` took minutes on "[" and 5,000 spaces).
    _HEADER = re.compile(r"[ \t]*(\[\[?)([^\]]*)\]\]?[ \t]*(?:#.*)?")
    _SEGMENT = r'(?:[A-Za-z0-9_-]+|"[^"]*"|\'[^\']*\')'
    _KEY = re.compile(rf"^\s*({_SEGMENT}(?:\s*\.\s*{_SEGMENT})*)\s*=")

    def __init__(self, text: str):
        self.keys: dict[tuple[Any, ...], int] = {}
        self.tables: dict[tuple[Any, ...], int] = {}
        arrays: dict[str, int] = {}
        table: tuple[Any, ...] = ()
        for lineno, raw in enumerate(text.splitlines(), start=1):
            header = self._HEADER.fullmatch(raw)
            if header and header.group(2).strip():
                parts = self._split(header.group(2).strip())
                if header.group(1) == "[[":
                    arrays[parts[0]] = arrays.get(parts[0], -1) + 1
                table = self._table_path(parts, arrays)
                self.tables.setdefault(table, lineno)
                continue
            key = self._KEY.match(raw)
            if key:
                parts = self._split(key.group(1))
                for depth in range(1, len(parts) + 1):
                    self.keys.setdefault(table + tuple(parts[:depth]), lineno)

    @staticmethod
    def _split(dotted: str) -> list[str]:
        return [p.strip().strip("\"'") for p in re.findall(r'"[^"]*"|\'[^\']*\'|[^.]+', dotted)]

    @staticmethod
    def _table_path(parts: list[str], arrays: dict[str, int]) -> tuple[Any, ...]:
        # [[hosts]] -> ("hosts", i); [hosts.env] -> ("hosts", i, "env")
        if parts[0] in arrays:
            return (parts[0], arrays[parts[0]], *parts[1:])
        return tuple(parts)

    def line(self, *path: Any) -> int | None:
        """Line of the key at ``path``, else of its nearest enclosing table."""
        for cut in range(len(path), 0, -1):
            found = self.keys.get(path[:cut]) or self.tables.get(path[:cut])
            if found:
                return found
        return None


class _TomlReader:
    """Validates one parsed document; every error carries file and line."""

    def __init__(self, doc: dict[str, Any], lines: _KeyLines, *, label: str, base: Path):
        self.doc = doc
        self.lines = lines
        self.label = label
        self.base = base
        #: host name -> index of the [[hosts]] table that defined it
        self.entry_of: dict[str, int] = {}

    def fail(self, message: str, *path: Any, hint: str | None = None) -> InventoryError:
        return InventoryError(message, path=self.label, line=self.lines.line(*path), hint=hint)

    def cluster(self, path: Path) -> Cluster:
        self.check_keys(self.doc, TOP_KEYS, "the top level", ())
        cfg = self.doc.get("cluster", {})
        self.check_keys(cfg, CLUSTER_KEYS, "[cluster]", ("cluster",))
        if "hostfile" in cfg and "hosts" in self.doc:
            raise self.fail(
                "[cluster] hostfile and [[hosts]] cannot both be given",
                "cluster", "hostfile",
                hint="list the hosts in one place: the hostfile or [[hosts]] tables",
            )
        if "hostfile" in cfg:
            hosts = self.hosts_from_hostfile(cfg)
        elif "hosts" in self.doc:
            hosts = self.hosts_from_tables(cfg)
        else:
            raise self.fail(
                "no hosts: add [[hosts]] tables or '[cluster] hostfile = \"...\"'",
                hint="see examples/corral.toml",
            )
        return Cluster(
            hosts=tuple(hosts),
            source=f"cluster file {self.label}",
            name=cfg.get("name"),
            env=self.env(cfg, ("cluster",)),
            workdir=self.workdir(cfg, ("cluster",)),
            ssh_options=self.ssh_options(cfg, ("cluster",)),
            ssh_config=self.ssh_config(cfg),
            path=str(path),
        )

    def check_keys(self, table: Any, schema: dict[str, type], where: str, at: tuple) -> None:
        if not isinstance(table, dict):
            raise self.fail(f"{where} must be a table", *at)
        for key, value in table.items():
            if key not in schema:
                raise self.fail(
                    f"unknown key {key!r} in {where}", *at, key, hint=did_you_mean(key, schema)
                )
            want = schema[key]
            if not isinstance(value, want) or (want is int and isinstance(value, bool)):
                raise self.fail(
                    f"{where} {key} must be {_TYPE_NAMES[want]}, got {value!r}", *at, key
                )
            if want is str and not value.strip():
                raise self.fail(f"{where} {key} must not be empty", *at, key)
            if want is int and key == "slots" and value <= 0:
                raise self.fail(f"{where} slots must be a positive integer, got {value}", *at, key)
            if want is int and key == "slots":
                at_most(value, MAX_SLOTS, what=f"{where} slots", path=self.label,
                        line=self.lines.line(*at, key))
            if want is int and key == "port":
                line = self.lines.line(*at, key)
                port_number(value, what=f"{where} port", path=self.label, line=line)
            if key == "user":
                check_user(value, path=self.label, line=self.lines.line(*at, key))

    def hosts_from_hostfile(self, cfg: dict[str, Any]) -> list[Host]:
        """``[cluster] hostfile``: the hostfile's hosts with [cluster] defaults."""
        file = self.base / Path(cfg["hostfile"]).expanduser()
        shown = cfg["hostfile"]
        try:
            text = read_text(file, label=shown, what="hostfile")
        except InventoryError as err:
            raise self.fail(
                f"[cluster] hostfile: {err.message} (looked at {file})", "cluster", "hostfile",
                hint="a relative hostfile path is relative to the cluster file",
            ) from None
        return [
            host.with_(
                user=host.user or cfg.get("user"),
                port=host.port or cfg.get("port"),
                slots=host.slots or cfg.get("slots"),
                python=cfg.get("python", host.python),
                local=host.local and not (cfg.get("user") or cfg.get("port")),
            )
            for host in parse_hostfile(text, label=str(file))
        ]

    def hosts_from_tables(self, cfg: dict[str, Any]) -> list[Host]:
        entries = self.doc["hosts"]
        hosts: list[Host] = []
        seen = DuplicateCheck(self.label)
        for index, entry in enumerate(entries):
            at = ("hosts", index)
            where = f"[[hosts]] #{index + 1}"
            self.check_keys(entry, HOST_KEYS, where, at)
            if "name" not in entry:
                raise self.fail(f"{where} has no name", *at, hint='add name = "gpu01" (or a range)')
            line = self.lines.line(*at, "name")
            names = expand_names(entry["name"], path=self.label, line=line)
            if "address" in entry and len(names) > 1:
                raise self.fail(
                    f"{where}: address is only valid for a single host, "
                    f"but name {entry['name']!r} expands to {len(names)}",
                    *at, "address",
                )
            for name in names:
                seen.add(name, line)
                self.entry_of[name] = index
                hosts.append(self.host(name, entry, cfg, at))
        if all(h.spare for h in hosts):
            raise self.fail("every host is a spare (spare = true): a run would have no node to start on",
                            "hosts", 0, "spare", hint="remove spare = true from the hosts a run starts on")
        return hosts

    def host(self, name: str, entry: dict[str, Any], cfg: dict[str, Any], at: tuple) -> Host:
        labels = entry.get("labels", [])
        for i, label in enumerate(labels):
            if not isinstance(label, str) or not label:
                raise self.fail(
                    f"labels[{i}] must be a non-empty string, got {label!r}", *at, "labels"
                )
        address = entry.get("address")
        if address is not None:
            line = self.lines.line(*at, "address")
            check_address(address, what="address", path=self.label, line=line)
        host = make_host(
            name,
            address=address,
            port=entry.get("port", cfg.get("port")),
            user=entry.get("user", cfg.get("user")),
            slots=entry.get("slots", cfg.get("slots")),
            labels=tuple(labels),
            python=entry.get("python", cfg.get("python")),
            env=self.env(entry, at),
            workdir=self.workdir(entry, at),
            ssh_options=self.ssh_options(entry, at),
        ).with_(gpus=self.gpus(entry, at))
        return host.with_(spare=True) if entry.get("spare") else host

    def gpus(self, entry: dict[str, Any], at: tuple) -> tuple[int, ...] | None:
        """``gpus = "0-3"``: the host's GPUs jobs run on (--gpus overrides it)."""
        if "gpus" not in entry:
            return None
        try:
            return parse_gpus(entry["gpus"])
        except ValueError as e:
            raise self.fail(f"gpus {entry['gpus']!r}: {e}", *at, "gpus",
                            hint='write GPU indices as nvidia-smi numbers them: gpus = "0-3" or "4,5"') from None

    def risks(self, cluster: Cluster, text: str) -> list[Risk]:
        """Lines that make this machine run something (see ``corral.inventory.trust``)."""
        from corral.inventory.trust import COMMAND_OPTIONS, Risk

        raw = text.splitlines()
        out: list[Risk] = []
        tables = [(("cluster",), self.doc.get("cluster", {}))]
        tables += [(("hosts", i), e) for i, e in enumerate(self.doc.get("hosts", []))]
        for at, table in tables:
            for option in table.get("ssh_options", []):
                key = option.partition("=")[0]
                if key.lower() in COMMAND_OPTIONS:
                    start = self.lines.line(*at, "ssh_options")
                    out.append(Risk(line=_line_with(raw, start, key),
                                    why=f"ssh runs {key} on this machine"))
        if "ssh_config" in self.doc.get("cluster", {}):
            out.append(Risk(line=self.lines.line("cluster", "ssh_config"),
                            why="an ssh config file can run commands here "
                            "(ProxyCommand, LocalCommand, Match exec)"))
        for host in cluster.hosts:
            if host.local and host.python != DEFAULT_PYTHON:
                index = self.entry_of.get(host.name)
                own = index is not None and "python" in self.doc["hosts"][index]
                at = ("hosts", index) if own else ("cluster",)
                out.append(Risk(line=self.lines.line(*at, "python"),
                                why=f"{host.name} is this machine: python runs here"))
        return list({(r.line, r.why): r for r in out}.values())

    def workdir(self, table: dict[str, Any], at: tuple) -> str | None:
        """A node directory: absolute (or ~), since a relative one would be
        taken from wherever the node's ssh login starts."""
        value = table.get("workdir")
        if value is not None and not value.startswith(("/", "~")):
            raise self.fail(f"workdir {value!r} is relative: on a node it would be taken from the ssh "
                            "login directory", *at, "workdir", hint=f"give an absolute path, e.g. \"/{value}\"")
        return value

    def env(self, table: dict[str, Any], at: tuple) -> dict[str, str]:
        out: dict[str, str] = {}
        for key, value in table.get("env", {}).items():
            line = self.lines.line(*at, "env", key)
            check_env_key(key, what="env", path=self.label, line=line)
            if isinstance(value, bool) or not isinstance(value, (str, int)):
                raise self.fail(
                    f"env {key} must be a string, got {value!r}", *at, "env", key,
                    hint=f'quote the value: {key} = "..."',
                )
            out[key] = str(value)
        return out

    def ssh_options(self, table: dict[str, Any], at: tuple) -> tuple[str, ...]:
        options = table.get("ssh_options", [])
        line = self.lines.line(*at, "ssh_options")
        for i, opt in enumerate(options):
            if not isinstance(opt, str):
                raise self.fail(
                    f"ssh_options[{i}] must be a string, got {opt!r}", *at, "ssh_options"
                )
            check_ssh_option(opt, what=f"ssh_options[{i}]", path=self.label, line=line)
        return tuple(options)

    def ssh_config(self, cfg: dict[str, Any]) -> str | None:
        if "ssh_config" not in cfg:
            return None
        file = (self.base / Path(cfg["ssh_config"]).expanduser()).resolve()
        if not file.is_file():
            raise self.fail(
                f"ssh_config file {cfg['ssh_config']!r} not found (looked at {file})",
                "cluster", "ssh_config",
                hint="relative paths are relative to the cluster file; ~ is your home",
            )
        return str(file)
