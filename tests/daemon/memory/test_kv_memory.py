"""The daemon's pool memory: layout, block copies and zeroing, the arena's per-format views and
pages, cleanup.

Attaching from another process is in tests/memory/test_attach.py; sizing in
tests/vocab/test_pool_sizing.py.
"""

import errno
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pagedkv.daemon.memory import kv_memory
from pagedkv.daemon.memory.format_memory import FormatMemory
from pagedkv.daemon.memory.kv_memory import (
    KVMemory,
    KVPoolMemory,
    cleanup_stale_files,
)
from pagedkv.memory.attach import attach_pool
from pagedkv.memory.pool_files import held, hold
from pagedkv.vocab.geometry import ModelGeometry

# 3 layers, 2 KV heads, head_dim 4: small, yet every dim of the layout has a distinct size.
GEOMETRY = ModelGeometry("test", num_layers=3, num_kv_heads=2, head_dim=4, num_params=None,
                         default_dtype="float32")
NUM_BLOCKS, BLOCK_SIZE = 6, 5

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[KVPoolMemory]:
    """A float32 CPU pool whose every element holds a distinct value."""
    with KVPoolMemory.create(GEOMETRY, NUM_BLOCKS, BLOCK_SIZE, "float32",
                             shm_dir=str(tmp_path)) as memory:
        memory.kv.copy_(torch.arange(memory.kv.numel(), dtype=torch.float32).view_as(memory.kv))
        yield memory


def test_layout_shape_bytes_and_handle(tmp_path: Path) -> None:
    with KVPoolMemory.create(GEOMETRY, NUM_BLOCKS, BLOCK_SIZE, torch.float16,
                             shm_dir=str(tmp_path)) as memory:
        # [num_blocks, num_layers, K/V, block_size, num_kv_heads, head_dim]
        assert memory.kv.shape == (NUM_BLOCKS, 3, 2, BLOCK_SIZE, 2, 4)
        assert memory.kv.dtype == torch.float16
        assert (memory.num_blocks, memory.block_size) == (NUM_BLOCKS, BLOCK_SIZE)
        assert memory.nbytes == NUM_BLOCKS * GEOMETRY.bytes_per_block(BLOCK_SIZE, 2) == 2880
        handle = memory.handle()
        assert (handle.kind, handle.dtype, handle.device_index, handle.ipc_payload) == (
            "shm", "float16", -1, b"")
        assert handle.shape == tuple(memory.kv.shape)
        path = Path(handle.shm_path)
        assert path.parent == tmp_path
        assert path.name == f"pagedkv-{os.getpid()}-{memory.pool_id}.kv"
        assert path.stat().st_size == memory.nbytes
        assert not memory.kv.any(), "a new pool must be zeroed"


def test_copy_blocks_copies_every_layer_and_k_and_v(pool: KVPoolMemory) -> None:
    before = pool.kv.clone()
    pool.copy_blocks([(1, 3), (4, 0)])
    expected = before.clone()
    expected[3] = before[1]
    expected[0] = before[4]
    assert torch.equal(pool.kv, expected)
    # Spot-check one element far from the start: block 3, layer 2, V, slot 4, head 1, dim 3.
    assert pool.kv[3, 2, 1, 4, 1, 3] == before[1, 2, 1, 4, 1, 3]


def test_copy_chain_reads_sources_before_writing(pool: KVPoolMemory) -> None:
    # 0 -> 1 and 1 -> 2 at once: block 2 receives block 1's data from before the call.
    before = pool.kv.clone()
    pool.copy_blocks([0, 1], [1, 2])
    assert torch.equal(pool.kv[1], before[0])
    assert torch.equal(pool.kv[2], before[1])
    assert torch.equal(pool.kv[3:], before[3:])


def test_copy_forms_agree(tmp_path: Path) -> None:
    results = []
    for args in ([[(5, 2), (0, 1)]], [[5, 0], [2, 1]],
                 [np.array([5, 0], dtype=np.int64), np.array([2, 1], dtype=np.int64)]):
        with KVPoolMemory.create(GEOMETRY, NUM_BLOCKS, BLOCK_SIZE, "fp32",
                                 shm_dir=str(tmp_path)) as memory:
            seeded = torch.Generator().manual_seed(0)
            memory.kv.copy_(torch.randn(memory.kv.shape, generator=seeded))
            memory.copy_blocks(*args)
            results.append(memory.kv.clone())
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], results[2])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (([(0, 6)],), r"must be in \[0, 6\)"),
        (([-1], [2]), r"must be in \[0, 6\)"),
        (([0, 1], [2, 2]), "more than one copy"),
        (([0, 1], [2]), "2 sources but 1 destinations"),
        (([0, 1],), r"\(src, dst\) pairs"),
        (([0.5], [1]), "integer block ids"),
    ],
)
def test_bad_copies_change_nothing(pool: KVPoolMemory, args: tuple[Any, ...],
                                   message: str) -> None:
    before = pool.kv.clone()
    with pytest.raises(ValueError, match=message):
        pool.copy_blocks(*args)
    assert torch.equal(pool.kv, before)


def test_empty_copy_and_zero_are_no_ops(pool: KVPoolMemory) -> None:
    before = pool.kv.clone()
    pool.copy_blocks([])
    pool.copy_blocks([], [])
    pool.zero_blocks([])
    assert torch.equal(pool.kv, before)


def test_zero_blocks(pool: KVPoolMemory) -> None:
    before = pool.kv.clone()
    pool.zero_blocks([4, 1])
    assert not pool.kv[[1, 4]].any()
    assert torch.equal(pool.kv[[0, 2, 3, 5]], before[[0, 2, 3, 5]])
    with pytest.raises(ValueError, match="must be in"):
        pool.zero_blocks([0, 99])
    assert pool.kv[0].any(), "a rejected zero_blocks must not zero the valid ids"


def test_file_mode(tmp_path: Path) -> None:
    old_umask = os.umask(0o077)  # a strict umask must not strip the requested group bits
    try:
        with KVPoolMemory.create(GEOMETRY, 1, 1, "float32", shm_dir=str(tmp_path)) as private, \
                KVPoolMemory.create(GEOMETRY, 1, 1, "float32", shm_dir=str(tmp_path),
                                    mode=0o660) as grouped:
            assert stat.S_IMODE(os.stat(private.handle().shm_path).st_mode) == 0o600
            assert stat.S_IMODE(os.stat(grouped.handle().shm_path).st_mode) == 0o660
    finally:
        os.umask(old_umask)
    for mode in (0o666, 0o604):  # every user could read and write every tenant's K/V
        with pytest.raises(ValueError, match="gives every user access"):
            KVPoolMemory.create(GEOMETRY, 1, 1, "float32", shm_dir=str(tmp_path), mode=mode)
    assert list(tmp_path.iterdir()) == []


def test_close_unlinks_and_is_idempotent() -> None:
    memory = KVPoolMemory.create(GEOMETRY, 2, 4, "bf16")  # the real /dev/shm
    path = Path(memory.handle().shm_path)
    assert path.parent == Path("/dev/shm") and path.exists()
    memory.close()
    assert not path.exists()
    memory.close()
    with pytest.raises(ValueError, match="closed"):
        memory.copy_blocks([(0, 1)])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"num_blocks": 0}, "must be positive"), ({"device": "meta"}, "cpu or cuda"),
     ({"device": "gpu"}, "cpu or cuda"),
     ({"mode": 0o4600}, "permission bits"), ({"dtype": "int8"}, "unknown dtype")],
)
def test_bad_create_arguments(tmp_path: Path, kwargs: dict[str, Any], message: str) -> None:
    args: dict[str, Any] = {"num_blocks": 2, "block_size": 2, "dtype": "float32", **kwargs}
    with pytest.raises(ValueError, match=message):
        KVPoolMemory.create(GEOMETRY, shm_dir=str(tmp_path), **args)
    assert list(tmp_path.iterdir()) == []


def test_no_room_in_shm_dir_is_a_clear_error_and_leaves_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(kv_memory.os, "posix_fallocate", full)
    with pytest.raises(OSError, match=r"cannot reserve 2\.88 KB .* No space left"):
        KVPoolMemory.create(GEOMETRY, NUM_BLOCKS, BLOCK_SIZE, "float16", shm_dir=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
@cuda_only
def test_copy_and_zero_blocks_on_cuda_match_cpu(pool: KVPoolMemory) -> None:
    with KVPoolMemory.create(GEOMETRY, NUM_BLOCKS, BLOCK_SIZE, "float32",
                             device="cuda") as memory:
        memory.kv.copy_(pool.kv)
        for target in (pool, memory):
            target.copy_blocks([(0, 1), (1, 2), (5, 0)])
            target.zero_blocks([3])
        assert torch.equal(memory.kv.cpu(), pool.kv)


def test_cleanup_removes_dead_owners_files_only(tmp_path: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_file = tmp_path / f"pagedkv-{int(dead.stdout)}-0123abcd.kv"
    live_file = tmp_path / f"pagedkv-{os.getpid()}-4567ef01.kv"
    other_prefix = tmp_path / f"other-{int(dead.stdout)}-0123abcd.kv"
    not_a_pool = tmp_path / "pagedkv-notes.txt"
    for path in (dead_file, live_file, other_prefix, not_a_pool):
        path.write_bytes(b"x")
    assert cleanup_stale_files(str(tmp_path), "pagedkv") == [dead_file]
    assert sorted(tmp_path.iterdir()) == sorted([live_file, other_prefix, not_a_pool])


def test_cleanup_leaves_a_dead_owners_file_that_a_store_holds(tmp_path: Path) -> None:
    # A daemon that exited for a restart left its file in its descriptor store (the stored
    # descriptor locked by `hold`): another daemon starting on the same /dev/shm before the
    # next one adopts it must not remove it; once the store lets it go, it is stale.
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    kept = tmp_path / f"pagedkv-{int(dead.stdout)}-0123abcd.kv"
    kept.write_bytes(b"x")
    stored = os.open(kept, os.O_RDWR)
    hold(stored)
    assert held(kept)
    assert cleanup_stale_files(str(tmp_path), "pagedkv") == []
    assert kept.exists()
    os.close(stored)
    assert not held(kept)
    assert cleanup_stale_files(str(tmp_path), "pagedkv") == [kept]


# Two formats over one arena of 3 pages of 512 bytes (block_size 2): A (2 layers, 2 KV heads,
# head_dim 4, float32) has 256-byte blocks, 2 a page; B (1 layer, 1 KV head, head_dim 8,
# float16) has 64-byte blocks, 8 a page. Page p is A's blocks [2p, 2p + 2) and B's [8p, 8p + 8).
NUM_PAGES, PAGE_BYTES = 3, 512


@pytest.fixture
def arena(tmp_path: Path) -> Iterator[KVMemory]:
    """The arena, every byte random."""
    with KVMemory.create(NUM_PAGES, PAGE_BYTES, shm_dir=str(tmp_path)) as memory:
        seeded = torch.Generator().manual_seed(0)
        memory.pages.copy_(torch.randint(0, 256, memory.pages.shape, generator=seeded,
                                         dtype=torch.uint8))
        yield memory


def formats(arena: KVMemory) -> tuple[FormatMemory, FormatMemory]:
    return arena.view(2, 2, 4, "float32", 2), arena.view(1, 1, 8, torch.float16, 2)


def page_bytes_of(view: FormatMemory, page: int) -> torch.Tensor:
    """The bytes of `view`'s blocks in `page`, in order."""
    k = view.blocks_per_page
    return view.kv[page * k:(page + 1) * k].contiguous().view(-1).view(torch.uint8)


def test_views_have_the_format_shape_and_share_the_arena_handle(arena: KVMemory) -> None:
    a, b = formats(arena)
    assert (a.blocks_per_page, a.num_blocks, a.bytes_per_block) == (2, 6, 256)
    assert (b.blocks_per_page, b.num_blocks, b.bytes_per_block) == (8, 24, 64)
    assert a.kv.shape == (6, 2, 2, 2, 2, 4) and a.kv.dtype == torch.float32
    assert b.kv.shape == (24, 1, 2, 2, 1, 8) and b.kv.dtype == torch.float16
    handles = a.handle(), b.handle()
    assert [(h.shape, h.dtype) for h in handles] == [((6, 2, 2, 2, 2, 4), "float32"),
                                                     ((24, 1, 2, 2, 1, 8), "float16")]
    assert handles[0].shm_path == handles[1].shm_path and handles[0].kind == "shm"
    assert a.nbytes == b.nbytes == arena.nbytes == NUM_PAGES * PAGE_BYTES


def test_two_formats_alias_the_same_bytes_page_by_page(arena: KVMemory) -> None:
    a, b = formats(arena)
    for page in range(NUM_PAGES):
        assert torch.equal(page_bytes_of(a, page), arena.pages[page])
        assert torch.equal(page_bytes_of(b, page), arena.pages[page])
    before = arena.pages.clone()
    b.kv[8 * 1 + 3] = 1.5  # B's block 3 of page 1: bytes [192, 256) of page 1, in A's block 2
    changed = (arena.pages != before).nonzero()
    assert changed[:, 0].unique().tolist() == [1]
    assert int(changed[:, 1].min()) >= 3 * 64 and int(changed[:, 1].max()) < 4 * 64
    # A sees B's write at the end of its block 2
    assert torch.equal(page_bytes_of(a, 1)[192:256], b.kv[11].view(-1).view(torch.uint8))


def test_zero_pages_zeroes_a_page_in_every_view(arena: KVMemory) -> None:
    a, b = formats(arena)
    before = arena.pages.clone()
    arena.zero_pages([1])
    assert not a.kv[2:4].any() and not b.kv[8:16].any()
    assert torch.equal(arena.pages[[0, 2]], before[[0, 2]])
    for bad in ([3], [-1], [0.5]):
        with pytest.raises(ValueError, match="page ids"):
            arena.zero_pages([0, *bad])
    assert torch.equal(arena.pages[[0, 2]], before[[0, 2]]), "a refused zero changed a page"
    arena.zero_pages([])


def test_copy_and_zero_blocks_per_format(arena: KVMemory) -> None:
    a, b = formats(arena)
    before = arena.pages.clone()
    b.copy_blocks([(0, 9)])  # page 0's first B block onto page 1's second
    assert torch.equal(b.kv[9].view(torch.uint8), b.kv[0].view(torch.uint8))  # bytes: NaNs
    assert torch.equal(arena.pages[1, 64:128], before[0, 0:64])
    changed = (arena.pages != before).nonzero()
    assert set(changed[:, 0].tolist()) <= {1} and int(changed[:, 1].min()) >= 64
    assert int(changed[:, 1].max()) < 128
    a.zero_blocks([5])  # page 2's second half
    assert not arena.pages[2, 256:].any()
    assert torch.equal(arena.pages[2, :256], before[2, :256])


def test_a_runner_maps_a_view_in_its_format(arena: KVMemory) -> None:
    a, b = formats(arena)
    mapped = attach_pool(b.handle())  # another mapping of the file, as a runner's
    assert mapped.shape == b.kv.shape and mapped.dtype == torch.float16
    mapped[20] = 2.0  # page 2's fifth B block: bytes [256, 320) of page 2, A's block 5
    assert bool((b.kv[20] == 2.0).all())
    assert torch.equal(page_bytes_of(a, 2), arena.pages[2])
    assert torch.equal(arena.pages[2, 256:320].view(torch.float16),
                       torch.full((32,), 2.0, dtype=torch.float16))


def test_a_format_whose_block_does_not_divide_the_page_is_refused(arena: KVMemory) -> None:
    with pytest.raises(ValueError, match=r"block of 384 bytes .* does not divide the page of "
                                         r"512 bytes"):
        arena.view(3, 2, 4, "float32", 2)
    with pytest.raises(ValueError, match="must be positive"):
        arena.view(0, 2, 4, "float32", 2)
    with pytest.raises(ValueError, match="unknown dtype"):
        arena.view(1, 1, 8, "int8", 2)


def test_closing_the_arena_releases_its_views(tmp_path: Path) -> None:
    with KVMemory.create(1, 64, shm_dir=str(tmp_path)) as memory:
        view = memory.view(1, 1, 8, "float16", 2)
        path = Path(view.handle().shm_path)
    assert not path.exists()
    with pytest.raises(ValueError, match="closed"):
        view.zero_blocks([0])
    with pytest.raises(ValueError, match="closed"):
        memory.zero_pages([0])
    with pytest.raises(ValueError, match="must be positive"):
        KVMemory.create(0, 64, shm_dir=str(tmp_path))


def test_a_one_model_pool_is_one_view_whose_blocks_are_the_pages(pool: KVPoolMemory) -> None:
    assert (pool.arena.num_pages, pool.arena.page_bytes) == (NUM_BLOCKS, pool.bytes_per_block)
    assert pool.blocks_per_page == 1 and pool.pool_id == pool.arena.pool_id
    before = pool.kv.clone()
    pool.arena.zero_pages([4])
    assert not pool.kv[4].any()
    assert torch.equal(pool.kv[[0, 1, 2, 3, 5]], before[[0, 1, 2, 3, 5]])
