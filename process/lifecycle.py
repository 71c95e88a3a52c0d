"""Process lifecycle helpers shared by the daemon and the runner: SIGTERM/SIGINT as an event,
cancelling background tasks on the way out, and the exit itself."""

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any, NoReturn


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


def exit_now(code: int) -> NoReturn:
    """End the process with `code`, its output flushed, without the interpreter's teardown.

    The `python -m` entry points (daemon, runner, `pagedkv`) end with this once their command
    returned, i.e. once everything they hold is closed (sockets, pool files, children): the
    teardown would then only free memory, and with torch, grpc and Triton loaded it spends 1 to
    3 s collecting garbage, which a SIGTERM-ed `pagedkv serve` waits for twice (its runner, then
    its daemon) and a restart waits for once."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed, or its reader gone
            stream.flush()
    os._exit(code)
