"""Give passwords to the system ssh without putting them where others can read them.

ssh reads a password from the terminal, or, with ``SSH_ASKPASS`` and
``SSH_ASKPASS_REQUIRE=force``, from the stdout of the program ``SSH_ASKPASS``
names, which it runs with the prompt as its argument.  corral's program is
a few lines of Python in a private directory (0700, made by ``mkdtemp``)
that asks the corral process for the password over a unix socket in that
same directory.  So the password is never:

- in a process's arguments or environment (``/proc/*/cmdline``,
  ``/proc/*/environ``): the environment carries only the socket's path and
  the host's name;
- on disk: the socket carries it from memory to the helper's stdout pipe;
- reachable by another user: the directory is 0700, and the server checks
  the peer's uid (``SO_PEERCRED``) before answering.

Only prompts that ask for a *password* are answered (never a key
passphrase or a yes/no question), each host at most ``max_answers`` times,
and the directory is removed when the broker closes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import struct
import sys
import tempfile
from pathlib import Path

from typing_extensions import Self

log = logging.getLogger(__name__)

SOCKET_ENV = "CORRAL_ASKPASS_SOCKET"
HOST_ENV = "CORRAL_ASKPASS_HOST"

# The helper ssh runs: stdlib, no site, reads nothing but its socket.
_HELPER = f"""\
import os, socket, sys
prompt = sys.argv[1] if len(sys.argv) > 1 else ""
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(os.environ["{SOCKET_ENV}"])
s.sendall((os.environ.get("{HOST_ENV}", "") + "\\0" + prompt + "\\n").encode())
data = b""
while True:
    chunk = s.recv(4096)
    if not chunk:
        break
    data += chunk
if not data.startswith(b"+"):
    sys.exit(1)
sys.stdout.write(data[1:].decode() + "\\n")
"""


def is_password_prompt(prompt: str) -> bool:
    """ssh's password prompts ("user@host's password:", PAM's "Password:"),
    not key passphrases or host-key questions."""
    low = prompt.lower()
    return "password" in low and "passphrase" not in low and "yes/no" not in low


class PasswordBroker:
    """Serves passwords to corral's askpass helper for the duration of a ``with``.

    ``passwords`` maps host names (what ``env_for`` puts in the helper's
    environment) to passwords; ``set`` changes one (after a retry prompt).
    """

    def __init__(self, passwords: dict[str, str] | None = None, *, max_answers: int = 3):
        self._passwords = dict(passwords or {})
        self._answers: dict[str, int] = {}
        self.max_answers = max_answers
        self._dir: Path | None = None
        self._server: asyncio.AbstractServer | None = None
        #: Prompts refused per host, for error messages ("asked for a passphrase").
        self.refused: dict[str, str] = {}
        #: Hosts that were given a password at least once.
        self.used: set[str] = set()

    def set(self, host: str, password: str) -> None:
        self._passwords[host] = password
        self._answers[host] = 0

    @property
    def socket_path(self) -> Path:
        assert self._dir is not None, "use `async with PasswordBroker(...)`"
        return self._dir / "s"

    @property
    def helper_path(self) -> Path:
        assert self._dir is not None, "use `async with PasswordBroker(...)`"
        return self._dir / "askpass"

    async def __aenter__(self) -> Self:
        self._dir = Path(tempfile.mkdtemp(prefix="corral-askpass-"))
        os.chmod(self._dir, 0o700)
        helper = self.helper_path
        fd = os.open(helper, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700)
        with os.fdopen(fd, "w") as fh:
            fh.write(f"#!{sys.executable} -IS\n{_HELPER}")
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.socket_path))
        os.chmod(self.socket_path, 0o600)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
        self._passwords.clear()

    def env_for(self, host: str, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment an ssh for ``host`` runs with: no password in it."""
        env = dict(os.environ if base is None else base)
        env.update(
            {
                "SSH_ASKPASS": str(self.helper_path),
                "SSH_ASKPASS_REQUIRE": "force",
                SOCKET_ENV: str(self.socket_path),
                HOST_ENV: host,
            }
        )
        env.setdefault("DISPLAY", ":0")  # OpenSSH < 8.4 ignores SSH_ASKPASS without it
        return env

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            sock = writer.get_extra_info("socket")
            if sock is not None and not _same_user(sock):
                log.warning("askpass: refused a connection from another user")
                return
            request = (await asyncio.wait_for(reader.readline(), 10)).decode(errors="replace")
            host, _, prompt = request.rstrip("\n").partition("\0")
            answer = self._answer(host, prompt)
            writer.write(b"-" if answer is None else b"+" + answer.encode())
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def _answer(self, host: str, prompt: str) -> str | None:
        if not is_password_prompt(prompt):
            self.refused[host] = prompt.strip()
            return None
        if host not in self._passwords:
            return None
        count = self._answers.get(host, 0)
        if count >= self.max_answers:
            return None
        self._answers[host] = count + 1
        self.used.add(host)
        return self._passwords[host]


def _same_user(sock: socket.socket) -> bool:
    """True when the peer runs as our uid (Linux SO_PEERCRED; elsewhere the 0700 dir guards)."""
    opt = getattr(socket, "SO_PEERCRED", None)
    if opt is None:
        return True
    creds = sock.getsockopt(socket.SOL_SOCKET, opt, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid == os.getuid()
