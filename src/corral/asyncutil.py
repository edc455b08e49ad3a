"""Running a coroutine so that Ctrl-C, SIGTERM and SIGHUP stop it cleanly.

``asyncio.run`` only turns SIGINT into a cancellation when Python's default
handler is installed; a command started in the background of a shell script
inherits SIGINT *ignored*, and SIGTERM (a scheduler, a timeout) is not
handled at all.  Both would leave remote commands running.  Here all three
cancel the main task, so its ``finally`` blocks tear down what it started.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")


def run_interruptible(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro``; raise KeyboardInterrupt after a signal cancelled it."""

    async def main() -> T:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        hit: list[int] = []

        def stop(sig: int) -> None:
            hit.append(sig)
            task.cancel()

        installed = []
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                loop.add_signal_handler(sig, stop, sig)
                installed.append(sig)
            except (ValueError, RuntimeError, NotImplementedError):
                pass
        try:
            return await coro
        except asyncio.CancelledError:
            if hit:
                raise KeyboardInterrupt from None
            raise
        finally:
            for sig in installed:
                loop.remove_signal_handler(sig)

    return asyncio.run(main())
