"""CUDA pools kept across a daemon restart: the arena is a VMM allocation (restore = auto),
served to runners over the memory socket and stored in the fd store for the next daemon, which
adopts it with its bytes. gpu-marked: never ran here (no device); each has a CPU twin:
tests/daemon/memory/test_memory_server.py (the socket, with a pool file's descriptor),
tests/daemon/memory/test_pool_handover.py (the store and the layout decision), and the first
test below."""

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from fd_store_supervisor import FdStoreSupervisor

from pagedkv.daemon.memory.kv_memory import KVMemory
from pagedkv.daemon.memory.memory_server import MemoryServer
from pagedkv.memory.memory_socket import memory_socket_path

from pagedkvd_process import short_tmp_dir

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# Two pages of 2 MiB: the VMM granularity on current GPUs, so nothing is rounded up.
NUM_PAGES, PAGE_BYTES = 2, 2 * 1024 * 1024
ARGS = ("--num-blocks", "8", "--block-size", "4", "--device", "cuda", "--restore", "auto")

# A runner's attach in a fresh process: the handle (argv[1], a PoolMemory in hex) through the
# daemon target argv[2]; it checks the daemon's bytes and writes its own.
_RUNNER = """
import sys
import torch
from pagedkv.memory import PoolMemoryHandle
from pagedkv.memory.attach import attach_pool
from pagedkv.proto import kvpool_pb2 as pb
handle = PoolMemoryHandle.from_proto(pb.PoolMemory.FromString(bytes.fromhex(sys.argv[1])))
pool = attach_pool(handle, sys.argv[2]).view(-1).view(torch.uint8)
assert pool[:4].tolist() == [9, 9, 9, 9], pool[:4].tolist()
pool[4:8] = 7
torch.cuda.synchronize()
"""


@pytest.fixture
def folder() -> Iterator[Path]:
    with short_tmp_dir() as path:
        yield path


def test_a_cpu_arena_is_its_file_whatever_vmm_says(folder: Path) -> None:
    with KVMemory.create(NUM_PAGES, 64, shm_dir=str(folder), vmm=True) as arena:
        handle = arena.view(1, 1, 8, "float16", 2).handle()
        assert (handle.kind, handle.memory_id, arena.memory_fd) == ("shm", "", -1)
        assert Path(arena.shm_path).is_file()


@pytest.mark.gpu
@cuda_only
def test_a_vmm_arena_outlives_its_daemon_on_its_descriptor() -> None:
    arena = KVMemory.create(NUM_PAGES, PAGE_BYTES, device="cuda", vmm=True)
    handle = arena.view(1, 2, 64, "float16", 16).handle()
    assert (handle.kind, handle.memory_id) == ("cuda_vmm", arena.pool_id)
    assert not arena.pages.any()  # zeroed: cuMemCreate's bytes are undefined
    arena.pages[1, :3] = 5
    torch.cuda.synchronize()
    stored = os.dup(arena.memory_fd)  # the fd store's copy
    arena.close()
    try:
        again = KVMemory.adopt_vmm(stored, NUM_PAGES, PAGE_BYTES, "cuda", arena.pool_id)
    finally:
        os.close(stored)
    assert again.adopted_from == arena.pool_id and again.pool_id != arena.pool_id
    assert again.pages[1, :4].tolist() == [5, 5, 5, 0]
    again.close()


@pytest.mark.gpu
@cuda_only
async def test_a_runner_process_maps_the_vmm_arena_through_the_memory_socket(
        folder: Path) -> None:
    runner_socket = folder / "runner.sock"
    runner_socket.touch()
    with KVMemory.create(NUM_PAGES, PAGE_BYTES, device="cuda", vmm=True) as arena:
        arena.pages.view(-1)[:4] = 9
        torch.cuda.synchronize()
        handle = arena.view(1, 2, 64, "float16", 16).handle()
        server = MemoryServer(memory_socket_path(runner_socket), 0o600, None)
        await server.start(arena.memory_fd, arena.pool_id)
        try:
            child = await _run(_RUNNER, handle.to_proto().SerializeToString().hex(),
                               f"unix://{runner_socket}")
        finally:
            await server.close()
        assert child.returncode == 0, child.stderr
        assert arena.pages.view(-1)[4:8].tolist() == [7, 7, 7, 7]


async def _run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`script` in a fresh interpreter while this loop serves the memory socket."""
    return await asyncio.to_thread(subprocess.run, [sys.executable, "-c", script, *args],
                                   capture_output=True, text=True, timeout=120)


@pytest.mark.gpu
@cuda_only
def test_the_next_daemon_adopts_the_stored_vmm_pool(folder: Path) -> None:
    supervisor = FdStoreSupervisor(folder)
    state = ("--state-dir", str(folder / "state"))
    with supervisor.start(*ARGS, *state) as first:
        (first_name,) = supervisor.names()  # the VMM descriptor, stored
        assert first_name.startswith("pagedkv-pool.")
        assert supervisor.stop(first) == 0
    with supervisor.start(*ARGS, *state) as second:
        assert '"event": "pool memory adopted"' in second.stderr()
        (second_name,) = supervisor.names()
        assert second_name != first_name
        assert supervisor.stop(second) == 0


@pytest.mark.gpu
@cuda_only
def test_without_restore_a_cuda_pool_is_not_stored(folder: Path) -> None:
    supervisor = FdStoreSupervisor(folder)
    with supervisor.start("--num-blocks", "8", "--block-size", "4", "--device", "cuda") as daemon:
        assert supervisor.names() == []
        assert supervisor.stop(daemon) == 0
