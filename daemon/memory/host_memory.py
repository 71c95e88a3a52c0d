"""The host tier's memory: slots of one format's blocks in host memory, and the copies to and
from the pool (kvpool.proto, "The host-memory tier"; the bookkeeping is `core/host_tier.py`).

Slot s holds one block's bytes, [num_layers, 2, block_size, num_kv_heads, head_dim] of the
format's dtype, as `bytes_per_block` raw bytes: a copy is one gather and one scatter of whole
blocks, whatever the dtype, and never converts. The slots are a second shared-memory arena
(`KVMemory`, a 0o600 file in /dev/shm reserved up front, removed on close and by
`cleanup_stale_files` after a crash), whatever the pool's device: a file, not private memory,
so that it outlives the daemon as the pool's does (stored in systemd's fd store and adopted by
the next daemon when its layout matches: `over` an adopted arena, pool_handover.py). Only the
daemon maps it: no runner reads the host tier, so no tenant's process ever sees a host copy's
bytes. Beside a CUDA pool the mapping is registered with the driver (cudaHostRegister), so it
is pinned and copies between it and the device run as DMA.

A restore copies whole blocks, so a slot's stale bytes never reach a block partly; dropped
copies are zeroed on request (`zero`) for defense in depth, as freed pool blocks are.
"""

from __future__ import annotations

import time

import numpy.typing as npt
import torch

from pagedkv.daemon.memory.format_memory import FormatMemory, checked_index
from pagedkv.daemon.memory.kv_memory import KVMemory

# Blocks and rounds of the copy-rate measurement at start (a few ms on this CPU).
MEASURE_BLOCKS = 16
MEASURE_ROUNDS = 3


class HostMemory:
    """`num_slots` slots of host memory for the blocks of one pool view (`pool`)."""

    def __init__(self, slots: torch.Tensor, pool: FormatMemory, arena: KVMemory | None,
                 registered: bool = False) -> None:
        # [num_slots, bytes_per_block] uint8 in host memory.
        self.slots = slots
        self.num_slots = slots.shape[0]
        # The pool view whose blocks the slots copy.
        self._pool = pool
        # Both sides as rows of the widest integer words a block's bytes divide into: torch's
        # row gather and scatter move 8-byte words about 7x faster than single bytes on this
        # CPU (16 blocks of 16 KiB: 0.07 ms against 0.50 ms), and the bytes are the same.
        word = _word_dtype(slots.shape[1])
        self._slot_words = slots.view(word)
        self._pool_words = pool.kv.view(pool.num_blocks, -1).view(torch.uint8).view(word)
        # The shm arena behind `slots`, closed with this (None: memory of a test's own).
        self._arena = arena
        # Whether `slots` is registered with CUDA (pinned beside a CUDA pool) until `close`.
        self._registered = registered

    @classmethod
    def create(cls, num_slots: int, pool: FormatMemory, shm_dir: str = "/dev/shm",
               name_prefix: str = "pagedkv") -> HostMemory:
        """Zeroed slots for `num_slots` blocks of `pool`'s format (see `over`)."""
        if num_slots <= 0:
            raise ValueError(f"the host tier needs at least one slot, got {num_slots}")
        arena = KVMemory.create(num_slots, pool.bytes_per_block, "cpu", shm_dir, name_prefix,
                                0o600)
        return cls.over(arena, pool)

    @classmethod
    def over(cls, arena: KVMemory, pool: FormatMemory) -> HostMemory:
        """The slots of `arena` (a CPU arena of one block of `pool`'s format a page, new or
        adopted from the previous daemon), pinned with cudaHostRegister beside a CUDA pool."""
        if arena.page_bytes != pool.bytes_per_block or arena.pages.is_cuda:
            message = (f"host tier slots must be CPU pages of {pool.bytes_per_block} bytes, "
                       f"got {arena.page_bytes} on {arena.pages.device}")
            arena.close()
            raise ValueError(message)
        if pool.kv.is_cuda:
            _cuda_register(arena.pages)
        return cls(arena.pages, pool, arena, registered=pool.kv.is_cuda)

    @property
    def adopted_from(self) -> str:
        """The id of the previous daemon's host memory this is ("": allocated here)."""
        return "" if self._arena is None else self._arena.adopted_from

    @property
    def memory_id(self) -> str:
        """This host memory's id (its arena's; the next daemon's `adopted_from`)."""
        return "" if self._arena is None else self._arena.pool_id

    @property
    def bytes_per_block(self) -> int:
        return int(self.slots.shape[1])

    def to_host(self, blocks: npt.ArrayLike, slots: npt.ArrayLike) -> None:
        """slots[i] = pool block blocks[i], for all i (destinations distinct)."""
        src = checked_index(blocks, self._pool.num_blocks, "block")
        dst = checked_index(slots, self.num_slots, "host slot")
        if src.numel():
            data = self._pool_words.index_select(0, src.to(self._pool_words.device))
            # A blocking copy: from a CUDA tensor, `.to("cpu", non_blocking=True)` returns
            # pinned memory the device has not filled yet, and the CPU index_copy_ below would
            # read it at once (stale bytes in the slots, restored later as K/V).
            self._slot_words.index_copy_(0, dst, data.to("cpu"))

    def from_host(self, slots: npt.ArrayLike, blocks: npt.ArrayLike) -> None:
        """Pool block blocks[i] = slots[i], for all i (destinations distinct)."""
        src = checked_index(slots, self.num_slots, "host slot")
        dst = checked_index(blocks, self._pool.num_blocks, "block")
        if src.numel():
            device = self._pool_words.device
            data = self._slot_words.index_select(0, src).to(device, non_blocking=True)
            self._pool_words.index_copy_(0, dst.to(device), data)

    def zero(self, slots: npt.ArrayLike) -> None:
        index = checked_index(slots, self.num_slots, "host slot")
        if index.numel():
            self.slots.index_fill_(0, index, 0)

    def synchronize(self) -> None:
        """Copies issued so far are complete (CUDA copies are asynchronous until then)."""
        self._pool.synchronize()

    def measure_copy_rate(self) -> int:
        """Bytes per second of copies between the pool and the slots, both ways, timed over a
        few blocks: what a client weighs a restore against a recompute by (PoolInfo). Copies
        the pool's first blocks out and back, so call it before the pool serves anyone."""
        n = min(MEASURE_BLOCKS, self.num_slots, self._pool.num_blocks)
        ids = list(range(n))
        self.to_host(ids, ids)  # warm up: first touches of the pages
        self.from_host(ids, ids)
        self.synchronize()
        start = time.perf_counter()
        for _ in range(MEASURE_ROUNDS):
            self.to_host(ids, ids)
            self.from_host(ids, ids)
        self.synchronize()
        elapsed = max(time.perf_counter() - start, 1e-9)
        self.zero(ids)
        return int(2 * MEASURE_ROUNDS * n * self.bytes_per_block / elapsed)

    def close(self) -> None:
        """Release the slots (the arena's file is removed unless the fd store keeps it)."""
        if self._registered:
            _cuda_unregister(self.slots)
            self._registered = False
        if self._arena is not None:
            self._arena.close()


def _cuda_register(slots: torch.Tensor) -> None:
    """Pin `slots` (a shared mapping) for DMA: pin_memory would copy into private memory."""
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    error = int(cudart.cudaHostRegister(slots.data_ptr(), slots.nbytes, 0))
    if error:
        raise RuntimeError(f"cudaHostRegister of the host tier's {slots.nbytes} bytes failed: "
                           f"cudaError {error}")


def _cuda_unregister(slots: torch.Tensor) -> None:
    torch.cuda.synchronize()  # no copy may still read or write the mapping
    torch.cuda.cudart().cudaHostUnregister(slots.data_ptr())  # type: ignore[no-untyped-call]


def _word_dtype(nbytes: int) -> torch.dtype:
    """The widest integer dtype whose size divides `nbytes` (a block's bytes)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        if nbytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8
