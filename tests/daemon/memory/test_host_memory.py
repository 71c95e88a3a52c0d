"""The host tier's slots outlive their daemon: they are a shared file (never private memory),
and slots adopted from it hold the copies the previous daemon made, which restore into the pool
with the same bytes. Beside a CUDA pool the shared mapping is pinned (cudaHostRegister): the
gpu-marked twin runs the same steps on a device."""

import os
from pathlib import Path

import pytest
import torch

from pagedkv.daemon.memory.host_memory import HostMemory
from pagedkv.daemon.memory.kv_memory import KVMemory, KVPoolMemory
from pagedkv.vocab.geometry import ModelGeometry

GEOMETRY = ModelGeometry("test", num_layers=2, num_kv_heads=2, head_dim=4, num_params=None,
                         default_dtype="float32")
NUM_BLOCKS, BLOCK_SIZE, SLOTS = 6, 4, 3


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA device")])])
def test_adopted_slots_keep_the_copies_and_restore_the_same_bytes(tmp_path: Path,
                                                                  device: str) -> None:
    shm = str(tmp_path)
    with KVPoolMemory.create(GEOMETRY, NUM_BLOCKS, BLOCK_SIZE, "float32", device=device,
                             shm_dir=shm) as pool:
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(0)))
        original = pool.kv.cpu().clone()
        arena = KVMemory.create(SLOTS, pool.bytes_per_block, "cpu", shm, mode=0o600)
        host = HostMemory.over(arena, pool)
        assert host.slots.is_pinned() == (device == "cuda")  # registered, not copied
        host.to_host([4, 1, 5], [0, 1, 2])
        host.synchronize()
        path = Path(arena.shm_path)
        fd = os.open(path, os.O_RDWR)  # what the fd store keeps
        arena.keep_file()
        host.close()  # the daemon exits
        try:
            adopted = HostMemory.over(KVMemory.adopt(fd, SLOTS, pool.bytes_per_block, shm),
                                      pool)
        finally:
            os.close(fd)
        try:
            assert adopted.adopted_from == arena.pool_id != adopted.memory_id
            assert adopted.slots.is_pinned() == (device == "cuda")
            pool.kv.zero_()  # the next daemon's pool blocks hold something else
            adopted.from_host([2, 0, 1], [0, 2, 3])
            adopted.synchronize()
            restored = pool.kv.cpu()
            for block, source in ((0, 5), (2, 4), (3, 1)):
                assert torch.equal(restored[block], original[source])
        finally:
            adopted.close()
        assert not path.exists() and not list(tmp_path.glob("*.kv"))[1:]  # only the pool's


def test_slots_of_another_size_are_refused(tmp_path: Path) -> None:
    with KVPoolMemory.create(GEOMETRY, NUM_BLOCKS, BLOCK_SIZE, "float32",
                             shm_dir=str(tmp_path)) as pool:
        arena = KVMemory.create(SLOTS, pool.bytes_per_block * 2, "cpu", str(tmp_path))
        with pytest.raises(ValueError, match=f"CPU pages of {pool.bytes_per_block} bytes"):
            HostMemory.over(arena, pool)
        assert len(list(tmp_path.glob("*.kv"))) == 1  # the refused arena was closed
