"""Process lifecycle helpers shared by the daemon and the runner: SIGTERM/SIGINT as an event,
and cancelling a background task on the way out."""

import asyncio
import contextlib
import signal
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def stop_on_signals() -> Iterator[asyncio.Event]:
    """An event set by SIGTERM or SIGINT, with the default handlers back on exit."""
    loop, stop = asyncio.get_running_loop(), asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        yield stop
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def cancel(task: "asyncio.Task[Any]") -> None:
    """Cancel a background task and wait until it is gone."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
