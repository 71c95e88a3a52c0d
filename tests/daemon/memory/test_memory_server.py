"""The daemon's memory socket, device-independent: a CPU pool file's descriptor stands for a
CUDA VMM allocation's. Runners are real forked processes with their own credentials: the runner
socket's users map the same bytes the daemon writes; another user gets nothing, even through a
socket opened to everyone (the check, not the mode, refuses it)."""

import asyncio
import mmap
import os
import stat
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from forked import run_forked

from pagedkv.daemon.memory.kv_memory import KVMemory
from pagedkv.daemon.memory.memory_server import MemoryServer
from pagedkv.memory.memory_socket import memory_socket_path, receive_memory_fd

from pagedkvd_process import short_tmp_dir

# Users and a group the test's process may become (root only).
NOBODY, RUNNERS_GID = 65534, 4242
MEMORY_ID = "5eed"
as_root = pytest.mark.skipif(os.getuid() != 0, reason="acting as another user needs root")


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_tmp_dir() as path:
        yield path


@pytest.fixture
def arena(folder: Path) -> Iterator[KVMemory]:
    with KVMemory.create(2, 64, shm_dir=str(folder)) as memory:
        memory.pages.view(-1)[:4] = 9  # what the daemon wrote, for the runner to read
        yield memory


async def _served(folder: Path, arena: KVMemory, mode: int,
                  group: int | None) -> AsyncIterator[MemoryServer]:
    runner_socket = folder / "runner.sock"
    runner_socket.touch()  # the runner socket's owner is the daemon's user (this one)
    server = MemoryServer(memory_socket_path(runner_socket), mode, group)
    fd = os.open(arena.shm_path, os.O_RDWR | os.O_CLOEXEC)
    await server.start(fd, MEMORY_ID)
    try:
        yield server
    finally:
        await server.close()
        os.close(fd)


@pytest.fixture
async def server(folder: Path, arena: KVMemory) -> AsyncIterator[MemoryServer]:
    async for served in _served(folder, arena, 0o600, None):
        yield served


def _runner(runner_socket: Path) -> str:
    """A runner's attach: receive the memory, map it, read the daemon's bytes, write its own."""
    fd = receive_memory_fd(runner_socket, MEMORY_ID)
    with mmap.mmap(fd, 128) as memory:
        seen = memory[:4]
        memory[4:8] = b"\x07" * 4
    os.close(fd)
    return seen.hex()


async def test_a_runner_maps_the_memory_the_daemon_serves(
        server: MemoryServer, folder: Path, arena: KVMemory) -> None:
    assert stat.S_IMODE(server.path.stat().st_mode) == 0o600
    assert stat.S_ISSOCK(server.path.stat().st_mode)
    answer = await _ask(folder)
    assert answer == "09090909"
    assert arena.pages.view(-1)[4:8].tolist() == [7, 7, 7, 7]  # the same bytes, both ways


async def _ask(folder: Path, uid: int | None = None, gid: int | None = None,
               groups: tuple[int, ...] = ()) -> str:
    """A forked runner's answer (`_runner`), as `uid`; the server answers on this loop
    meanwhile."""
    return await asyncio.to_thread(run_forked, lambda: _runner(folder / "runner.sock"),
                                   uid=uid, gid=gid, groups=groups)


@as_root
async def test_another_user_gets_nothing_even_through_an_open_socket(
        server: MemoryServer, folder: Path, arena: KVMemory) -> None:
    folder.chmod(0o755)
    server.path.chmod(0o666)  # the mode is the second guard: the credentials check the first
    answer = await _ask(folder, uid=NOBODY)
    assert answer.startswith("error: MemorySocketError") and "closed without a descriptor" in \
        answer, answer
    assert arena.pages.view(-1)[4:8].tolist() == [0, 0, 0, 0]


@as_root
async def test_the_runner_group_maps_it_another_group_does_not(
        folder: Path, arena: KVMemory) -> None:
    folder.chmod(0o755)
    async for server in _served(folder, arena, 0o660, RUNNERS_GID):
        assert stat.S_IMODE(server.path.stat().st_mode) == 0o660
        assert server.path.stat().st_gid == RUNNERS_GID
        assert await _ask(folder, uid=NOBODY, gid=NOBODY, groups=(RUNNERS_GID,)) == "09090909"
        assert await _ask(folder, uid=NOBODY, gid=RUNNERS_GID) == "09090909"
        server.path.chmod(0o666)
        refused = await _ask(folder, uid=NOBODY, gid=NOBODY, groups=(RUNNERS_GID + 1,))
        assert "closed without a descriptor" in refused, refused


async def test_close_removes_the_socket(server: MemoryServer) -> None:
    await server.close()
    assert not server.path.exists()
