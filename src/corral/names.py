"""One grammar for every host name, address and user name corral passes on.

Names end up in places that have syntax of their own: an ``ssh`` argv (a
leading ``-`` is an option), ``~/.ssh/config`` (``Host *`` matches every
host; a newline starts a new directive such as ``ProxyCommand``),
``known_hosts`` (``*`` and ``,`` are patterns) and ``/etc/hosts``.  Names
come from the user's files but also from the nodes themselves (``ssh
setup`` writes what each node reports as its host name into every node's
files), so they are checked here, with ``fullmatch`` (``$`` accepts a
trailing newline), before they go anywhere.

A host name is RFC 1123 labels (letters, digits, ``-`` inside a label) plus
``_``, which ssh aliases and container names use; 63 characters a label, 253
in all.  An address is such a name or an IP address (IPv6 with an optional
``%zone`` of the same letters).  A user name is what ``useradd`` accepts
(and Samba's trailing ``$``), 64 characters at most.
"""

from __future__ import annotations

import ipaddress
import re

#: Longest host name (RFC 1035 / 1123: 253 characters written out).
MAX_HOST_NAME = 253
#: Longest user name accepted (useradd's limit is 32; LDAP directories go further).
MAX_USER_NAME = 64

_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_ZONE = re.compile(r"[A-Za-z0-9_.-]{1,32}")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\$?")

HOST_NAME_RULE = (
    "letters, digits, '-' and '_' in dot-separated labels, not starting or ending with '-', "
    f"at most {MAX_HOST_NAME} characters; or an IP address"
)
USER_NAME_RULE = (
    f"letters, digits, '.', '_' and '-', not starting with '-' or '.', at most {MAX_USER_NAME} "
    "characters"
)


def is_host_name(text: object) -> bool:
    """A DNS-style host name (``gpu01``, ``node-3.lab.example.com``, ``my_box``)."""
    return (
        isinstance(text, str)
        and 0 < len(text) <= MAX_HOST_NAME
        and _HOST_NAME.fullmatch(text) is not None
    )


def is_ip(text: object) -> bool:
    """An IPv4 or IPv6 address as ssh and /etc/hosts take it (``fe80::1%eth0`` too)."""
    if not isinstance(text, str) or not 0 < len(text) <= 64 or not text.isascii():
        return False
    address, _, zone = text.partition("%")
    if zone and (":" not in address or not _ZONE.fullmatch(zone)):
        return False
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def is_address(text: object) -> bool:
    """What may be dialled or written as a host: a host name or an IP address."""
    return is_host_name(text) or is_ip(text)


def is_user_name(text: object) -> bool:
    return (
        isinstance(text, str)
        and 0 < len(text) <= MAX_USER_NAME
        and _USER.fullmatch(text) is not None
    )
