"""The runner's pool keeper: the descriptor of the pool file it mapped, handed to the file's
owner only (SO_PEERCRED), over a 0600 SOCK_SEQPACKET socket beside the Runner socket."""

import asyncio
import os
import socket
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from pagedkv.daemon.memory.kv_memory import KVMemory, cleanup_stale_files
from pagedkv.model_runner.process.pool_keeper import PoolKeeper
from pagedkv.process.pool_keeper_socket import take_fd

from pagedkvd_process import short_tmp_dir

# A user the test's process may become to ask as someone else (root only).
NOBODY = 65534


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_tmp_dir() as path:
        yield path


@pytest.fixture
async def keeper(folder: Path) -> AsyncIterator[PoolKeeper]:
    keeper = PoolKeeper(folder / "pagedkv-runner.sock.pool")
    await keeper.start()
    try:
        yield keeper
    finally:
        await keeper.close()


def _arena(folder: Path) -> KVMemory:
    return KVMemory.create(2, 64, shm_dir=str(folder))


async def test_the_owner_gets_the_descriptor_of_the_file_last_mapped(
        keeper: PoolKeeper, folder: Path) -> None:
    assert stat.S_IMODE(keeper.path.stat().st_mode) == 0o600
    assert await asyncio.to_thread(take_fd, keeper.path) is None  # nothing mapped yet
    with _arena(folder) as first, _arena(folder) as second:
        keeper.keep(first.view(1, 1, 8, "float16", 2).handle(), "")
        keeper.keep(second.view(1, 1, 8, "float16", 2).handle(), "")  # the first one dropped
        handed = await asyncio.to_thread(take_fd, keeper.path)
        assert handed is not None and handed.memory_id == ""
        fd = handed.fd
        try:
            assert os.path.samestat(os.fstat(fd), os.stat(second.shm_path))
        finally:
            os.close(fd)


async def test_a_kept_file_of_a_dead_daemon_is_left_by_another_daemons_cleanup(
        keeper: PoolKeeper, folder: Path) -> None:
    """The daemon that mapped it stopped for a restart (its pid is dead); another daemon
    starting on the same folder before the next one takes the descriptor back must not remove
    the file the runner keeps: the next daemon's runners map it by its path."""
    with _arena(folder) as arena:
        keeper.keep(arena.view(1, 1, 8, "float16", 2).handle(), "")
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, check=True)
        left = Path(arena.shm_path).with_name(f"pagedkv-{int(dead.stdout)}-0123abcd.kv")
        os.link(arena.shm_path, left)  # the same file, under a dead daemon's name
        assert cleanup_stale_files(str(folder), "pagedkv") == []
        assert left.exists()
        await keeper.close()  # the keeper lets it go: stale again
        assert cleanup_stale_files(str(folder), "pagedkv") == [left]


@pytest.mark.skipif(os.getuid() != 0, reason="asking as another user needs root")
async def test_another_user_gets_nothing_even_through_an_open_socket(
        keeper: PoolKeeper, folder: Path) -> None:
    with _arena(folder) as arena:
        keeper.keep(arena.view(1, 1, 8, "float16", 2).handle(), "")
        folder.chmod(0o755)
        keeper.path.chmod(0o666)  # the mode is the second guard: the uid check is the first
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as asking:
            asking.settimeout(5)
            os.seteuid(NOBODY)  # the kernel records the connecting credentials (SO_PEERCRED)
            try:
                asking.connect(str(keeper.path))
            finally:
                os.seteuid(0)
            _, fds, _, _ = await asyncio.to_thread(socket.recv_fds, asking, 64, 1)
        assert fds == []


async def test_close_removes_the_socket(folder: Path) -> None:
    keeper = PoolKeeper(folder / "r.sock.pool")
    await keeper.start()
    await keeper.close()
    assert not keeper.path.exists()
