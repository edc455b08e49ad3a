"""Can this machine host a sandbox?  Say exactly what is missing, before touching anything."""

from __future__ import annotations

import os
import shutil
import sys

from corral.errors import SandboxError

#: Capability bits (linux/capability.h) the sandbox needs, and why.
CAPABILITIES = {
    "CAP_NET_ADMIN": (12, "create network namespaces, bridges, veth pairs and tc shaping"),
    "CAP_SYS_ADMIN": (21, "create mount/PID/UTS namespaces and bind-mount node-private directories"),
}
#: Tool -> Debian package that provides it.
TOOLS = {
    "ip": "iproute2",
    "tc": "iproute2",
    "unshare": "util-linux",
    "nsenter": "util-linux",
    "setsid": "util-linux",
    "sshd": "openssh-server",
    "ssh-keygen": "openssh-client",
}
_SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")


def which(tool: str) -> str | None:
    """``shutil.which`` that also looks in the sbin directories (not on every user's PATH)."""
    found = shutil.which(tool)
    if found:
        return found
    for directory in _SBIN:
        path = os.path.join(directory, tool)
        if os.access(path, os.X_OK):
            return path
    return None


def effective_capabilities() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("CapEff:"):
                return int(line.split()[1], 16)
    return 0


def missing_capabilities(caps: int | None = None) -> list[str]:
    caps = effective_capabilities() if caps is None else caps
    return [name for name, (bit, _) in CAPABILITIES.items() if not caps & (1 << bit)]


def check_privileges() -> None:
    if not sys.platform.startswith("linux"):
        raise SandboxError(
            f"the sandbox needs Linux namespaces; this is {sys.platform}",
            hint="run it on a Linux machine or VM (any recent distribution)",
        )
    problems = []
    if os.geteuid() != 0:
        problems.append(f"it runs as uid {os.geteuid()}, not root (uid 0 edits /etc/hosts, "
                        "reads /etc/shadow for the nodes' accounts)")
    for name in missing_capabilities():
        problems.append(f"it lacks {name}, needed to {CAPABILITIES[name][1]}")
    if problems:
        raise SandboxError(
            "corral sandbox needs root privileges: " + "; ".join(problems),
            hint="run it as root: sudo $(command -v corral) sandbox ...  (in a container: "
            "--cap-add NET_ADMIN --cap-add SYS_ADMIN, or --privileged)",
        )


def check_tools() -> dict[str, str]:
    """Paths of every tool the sandbox runs; one error naming all that are missing."""
    return find_tools(TOOLS, "corral sandbox")


def find_tools(tools: dict[str, str], who: str) -> dict[str, str]:
    """Paths of ``tools`` (program -> Debian package); one error naming all
    that are missing and the packages that bring them."""
    found: dict[str, str] = {}
    missing: list[str] = []
    for tool in tools:
        path = which(tool)
        if path:
            found[tool] = path
        else:
            missing.append(tool)
    if missing:
        packages = sorted({tools[t] for t in missing})
        raise SandboxError(
            f"{who} needs {', '.join(missing)}, not found on PATH or in /usr/sbin",
            hint=f"make system-deps  (or: apt-get install {' '.join(packages)})",
        )
    return found


def check() -> dict[str, str]:
    """Privileges first (the more fundamental problem), then tools."""
    check_privileges()
    return check_tools()
