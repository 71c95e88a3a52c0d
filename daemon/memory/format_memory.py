"""One K/V format's view of the pool memory: `FormatMemory`, what the daemon's memory work
copies and zeroes blocks through.

A format is one geometry (layers, KV heads, head size, dtype; block_size is the pool's). Its view
is the whole arena (`kv_memory.KVMemory`) reinterpreted in its dtype as the block-major
[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] of `pagedkv.memory.handle`,
num_blocks = num_pages * blocks_per_page: block b is one contiguous slab of bytes_per_block and
lies in page b // blocks_per_page, so copying or zeroing a block is one indexed op over
BLOCK_DIM, and views of two formats alias the same bytes exactly where their pages do.
Ids are validated before anything is written: bad ids change nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import numpy as np
import numpy.typing as npt
import torch

from pagedkv.memory import BLOCK_DIM, PoolMemoryHandle

# Block ids as the block pool hands them out: a list, or an int64 array on the batch path.
BlockIds = Sequence[int] | npt.NDArray[np.int64]


class FormatMemory:
    """One format's view of the arena; made by `KVMemory.view`, released with the arena."""

    def __init__(self, kv: torch.Tensor, handle: PoolMemoryHandle, blocks_per_page: int) -> None:
        # The view, in POOL_LAYOUT order; None once the arena is closed.
        self._kv: torch.Tensor | None = kv
        # How a runner maps this same view (the arena's file or IPC payload, this shape, dtype).
        self._handle = handle
        # Blocks of this format in one page: page p is blocks [p * k, (p + 1) * k).
        self.blocks_per_page = blocks_per_page

    @property
    def kv(self) -> torch.Tensor:
        """The view, in POOL_LAYOUT order."""
        if self._kv is None:
            raise ValueError("the pool memory is closed")
        return self._kv

    @property
    def num_blocks(self) -> int:
        return self._handle.shape[BLOCK_DIM]

    @property
    def block_size(self) -> int:
        return self._handle.shape[3]

    @property
    def bytes_per_block(self) -> int:
        return self.kv[0].numel() * self.kv.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes the view spans: the whole arena."""
        return self.kv.numel() * self.kv.element_size()

    def handle(self) -> PoolMemoryHandle:
        return self._handle

    @overload
    def copy_blocks(self, pairs: Sequence[tuple[int, int]], /) -> None: ...
    @overload
    def copy_blocks(self, src: BlockIds, dst: BlockIds, /) -> None: ...

    def copy_blocks(self, src: BlockIds | Sequence[tuple[int, int]],
                    dst: BlockIds | None = None, /) -> None:
        """kv[dst[i]] = kv[src[i]] for all i (every layer, K and V: one slab each), in one op.

        Takes (src, dst) pairs, e.g. `[(c.src, c.dst) for c in update.copies]`, or two id lists.
        All sources are gathered before any destination is written, so a destination that is
        also a source (a chain a -> b, b -> c) gets the source's data from before the call.
        Destinations must be distinct; ids must be in range. Nothing to copy is a no-op.
        """
        if dst is None:
            pairs = np.asarray(src)
            if pairs.size and (pairs.ndim != 2 or pairs.shape[1] != 2):
                raise ValueError(f"expected (src, dst) pairs, got {pairs.tolist()}")
            pairs = pairs.reshape(-1, 2)
            src_ids, dst_ids = self._block_index(pairs[:, 0]), self._block_index(pairs[:, 1])
        else:
            src_ids, dst_ids = self._block_index(src), self._block_index(dst)
        if src_ids.numel() != dst_ids.numel():
            raise ValueError(f"{src_ids.numel()} sources but {dst_ids.numel()} destinations")
        if len(set(dst_ids.tolist())) != dst_ids.numel():
            raise ValueError("a block is the destination of more than one copy")
        if src_ids.numel():
            blocks = self._block_bytes()
            blocks.index_copy_(BLOCK_DIM, dst_ids.to(blocks.device),
                               blocks.index_select(BLOCK_DIM, src_ids.to(blocks.device)))

    def zero_blocks(self, ids: BlockIds) -> None:
        """Fill the given blocks with zeros in every layer, K and V."""
        index = self._block_index(ids)
        if index.numel():
            blocks = self._block_bytes()
            blocks.index_fill_(BLOCK_DIM, index.to(blocks.device), 0)

    def synchronize(self) -> None:
        """Wait until every copy and zeroing issued so far is complete in memory. On CUDA they
        are asynchronous kernels; once the device is synchronized, a runner in another process
        that reads the blocks sees their new data. CPU work is complete when its call returns."""
        if self.kv.is_cuda:
            torch.cuda.synchronize(self.kv.device)

    def release(self) -> None:
        """Drop the view (the arena closes): every later use raises ValueError."""
        self._kv = None

    def _block_bytes(self) -> torch.Tensor:
        """The view as [num_blocks, bytes_per_block] uint8: a block's bytes are copied and
        zeroed whatever they mean (torch has no CPU index_copy_ or index_fill_ for fp8)."""
        return self.kv.view(self.num_blocks, -1).view(torch.uint8)

    def _block_index(self, ids: npt.ArrayLike) -> torch.Tensor:
        """Ids as a 1-D int64 CPU tensor, checked against the view before any write."""
        return checked_index(ids, self.num_blocks, "block")


def checked_index(ids: npt.ArrayLike, count: int, what: str) -> torch.Tensor:
    """Integer ids in [0, count) as a 1-D int64 CPU tensor; ValueError naming `what` else."""
    array = np.asarray(ids)
    if array.size and (array.ndim != 1 or not np.issubdtype(array.dtype, np.integer)):
        raise ValueError(f"expected a list of integer {what} ids, got {array.tolist()}")
    index = torch.from_numpy(array.astype(np.int64).reshape(-1))
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= count):
        raise ValueError(f"{what} ids must be in [0, {count}), got {index.tolist()}")
    return index
