"""Process lifecycle helpers shared by the daemon and the runner: SIGTERM/SIGINT as an event,
and cancelling background tasks on the way out."""

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


async def cancel(*tasks: "asyncio.Task[Any]") -> None:
    """Cancel background tasks and wait until all are gone; an error one of them raised on the
    way out (anything but its cancellation) is raised here."""
    for task in tasks:
        task.cancel()
    for outcome in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(outcome, Exception):
            raise outcome
