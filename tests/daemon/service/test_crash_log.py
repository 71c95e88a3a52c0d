"""The crash log's next file is allocated ahead by a thread, not by the checkpoint under the pool
lock (crash_log.py: SPARE_AT): a full log's checkpoint takes the spare, one not ready yet is
left for the next checkpoint, a spare that failed leaves the checkpoint to allocate its own,
and a stopped log leaves no file. Each log replays to the state its calls left."""

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import wait
from pathlib import Path

import pytest

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.service import crash_log as crash_log_module
from pagedkv.daemon.service.crash_log import SPARE_SUFFIX, CrashLog, log_path
from pagedkv.daemon.service.log_replay import open_log, replay_log
from pagedkv.daemon.service.operations import Allocate, Free
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.service_image import service_image

from hand_clock import HandClock

MAX_BYTES = 4000
MAIN = threading.main_thread().name


@pytest.fixture
def allocating_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The name of the thread of each file allocation the log makes from now on."""
    names: list[str] = []
    real = os.posix_fallocate

    def recorded(fd: int, offset: int, size: int) -> None:
        names.append(threading.current_thread().name)
        real(fd, offset, size)

    monkeypatch.setattr(crash_log_module.os, "posix_fallocate", recorded)
    yield names


def logged(tmp_path: Path) -> tuple[PoolService, str, CrashLog, Path]:
    service = PoolService(BlockPool(16, 2), None, pool_id="first", clock=HandClock())
    sid = service.open_session("a").session_id
    path = log_path(tmp_path, "first")
    return service, sid, open_log(service, path, MAX_BYTES), path


async def call_until(service: PoolService, sid: str, done: Callable[[], bool]) -> None:
    """Allocate and free a sequence, over and over, until `done()`."""
    for n in range(10_000):
        await service.allocate(sid, Allocate(1, 2, [n % 50, 1]))
        await service.free(sid, Free(1))
        if done():
            return
    raise AssertionError("the log never reached the state waited for")


async def replays_alike(service: PoolService, path: Path) -> None:
    again = PoolService(BlockPool(16, 2), None, pool_id="next", clock=HandClock())
    await replay_log(again, path, adopted_from=service.pool_id)
    again.check_invariants()
    assert service_image(again)["sessions"] == service_image(service)["sessions"]


async def test_a_full_logs_checkpoint_takes_the_file_a_thread_allocated(
        tmp_path: Path, allocating_threads: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Nor does it close the file it replaced there: its last descriptor frees its tmpfs."""
    service, sid, crash_log, path = logged(tmp_path)
    allocating_threads.clear()  # the first base's file: open_log's own
    await call_until(service, sid, lambda: crash_log.spare is not None)
    assert crash_log.size > 0.75 * MAX_BYTES
    spare = crash_log.spare
    assert spare is not None
    wait([spare])
    first = crash_log.fd
    closed = threading.Event()
    real_close = os.close

    def close(fd: int) -> None:
        if fd == first and threading.current_thread().name == "pagedkv-crash-log-close":
            closed.set()
        real_close(fd)

    monkeypatch.setattr(crash_log_module.os, "close", close)
    await call_until(service, sid, lambda: crash_log.fd != first)  # a checkpoint
    assert allocating_threads == ["pagedkv-crash-log-spare"]  # none under the lock
    assert closed.wait(timeout=30)
    assert not path.with_name(path.name + SPARE_SUFFIX).exists()  # renamed into the log
    assert path.stat().st_size == MAX_BYTES
    await replays_alike(service, path)


async def test_a_spare_not_ready_is_left_for_the_next_checkpoint(
        tmp_path: Path, allocating_threads: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real = crash_log_module.allocated

    def slow(path: Path, size: int) -> object:
        if threading.current_thread().name != MAIN:
            assert release.wait(timeout=30)
        return real(path, size)

    monkeypatch.setattr(crash_log_module, "allocated", slow)
    service, sid, crash_log, path = logged(tmp_path)
    allocating_threads.clear()
    await call_until(service, sid, lambda: crash_log.spare is not None)
    spare, first = crash_log.spare, crash_log.fd
    await call_until(service, sid, lambda: crash_log.fd != first)  # allocated its own
    assert allocating_threads == [MAIN] and crash_log.spare is spare
    release.set()
    assert spare is not None
    wait([spare])
    second = crash_log.fd
    await call_until(service, sid, lambda: crash_log.fd != second)  # took the spare
    assert allocating_threads == [MAIN, "pagedkv-crash-log-spare"]
    await replays_alike(service, path)


async def test_a_spare_that_failed_leaves_the_checkpoint_to_allocate(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = crash_log_module.allocated

    def full(path: Path, size: int) -> object:
        if threading.current_thread().name != MAIN:
            raise OSError(28, "No space left on device")
        return real(path, size)

    monkeypatch.setattr(crash_log_module, "allocated", full)
    service, sid, crash_log, path = logged(tmp_path)
    await call_until(service, sid, lambda: crash_log.spare is not None)
    first = crash_log.fd
    await call_until(service, sid, lambda: crash_log.fd != first)
    assert crash_log.fd >= 0  # still logging: the checkpoint allocated its file
    await replays_alike(service, path)


async def test_a_stopped_log_leaves_no_file(tmp_path: Path) -> None:
    service, sid, crash_log, _ = logged(tmp_path)
    await call_until(service, sid, lambda: crash_log.spare is not None)
    assert crash_log.spare is not None
    wait([crash_log.spare])
    crash_log.stop()
    assert list(tmp_path.iterdir()) == []
