"""Every error corral raises on purpose, in one place.

Each error carries what the CLI needs to report it without a traceback: a
one-line message that names the file, line, host or flag at fault, an
optional ``hint`` (what to do about it), an exit code and a category.  The
CLI formats them in exactly one place (``corral.cli``); ``--debug`` shows the
traceback for the rest.

Categories follow who has to act:

- ``user``: the input was wrong (a flag, a hostfile line, a missing script);
- ``infrastructure``: a host, the network or SSH is not as it should be;
- ``workload``: the user's program failed; corral itself worked.
"""

from __future__ import annotations

# Exit codes.  2 matches click's usage errors; the workload's own exit code is
# passed through unchanged for workload failures.
EXIT_USAGE = 2
EXIT_INFRA = 3
EXIT_NOT_IMPLEMENTED = 4
EXIT_INTERRUPTED = 130


class CorralError(Exception):
    """Base class: a failure corral understands and can explain."""

    exit_code: int = EXIT_USAGE
    category: str = "user"

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint
        if exit_code is not None:
            self.exit_code = exit_code

    def __str__(self) -> str:  # pragma: no cover - trivial
        return self.message


class UsageError(CorralError):
    """A flag or argument that cannot work as given."""


class InventoryError(CorralError):
    """A cluster description (hostfile, corral.toml, -H, range) is malformed.

    ``path`` and ``line`` point at the offending input so the message can be
    ``hostfile:3: slots must be a positive integer, got 0``.
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        line: int | None = None,
        hint: str | None = None,
    ):
        self.path = path
        self.line = line
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message, hint=hint)


class HostError(CorralError):
    """A specific host cannot be used (unreachable, refused, wrong key...)."""

    exit_code = EXIT_INFRA
    category = "infrastructure"

    def __init__(self, host: str, message: str, *, hint: str | None = None, kind: str = "error"):
        self.host = host
        self.kind = kind
        super().__init__(f"{host}: {message}", hint=hint)


class PreflightError(CorralError):
    """One or more hosts failed the checks that run before anything starts.

    Holds every per-host problem, so the user fixes them all in one go
    instead of one per attempt.
    """

    exit_code = EXIT_INFRA
    category = "infrastructure"

    def __init__(self, problems: list[HostError], *, what: str = "preflight"):
        self.problems = problems
        hosts = len(dict.fromkeys(p.host for p in problems))  # a host may have several problems
        lines = [f"{what} failed on {hosts} host(s):"]
        # The same problem on many hosts is said once, for the folded host set
        # (`g[1-3]: train.py not found in /proj`), not once per host.
        groups: dict[tuple[str, str | None], list[str]] = {}
        for p in problems:
            prefix = f"{p.host}: "
            text = p.message[len(prefix):] if p.message.startswith(prefix) else p.message
            groups.setdefault((text, p.hint), []).append(p.host)
        from corral.hostrange import fold

        for (text, hint), hosts in groups.items():
            lines.append(f"  {fold(hosts) if len(hosts) > 1 else hosts[0]}: {text}")
            if hint:
                lines.append(f"    hint: {hint}")
        super().__init__("\n".join(lines))


class SandboxError(CorralError):
    """The simulated cluster cannot be built or used as asked."""

    exit_code = EXIT_INFRA
    category = "infrastructure"


class WorkloadFailed(CorralError):
    """The user's program exited non-zero; exit code is passed through."""

    category = "workload"

    def __init__(self, message: str, *, exit_code: int, hint: str | None = None):
        super().__init__(message, hint=hint, exit_code=exit_code)


class NotImplementedYet(CorralError):
    """A documented feature that this version does not have yet.

    corral says so plainly instead of pretending or silently falling back.
    """

    exit_code = EXIT_NOT_IMPLEMENTED


class ForeignConfigError(UsageError):
    """Another tool's configuration file (``.deepspeed_env``, an accelerate
    config, a DeepSpeed JSON config) that corral cannot take as it is.

    ``path``, ``line`` and ``key`` point at the offending setting:
    ``ds_config.json:12: zero_optimization.stage3_gather_16bit_weights_on_mode_save ...``.
    """

    def __init__(self, message: str, *, path: str, line: int | None = None, key: str | None = None,
                 hint: str | None = None):
        self.path = path
        self.line = line
        self.key = key
        where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message, hint=hint)
