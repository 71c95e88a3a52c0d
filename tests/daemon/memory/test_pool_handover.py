"""The pool memory outlives the daemon process: real `pagedkvd` processes under a supervisor
that emulates systemd's file descriptor store (tests/support/fd_store_supervisor.py)."""

import os
import signal
import stat
from pathlib import Path

import numpy as np
import pytest
import torch
from fd_store_supervisor import FdStoreSupervisor

from pagedkv.daemon.memory.kv_memory import KVMemory, held
from pagedkv.daemon.memory.pool_handover import PoolHandover, PoolLayout

from pagedkvd_process import short_tmp_dir

ARGS = ("--num-blocks", "8", "--block-size", "4")
# Bytes written into block 3 of the first daemon's pool.
KNOWN = np.arange(256, dtype=np.uint8)


def block(pool_file: Path, index: int, num_blocks: int) -> np.memmap:
    """Block `index` of the pool file's mapping, as a runner's view sees its bytes."""
    per_block = pool_file.stat().st_size // num_blocks
    return np.memmap(pool_file, dtype=np.uint8, mode="r+", offset=index * per_block,
                     shape=(per_block,))


def test_the_next_daemon_maps_the_same_memory_and_a_new_layout_starts_cold() -> None:
    with short_tmp_dir() as folder:
        supervisor = FdStoreSupervisor(folder)
        try:
            with supervisor.start(*ARGS) as first:
                (first_file,) = first.pool_files()
                (first_name,) = supervisor.names()
                assert first_name.startswith("pagedkv-pool.") and ".8x" in first_name
                written = block(first_file, 3, 8)
                written[:KNOWN.size] = KNOWN
                written.flush()
                assert supervisor.stop(first) == 0
            assert first_file.exists()  # left for the next daemon: its descriptor is stored

            with supervisor.start(*ARGS) as second:
                (second_file,) = second.pool_files()  # renamed as the new daemon's
                assert second_file != first_file
                assert stat.S_IMODE(second_file.stat().st_mode) == 0o600
                assert (block(second_file, 3, 8)[:KNOWN.size] == KNOWN).all()
                assert not block(second_file, 2, 8).any()
                assert '"event": "pool memory adopted"' in second.stderr()
                (second_name,) = supervisor.names()  # the old name removed, the new stored
                assert second_name != first_name and second_name.endswith(
                    first_name.split(".", 2)[2])
                assert supervisor.stop(second) == 0

            with supervisor.start("--num-blocks", "16", "--block-size", "4") as third:
                log = third.stderr()
                assert '"event": "stored pool memory released, starting cold"' in log
                assert "this daemon allocates 16x" in log
                assert not second_file.exists()
                (third_file,) = third.pool_files()
                assert not block(third_file, 3, 16).any()
                (third_name,) = supervisor.names()
                assert ".16x" in third_name
                assert supervisor.stop(third) == 0
        finally:
            supervisor.close()


def test_a_crashed_daemons_memory_is_adopted_not_removed_as_stale() -> None:
    with short_tmp_dir() as folder:
        supervisor = FdStoreSupervisor(folder)
        try:
            with supervisor.start(*ARGS) as first:
                (first_file,) = first.pool_files()
                block(first_file, 5, 8)[:KNOWN.size] = KNOWN
                assert supervisor.stop(first, signal.SIGKILL) == -signal.SIGKILL
            assert held(first_file)  # the store's descriptor: no other daemon removes it
            with supervisor.start(*ARGS) as second:
                (second_file,) = second.pool_files()
                assert (block(second_file, 5, 8)[:KNOWN.size] == KNOWN).all()
                assert supervisor.stop(second) == 0
        finally:
            supervisor.close()


def test_a_file_replaced_under_the_stored_name_is_released_not_adopted(tmp_path: Path) -> None:
    layout = PoolLayout(4, 64, "float16", 1, 1, 4, 4)
    arena = KVMemory.create(4, 64, shm_dir=str(tmp_path))
    arena.keep_file()
    arena.close()
    (path,) = tmp_path.glob("pagedkv-*.kv")
    fd = os.open(path, os.O_RDWR)
    path.unlink()
    path.write_bytes(bytes(256))  # another file now has the name
    handover = PoolHandover({layout.fd_name("00ff"): [fd]})
    assert handover.files() == [Path(f"{path} (deleted)")]
    assert handover.adopt(layout, str(tmp_path), 0o600, None) is None
    assert path.exists()  # not the stored file: left alone
    with pytest.raises(OSError):
        os.fstat(fd)  # released


def test_pool_layout_names_what_the_bytes_mean() -> None:
    layout = PoolLayout(64, 16384, "float16", 2, 2, 64, 16)
    assert layout.fd_name("ab12") == "pagedkv-pool.ab12.64x16384.float16.L2H2D64B16"
    assert PoolHandover({"other": [0], "pagedkv-pool.zz.x": [1]}).files() == []


def test_two_names_of_one_file_adopt_it_once_and_keep_it(tmp_path: Path) -> None:
    # What a crash between storing the adopted arena and removing its old name leaves.
    layout = PoolLayout(4, 64, "float16", 1, 1, 4, 4)
    arena = KVMemory.create(4, 64, shm_dir=str(tmp_path))
    arena.pages[2, :3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    arena.keep_file()
    arena.close()
    (path,) = tmp_path.glob("pagedkv-*.kv")
    fds = [os.open(path, os.O_RDWR) for _ in range(2)]
    handover = PoolHandover({layout.fd_name(arena.pool_id): [fds[0]],
                             layout.fd_name("00bb"): [fds[1]]})
    adopted = handover.adopt(layout, str(tmp_path), 0o600, None)
    assert adopted is not None and adopted.adopted_from == arena.pool_id
    assert Path(adopted.shm_path).exists()
    assert adopted.pages[2, :3].tolist() == [1, 2, 3]
    adopted.close()
