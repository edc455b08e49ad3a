"""DeepSpeed / OpenMPI / MPICH hostfiles and ``-H`` host lists.

These are the host lists users already have, so corral reads them as the
tools that defined them do, plus folded ranges everywhere a name goes::

    # hostfile                     -H / --hosts
    gpu01 slots=8                  gpu01:8,gpu02:8
    gpu[02-04] slots=8             gpu[01-04]:8
    admin@gpu05 slots=4 port=2222  admin@gpu05:4
    gpu06:4                        gpu06,gpu07      (slots: one per GPU)

Conventions, and where they come from:

- ``host slots=N``: DeepSpeed and OpenMPI; ``max_slots=M`` and OpenMPI's
  topology keys (``sockets``, ``cores``...) are accepted and ignored;
  ``username=`` and ``port=`` are OpenMPI's and are honoured.
- a host without ``slots`` (OpenMPI, pdsh machine lists): one process per
  GPU, detected on the node.
- ``host:N``: MPICH machinefiles and Horovod's ``-H``.
- ``user@host``: OpenMPI hostfiles, pdsh ``-w`` and ssh itself.
"""

from __future__ import annotations

import logging
from pathlib import Path

from corral.errors import InventoryError
from corral.hostrange import HostRangeError, split_list
from corral.inventory._common import (
    MAX_SLOTS,
    DuplicateCheck,
    check_user,
    did_you_mean,
    expand_names,
    make_host,
    port_number,
    positive_int,
    read_text,
)
from corral.model import Cluster, Host

log = logging.getLogger(__name__)

_SLOTS_KEYS = {"slots"}
_MAX_SLOTS_KEYS = {"max_slots", "max-slots", "slots_max", "slots-max"}
_USER_KEYS = {"username", "user-name", "user_name"}
_PORT_KEYS = {"port"}
# OpenMPI topology hints: meaningful to mpirun's mapper, not to corral.
_IGNORED_KEYS = {
    "boards", "sockets", "sockets_per_board", "sockets-per-board",
    "cores", "cores_per_socket", "cores-per-socket",
}
_KNOWN_KEYS = _SLOTS_KEYS | _MAX_SLOTS_KEYS | _USER_KEYS | _PORT_KEYS | _IGNORED_KEYS


def read_hostfile(path: Path, *, label: str | None = None) -> Cluster:
    """Read a hostfile into a Cluster (hosts in file order).

    ``label`` is how the path is shown in messages (default: as given).
    """
    label = label or str(path)
    hosts = parse_hostfile(read_text(path, label=label, what="hostfile"), label=label)
    return Cluster(hosts=tuple(hosts), source=f"hostfile {label}", path=str(path))


def parse_hostfile(text: str, *, label: str) -> list[Host]:
    """Parse hostfile text; every error names ``label:line``."""
    hosts: list[Host] = []
    seen = DuplicateCheck(label)
    for lineno, raw in enumerate(text.splitlines(), start=1):
        body = raw.split("#", 1)[0].strip()
        if not body:
            continue
        for host in _parse_line(body, label=label, line=lineno):
            seen.add(host.name, lineno)
            hosts.append(host)
    if not hosts:
        raise InventoryError(
            "hostfile lists no hosts",
            path=label,
            hint="write one host per line, e.g. 'gpu01 slots=8' "
            "(lines starting with # are comments)",
        )
    return hosts


def _parse_line(body: str, *, label: str, line: int) -> list[Host]:
    token, *pairs = body.split()
    user, token = _split_user(token, path=label, line=line)
    token, colon_slots = _split_colon_slots(token, path=label, line=line)
    keys = _parse_pairs(pairs, label=label, line=line)
    slots = colon_slots
    if "slots" in keys:
        if colon_slots is not None:
            raise InventoryError(
                "slots given twice (':N' and 'slots=')", path=label, line=line
            )
        slots = positive_int(keys["slots"], what="slots", path=label, line=line, most=MAX_SLOTS)
    max_slots = keys.get("max_slots")
    if max_slots is not None:
        most = positive_int(max_slots, what="max_slots", path=label, line=line)
        if slots is not None and most < slots:
            raise InventoryError(
                f"max_slots={most} is less than slots={slots}", path=label, line=line
            )
    if "username" in keys:
        if user is not None:
            raise InventoryError(
                "user given twice ('user@' and 'username=')", path=label, line=line
            )
        user = check_user(keys["username"], path=label, line=line)
    port = None
    if "port" in keys:
        port = port_number(
            positive_int(keys["port"], what="port", path=label, line=line),
            what="port", path=label, line=line,
        )
    return [
        make_host(name, user=user, slots=slots, port=port)
        for name in expand_names(token, path=label, line=line)
    ]


def _parse_pairs(pairs: list[str], *, label: str, line: int) -> dict[str, str]:
    """``slots=8 max-slots=16`` -> canonical key -> value text."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not value:
            raise InventoryError(
                f"unexpected {pair!r} after the host name",
                path=label,
                line=line,
                hint="a hostfile line is 'HOST [slots=N] [max_slots=N] [port=N] [username=U]'",
            )
        canon = _canonical(key)
        if canon is None:
            raise InventoryError(
                f"unknown hostfile key {key!r}",
                path=label,
                line=line,
                hint=did_you_mean(key, {"slots", "max_slots", "port", "username"}),
            )
        if canon in out:
            raise InventoryError(f"{key!r} given twice on one line", path=label, line=line)
        if canon in _IGNORED_KEYS:
            positive_int(value, what=key, path=label, line=line)
            log.debug("%s:%d: ignoring OpenMPI key %s", label, line, key)
        out[canon] = value
    return out


def _canonical(key: str) -> str | None:
    if key in _MAX_SLOTS_KEYS:
        return "max_slots"
    if key in _USER_KEYS:
        return "username"
    return key if key in _KNOWN_KEYS else None


def _split_user(token: str, *, path: str | None, line: int | None) -> tuple[str | None, str]:
    """``alice@gpu[1-2]`` -> (``alice``, ``gpu[1-2]``)."""
    if "@" not in token:
        return None, token
    user, _, rest = token.partition("@")
    if not user or not rest or "@" in rest:
        raise InventoryError(f"{token!r}: expected USER@HOST", path=path, line=line)
    return check_user(user, path=path, line=line), rest


def _split_colon_slots(token: str, *, path: str | None, line: int | None) -> tuple[str, int | None]:
    """``gpu1:8`` -> (``gpu1``, 8).  Names with several ':' are IPv6 literals."""
    if token.count(":") != 1:
        return token, None
    name, _, slots = token.partition(":")
    return name, positive_int(
        slots, what=f"slots after ':' in {token[:80]!r}", path=path, line=line, most=MAX_SLOTS
    )


# ---------------------------------------------------------------------------
# -H / --hosts


def parse_hosts_arg(text: str, *, flag: str = "--hosts") -> Cluster:
    """Parse ``-H gpu1:8,gpu2:8`` (Horovod-style) into a Cluster.

    Items are separated by commas outside brackets; each is
    ``[USER@]HOST[:SLOTS]`` where HOST may be a folded range.  Errors name
    the flag and the item, since there is no file or line to point at.
    """
    try:
        items = split_list(text)
    except HostRangeError as err:
        raise InventoryError(f"malformed host range: {err}", path=flag) from None
    hosts: list[Host] = []
    seen = DuplicateCheck(flag)
    for index, item in enumerate(items, start=1):
        item = item.strip()
        if not item:
            raise InventoryError(
                f"item {index} is empty (stray comma?) in {text!r}", path=flag,
                hint="write -H host1:8,host2:8 or -H 'gpu[01-04]:8'",
            )
        if len(item.split()) > 1:
            raise InventoryError(
                f"{item!r}: hosts are separated by commas, not spaces", path=flag,
                hint=f"write {flag} {','.join(item.split())}",
            )
        if item.count(":") > 1:
            raise InventoryError(
                f"{item!r}: IPv6 addresses cannot be given with {flag}",
                path=flag,
                hint="put the host in a hostfile or a corral.toml (address = \"...\")",
            )
        where = f"{flag} item {index}"
        user, rest = _split_user(item, path=where, line=None)
        rest, slots = _split_colon_slots(rest, path=where, line=None)
        for name in expand_names(rest, path=where, line=None):
            seen.add(name, None)
            hosts.append(make_host(name, user=user, slots=slots))
    shown = text if len(text) <= 60 else text[:57] + "..."
    return Cluster(hosts=tuple(hosts), source=f"{flag} {shown}")
