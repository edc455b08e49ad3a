"""The ssh transport: argv for the system OpenSSH client, and failure naming.

Using the system client (not a Python SSH library) means the user's
``~/.ssh/config``, agent, ProxyJump, ports and keys just work.  The argv puts
the user's own options first (for ssh the first value of an option wins),
then corral's: BatchMode (never prompt in the middle of a launch),
ConnectTimeout, keepalives (a partitioned node is noticed in seconds, not
minutes) and connection multiplexing (ControlMaster), so the second
connection to a host costs a few milliseconds instead of a handshake.
Host key checking is never turned off.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from collections.abc import Iterator, Mapping
from pathlib import Path

from corral.agent.private import UnsafePlace, private_dir, runtime_dir
from corral.errors import CorralError, HostError
from corral.model import Cluster, Host

#: ssh's own exit code for connection/authentication errors.
SSH_ERROR = 255
#: Keep the master connection this long after the last session ends (seconds).
CONTROL_PERSIST_S = 60
#: The most of ssh's or a node's own words an error message quotes
#: (characters); the rest of a longer line is cut (``quote``).
MAX_QUOTE = 2000
#: Sun socket paths are limited to ~108 bytes; ssh appends a random suffix.
_MAX_CONTROL_DIR = 36  # + "/8hex/" + 40 hex (%C) + ssh's ".XXXXXXXXXXXXXXXX" < 108


def client_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment to start the ssh client with: ``environ`` without the locale.

    The system ssh_config of Debian, Ubuntu and Fedora says ``SendEnv LANG
    LC_*`` and their sshd ``AcceptEnv LANG LC_*``, so every ``LC_``
    variable of the head (and LANG) would reach the ranks, outside the
    documented environment.  ``-o SendEnv=-LC_*`` cannot undo it: ssh reads
    the config files after the command line, and they add the patterns back.
    ssh only sends what it has, so it is not given them.
    """
    source = os.environ if environ is None else environ
    return {k: v for k, v in source.items() if k != "LANG" and not k.startswith("LC_")}


def control_dir() -> Path:
    """Private directory for ControlMaster sockets: made 0700 or checked
    (ours, not a symbolic link, writable only by us; ``private_dir``), since
    the last resort is a predictable name in the shared temp dir."""
    for base, path in _control_dir_candidates():
        if len(str(path)) > _MAX_CONTROL_DIR:
            continue
        try:
            private_dir(str(path), str(base))
            return path
        except UnsafePlace as e:
            raise CorralError(f"no safe directory for ssh's connection sockets: {e}", hint=e.hint) from None
        except OSError:
            continue
    raise HostError("localhost", "no writable directory for ssh control sockets")


def _control_dir_candidates() -> Iterator[tuple[Path, Path]]:
    """(existing place, control directory in it), in the order they are tried."""
    runtime = runtime_dir()
    if runtime:
        yield Path(runtime), Path(runtime) / "corral" / "ssh"
    cache = Path.home() / ".cache"
    yield (cache if cache.is_dir() else Path.home()), cache / "corral" / "ssh"
    # The last resort only: tempfile imports shutil (bz2, lzma...) and
    # gettempdir() probes directories by writing files.
    import tempfile

    tmp = Path(tempfile.gettempdir())
    yield tmp, tmp / f"corral-{os.getuid()}" / "ssh"


#: Words every login shell reads as themselves: none of them expands these
#: characters, and no word starts with zsh's ``=cmd``, tcsh's ``=N`` or a
#: ``%`` job.
_PLAIN = re.compile(r"[A-Za-z0-9_@+:,./-][A-Za-z0-9_@%+=:,./-]*")


def shell_quote(word: str) -> str:
    """``word`` as the login shell on the node will read it back, whichever it is.

    sshd hands the command line to the user's login shell (``$SHELL -c
    LINE``): sh, bash, zsh, but also fish or tcsh.  ``shlex.quote`` is
    POSIX-only: fish reads ``\\`` and ``\'`` *inside* single quotes as escapes
    (``a\\\\b`` arrived as ``a\\b``) and csh expands ``!`` there.  Here a
    backslash, a single quote and ``!`` go between the quotes, each behind a
    backslash, which every one of these shells reads as the character itself.
    A newline cannot be passed to csh inside or outside quotes: callers that
    may carry one encode it (``corral.transport.fanout.remote_argv``).
    """
    if _PLAIN.fullmatch(word):
        return word
    return "'" + re.sub(r"[\\'!]", lambda m: "'\\" + m.group() + "'", word) + "'"


def command_line(remote: list[str]) -> str:
    """``remote`` (an argv) as one command line for the node's login shell."""
    return " ".join(shell_quote(w) for w in remote)


def _options(opts: tuple[str, ...]) -> list[str]:
    out: list[str] = []
    for opt in opts:
        out += ["-o", opt]
    return out


def hop_argv(host: Host, *, connect_timeout: float = 10, keepalive: bool = False) -> list[str]:
    """What a *node* runs to reach ``host`` (sync's chain, exec's relays): plain
    ssh with the node's own keys and config, by address (its known_hosts has
    every peer under its address after ``corral ssh setup``), no compression;
    ``keepalive``: notice a peer that goes away as this machine's ssh does."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(max(1, connect_timeout))}",
            "-o", "Compression=no", "-o", "LogLevel=ERROR"]
    if keepalive:
        argv += ["-o", "ServerAliveInterval=3", "-o", "ServerAliveCountMax=3"]
    argv += ["-T", "-x", "-a"]
    if host.port is not None:
        argv += ["-p", str(host.port)]
    if host.user is not None:
        argv += ["-l", host.user]
    return argv + [host.connect_address]


class SSHTransport:
    """Builds ``ssh`` argv for the hosts of one cluster."""

    name = "ssh"

    def __init__(
        self,
        cluster: Cluster,
        *,
        connect_timeout: float = 10.0,
        multiplex: bool = True,
        keepalive_s: int = 3,
    ):
        self.cluster = cluster
        self.connect_timeout = connect_timeout
        self.multiplex = multiplex
        self.keepalive_s = keepalive_s

    def base_argv(self, host: Host) -> list[str]:
        """``ssh [user options] [corral options] host``, without a command."""
        argv = ["ssh"]
        if self.cluster.ssh_config:
            argv += ["-F", os.path.expanduser(self.cluster.ssh_config)]
        if host.port is not None:
            argv += ["-p", str(host.port)]
        if host.user is not None:
            argv += ["-l", host.user]
        argv += _options(host.ssh_options) + _options(self.cluster.ssh_options)
        if host.address and host.address != host.name:
            # The cluster file's address wins over DNS; the name still selects
            # the user's ssh_config blocks.  (From `ssh -G` it is the same value.)
            argv += ["-o", f"HostName={host.address}"]
        argv += [
            "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={int(max(1, self.connect_timeout))}",
            "-o", f"ServerAliveInterval={self.keepalive_s}",
            "-o", "ServerAliveCountMax=3",
            "-o", "LogLevel=ERROR",
        ]
        if self.multiplex:
            # One master per (host, user, port) *and* set of ssh options: a
            # cluster file with another identity or known_hosts file must not
            # ride on a connection that was authenticated under different rules.
            digest = hashlib.sha1(repr((self.cluster.ssh_config, self.cluster.ssh_options,
                                        host.ssh_options)).encode()).hexdigest()[:8]
            cdir = control_dir() / digest
            private_dir(str(cdir))
            argv += [
                "-o", "ControlMaster=auto",
                "-o", f"ControlPath={cdir}/%C",
                "-o", f"ControlPersist={CONTROL_PERSIST_S}",
            ]
        argv += ["-T", "-x", "-a"]  # no tty, no X11, no agent forwarding
        argv.append(host.name)
        return argv

    def env(self) -> dict[str, str]:
        """The environment to spawn ``argv`` with (see ``client_env``)."""
        return client_env()

    def argv(self, host: Host, remote: list[str]) -> list[str]:
        # ssh joins its arguments with spaces and hands them to the remote
        # login shell, so quote each word exactly once here.
        return self.base_argv(host) + ["--", command_line(remote)]

    def failure(self, host: Host, returncode: int, stderr: str) -> HostError:
        err = classify_ssh_failure(host, returncode, stderr)
        if err.kind == "auth-refused" and "Permission denied" in stderr:
            locked = locked_keys(self.base_argv(host))
            if locked:
                keys = ", ".join(locked)
                return HostError(
                    host.name,
                    f"authentication refused: the key {keys} has a passphrase and no ssh-agent holds it "
                    "(corral's ssh runs in BatchMode: it never asks for one)",
                    hint=f"load it into an agent once: `eval \"$(ssh-agent)\"; ssh-add {locked[0]}`, then run "
                         "corral again from that shell (or give the cluster a key without a passphrase)",
                    kind="auth-refused")
        return err


def locked_keys(argv: list[str]) -> list[str]:
    """The identity files ``argv`` (an ssh command) would offer that have a
    passphrase and are not in the running ssh-agent: BatchMode skips them, and
    the server then says only "Permission denied"."""
    words = [w for w in argv[1:] if w not in ("-T", "-x", "-a")]
    try:
        out = subprocess.run(["ssh", "-G", *words], capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    files = [os.path.expanduser(line.split(None, 1)[1]) for line in out.splitlines()
             if line.startswith("identityfile ") and len(line.split(None, 1)) == 2]
    locked = [f for f in dict.fromkeys(files) if _has_passphrase(f)]
    if locked and os.environ.get("SSH_AUTH_SOCK"):
        held = _fingerprints(["ssh-add", "-l"])
        locked = [f for f in locked if not held & _fingerprints(["ssh-keygen", "-lf", f + ".pub"])
                  and (held == set() or os.path.exists(f + ".pub"))]
    return locked


def _has_passphrase(path: str) -> bool:
    """Whether a private key file is encrypted (OpenSSH or PEM format)."""
    import base64  # only on an authentication failure: not on every exec's start-up
    import struct

    try:
        with open(path, "rb") as f:
            text = f.read(1 << 16).decode("ascii", "replace")
    except OSError:
        return False
    if "ENCRYPTED" in text.split("\n\n", 1)[0]:  # PEM: Proc-Type: 4,ENCRYPTED / BEGIN ENCRYPTED
        return True
    m = re.search(r"-----BEGIN OPENSSH PRIVATE KEY-----(.*?)-----END", text, re.S)
    if not m:
        return False
    try:
        blob = base64.b64decode("".join(m.group(1).split()))
    except ValueError:
        return False
    magic = b"openssh-key-v1\0"
    if not blob.startswith(magic) or len(blob) < len(magic) + 4:
        return False
    (n,) = struct.unpack(">I", blob[len(magic):len(magic) + 4])
    return blob[len(magic) + 4:len(magic) + 4 + n] != b"none"


def _fingerprints(argv: list[str]) -> set[str]:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    return {line.split()[1] for line in out.splitlines() if len(line.split()) > 1}


_RULES: list[tuple[str, str, str, str]] = [
    # (regex on stderr, kind, message, hint)
    (
        r"REMOTE HOST IDENTIFICATION HAS CHANGED|Host key for .* has changed",
        "host-key-changed",
        "its host key has CHANGED since it was recorded in known_hosts",
        "if the host was reinstalled, verify the new key out of band, then "
        "`ssh-keygen -R {name}` and connect once; otherwise this may be an attack",
    ),
    (
        r"Host key verification failed|No \S+ host key is known for|host key is not known",
        "host-key-unknown",
        "its host key is not in known_hosts (BatchMode never asks)",
        "connect once with `ssh {name}` and accept the key after checking its "
        "fingerprint, or run `corral ssh setup`",
    ),
    (
        r"Permission denied",
        "auth-refused",
        "authentication refused (no accepted key)",
        "install your public key on it (`corral ssh setup`, or ssh-copy-id), or set "
        "`user`/`ssh_options = [\"IdentityFile=...\"]` in the cluster file",
    ),
    (
        r"Could not resolve hostname|Name or service not known|nodename nor servname",
        "unknown-host",
        "its name does not resolve",
        "check the spelling, /etc/hosts or DNS, or give `address` in corral.toml",
    ),
    (
        r"Connection refused",
        "refused",
        "connection refused (no sshd listening on that port)",
        "check that sshd runs there and the port is right (containers often use "
        "`port = 2222` in corral.toml or `Port` in ~/.ssh/config)",
    ),
    (
        r"timed out|Connection timed out|No route to host|Network is unreachable|Host is down",
        "unreachable",
        "unreachable (no answer from the network)",
        "check that the host is up and that this machine can reach it "
        "(VPN, firewall, bastion: ProxyJump in ~/.ssh/config)",
    ),
    (
        r"Too many authentication failures",
        "auth-refused",
        "too many authentication failures (ssh offered too many keys)",
        "add `ssh_options = [\"IdentitiesOnly=yes\", \"IdentityFile=...\"]` to the cluster file",
    ),
    (
        r"kex_exchange_identification|Connection closed by|Connection reset by",
        "refused",
        "the ssh server closed the connection during the handshake",
        "sshd may be overloaded (MaxStartups) or blocking this address; retry, "
        "or check its logs",
    ),
]


def quote(line: str) -> str:
    """A line of ssh's stderr or a node's output, as an error message quotes
    it: at most ``MAX_QUOTE`` characters, and says how much more there was
    (a node can print one endless line; the message must stay one line)."""
    if len(line) <= MAX_QUOTE:
        return line
    return f"{line[:MAX_QUOTE]}\u2026[{len(line) - MAX_QUOTE} more characters]"


def python_hint(host: Host) -> str:
    """What to do when ``host``'s interpreter is missing or older than the agent needs."""
    return (f"install Python 3.8+ on {host.name}, or point `python` for it in the cluster file "
            f"at one (now {host.python!r})")


#: A shell that ran the first line corral wrote on stdin (a payload's length)
#: as a command: bash, dash, zsh, fish and tcsh wordings.
SHELL_READ_INPUT = re.compile(r"\b\d{4,}: (?:command )?not found|(?:command not found|Unknown command): \d{4,}\b"
                              r"|\b\d{4,}: Command not found")


def shell_read_input(host: Host, said: str) -> HostError:
    """The login shell never ran corral's command but read corral's input
    (stdin) as commands: a start-up file replaced it with another shell."""
    return HostError(
        host.name,
        f"its login shell did not run corral's command: it read corral's input as commands ({quote(said.strip())!r}); "
        "a start-up file starts another shell in its place (`exec zsh` in ~/.bashrc, say)",
        hint=f"let that line run only for interactive logins (`case $- in *i*) exec zsh;; esac`), or change "
             f"the login shell with chsh; `ssh {host.name} echo ok` must print ok",
        kind="login-shell")


#: Where each login shell reads its start-up files, and how a line there is
#: kept to interactive logins.
_STARTUP = {
    "bash": ("~/.bashrc, ~/.profile or /etc/bash.bashrc", "under `case $- in *i*)`"),
    "zsh": ("~/.zshenv or /etc/zsh/zshenv", "under `[[ -o interactive ]] &&`, or in ~/.zshrc"),
    "fish": ("~/.config/fish/config.fish", "inside `if status is-interactive`"),
    "tcsh": ("~/.tcshrc, ~/.cshrc or /etc/csh.cshrc", "inside `if ($?prompt) then`"),
    "csh": ("~/.cshrc or /etc/csh.cshrc", "inside `if ($?prompt) then`"),
}


def quiet_login_hint(host: str, shell: str | None = None) -> str:
    """How to keep a login shell from writing to stdout when it runs a command
    (rsync and scp fail on that output); ``shell`` is its $SHELL when known."""
    name = os.path.basename(shell or "")
    files, how = _STARTUP.get(name, _STARTUP["bash"])
    others = "" if shell else (" (~/.config/fish/config.fish for fish, ~/.cshrc for tcsh: "
                               "inside `if status is-interactive` / `if ($?prompt) then`)")
    return (f"`ssh {host} true` must print nothing: move that output (an echo, a banner) in its "
            f"{files} {how}, so it is for interactive shells only{others}")


def classify_ssh_failure(host: Host, returncode: int, stderr: str) -> HostError:
    """Turn an ssh exit status and stderr into a named, hinted HostError."""
    text = stderr.strip()
    if returncode == SSH_ERROR or "ssh:" in text or "ssh_exchange" in text:
        for pattern, kind, message, hint in _RULES:
            if re.search(pattern, text):
                return HostError(host.name, message, hint=hint.format(name=host.name), kind=kind)
    ate = next((ln for ln in text.splitlines() if SHELL_READ_INPUT.search(ln)), None)
    if ate is not None:
        return shell_read_input(host, ate)
    if returncode == 127 or re.search(r"(not found|No such file or directory)", text):
        return HostError(
            host.name,
            f"cannot run the interpreter {host.python!r} there",
            hint=python_hint(host),
            kind="no-python",
        )
    if not text and returncode == SSH_ERROR:
        # corral's ssh runs with LogLevel=ERROR: every failure to connect or
        # log in says something, while a connection that closes under a
        # running command ("closed by remote host", unanswered keep-alives)
        # is only an info message, left out.
        return HostError(
            host.name,
            "ssh failed: exit code 255 without a message: the connection closed while the command ran",
            hint=f"the node went down or rebooted, its sshd was killed, or the network to it failed "
                 f"(or the command itself exited with 255): check that `ssh {host.name} true` works",
            kind="ssh-failed",
        )
    last = quote(text.splitlines()[-1]) if text else f"exit code {returncode}"
    return HostError(host.name, f"ssh failed: {last}", kind="ssh-failed")

