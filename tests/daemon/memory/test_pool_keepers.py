"""The daemon's side of the fallback without an fd store: the pool file left at stop for the
runners that keep its descriptor, and taken back at the next start through the same
`PoolHandover` (layout check, `KVMemory.adopt`) as the fd store's. A real runner keeper
(model_runner/process/pool_keeper.py) answers."""

import asyncio
import json
import os
import stat
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from pagedkv.daemon.memory.kv_memory import KVMemory
from pagedkv.daemon.memory.memory_server import MemoryServer
from pagedkv.daemon.memory.pool_handover import PoolHandover, PoolLayout
from pagedkv.daemon.memory.pool_keepers import RECORD_NAME, leave_for_keepers, taken_back
from pagedkv.memory.memory_socket import memory_socket_path
from pagedkv.model_runner.process.pool_keeper import PoolKeeper

from pagedkvd_process import short_tmp_dir

LAYOUT = PoolLayout(2, 64, "float16", 1, 1, 8, 2)
OTHER_LAYOUT = PoolLayout(2, 64, "float16", 1, 1, 4, 4)


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_tmp_dir() as path:
        yield path


@pytest.fixture
async def keeper(folder: Path) -> AsyncIterator[PoolKeeper]:
    keeper = PoolKeeper(folder / "runner.sock.pool")
    await keeper.start()
    try:
        yield keeper
    finally:
        await keeper.close()


def _stopping_daemon(folder: Path, keeper: PoolKeeper) -> KVMemory:
    """A daemon's arena with known bytes, mapped by the keeper's runner, closed as at a stop
    that left it for the runner."""
    arena = KVMemory.create(LAYOUT.num_pages, LAYOUT.page_bytes, shm_dir=str(folder))
    arena.pages[1] = 7
    keeper.keep(arena.view(1, 1, 8, "float16", 2).handle(), "")
    assert leave_for_keepers(folder, arena, LAYOUT.fd_name(arena.pool_id),
                             ["unix://" + str(keeper.path.with_suffix(""))])
    arena.close()
    return arena


async def test_the_next_daemon_adopts_what_the_runner_hands_back(
        folder: Path, keeper: PoolKeeper) -> None:
    first = _stopping_daemon(folder, keeper)
    assert Path(first.shm_path).exists()  # left for the runner to hand back
    assert stat.S_IMODE((folder / RECORD_NAME).stat().st_mode) == 0o600
    passed = await asyncio.to_thread(taken_back, folder)
    assert not (folder / RECORD_NAME).exists()  # read once
    adopted = PoolHandover(passed).adopt(LAYOUT, str(folder), 0o600, None)
    assert adopted is not None and adopted.adopted_from == first.pool_id
    with adopted:
        assert (adopted.pages[1] == 7).all() and not adopted.pages[0].any()
    assert await asyncio.to_thread(taken_back, folder) == {}


async def test_another_layout_is_released_as_under_the_fd_store(
        folder: Path, keeper: PoolKeeper) -> None:
    first = _stopping_daemon(folder, keeper)
    passed = await asyncio.to_thread(taken_back, folder)
    assert PoolHandover(passed).adopt(OTHER_LAYOUT, str(folder), 0o600, None) is None
    assert not Path(first.shm_path).exists()


async def test_a_file_of_another_pool_is_refused(folder: Path, keeper: PoolKeeper) -> None:
    _stopping_daemon(folder, keeper)
    record = json.loads((folder / RECORD_NAME).read_text())
    record["fd_name"] = LAYOUT.fd_name("0123456789abcdef")  # a pool this runner never mapped
    (folder / RECORD_NAME).write_text(json.dumps(record))
    opened = len(os.listdir("/proc/self/fd"))
    assert await asyncio.to_thread(taken_back, folder) == {}
    assert len(os.listdir("/proc/self/fd")) == opened  # the handed descriptor closed


def test_no_listening_keeper_keeps_nothing(folder: Path) -> None:
    with KVMemory.create(2, 64, shm_dir=str(folder)) as arena:
        assert not leave_for_keepers(folder, arena, LAYOUT.fd_name(arena.pool_id),
                                     [f"unix://{folder}/gone.sock", "dns:///elsewhere:1"])
    assert not Path(arena.shm_path).exists() and not (folder / RECORD_NAME).exists()


def test_a_keeper_that_is_gone_or_a_malformed_record_starts_cold(folder: Path) -> None:
    (folder / RECORD_NAME).write_text(json.dumps(
        {"fd_name": LAYOUT.fd_name("00ff"), "keepers": [str(folder / "gone.sock.pool")]}))
    assert taken_back(folder) == {}
    (folder / RECORD_NAME).write_text('{"fd_name": 3}')
    assert taken_back(folder) == {}
    assert not (folder / RECORD_NAME).exists()


async def test_a_vmm_pools_descriptor_comes_back_named_by_its_pool_id(
        folder: Path, keeper: PoolKeeper) -> None:
    """CPU twin of a CUDA VMM pool (gpu: tests/daemon/memory/test_vmm_memory.py): the keeper
    takes the descriptor from the daemon's memory socket (a pool file's here) and hands it back
    naming the pool id, which the record must name."""
    runner_socket = folder / "runners.sock"
    runner_socket.touch()
    with KVMemory.create(LAYOUT.num_pages, LAYOUT.page_bytes, shm_dir=str(folder)) as arena:
        served = os.open(arena.shm_path, os.O_RDWR | os.O_CLOEXEC)
        server = MemoryServer(memory_socket_path(runner_socket), 0o600, None)
        await server.start(served, arena.pool_id)
        handle = replace(arena.view(1, 1, 8, "float16", 2).handle(), kind="cuda_vmm",
                         memory_id=arena.pool_id)
        try:
            await asyncio.to_thread(keeper.keep, handle, f"unix://{runner_socket}")
        finally:
            await server.close()
            os.close(served)
        targets = ["unix://" + str(keeper.path.with_suffix(""))]
        for recorded, taken in ((arena.pool_id, True), ("ffff0000", False)):
            assert leave_for_keepers(folder, arena, LAYOUT.fd_name(recorded), targets)
            passed = await asyncio.to_thread(taken_back, folder)
            assert bool(passed) is taken
            for fds in passed.values():
                assert os.path.samestat(os.fstat(fds[0]), os.stat(arena.shm_path))
                os.close(fds[0])
