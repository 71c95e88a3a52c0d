"""A private asyncio event loop on its own thread: the synchronous `LLM` runs the async engine
there, so it works from plain scripts and from callers that already run an event loop (a
notebook) alike.

The thread is a daemon thread: the interpreter does not wait for it at exit, so the `LLM`'s
exit hook (which runs after non-daemon threads are joined) can still use the loop to close the
engine.
"""

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An event loop running on a thread until close()."""

    def __init__(self, name: str) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result. If the wait is interrupted (Ctrl-C),
        the coroutine is cancelled."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    def close(self) -> None:
        """Cancel what still runs, stop the loop, join the thread. Idempotent."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(_cancel_others(), self._loop).result()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        self._loop.close()


async def _cancel_others() -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()
