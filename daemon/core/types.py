"""The records the block pool hands to its callers (only block ids and slots leave the pool)."""

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """One copy-on-write copy that the owner of the pool memory must perform."""

    # Physical block whose data is copied (it stays with the other sharers).
    src: int
    # Fresh private block that receives the data and replaces `src` in the writer's table.
    dst: int


@dataclass(frozen=True, slots=True)
class NoFit:
    """Result of an operation that does not fit in the free blocks; nothing was changed."""

    # Blocks the operation would have taken from the free pool.
    needed: int
    # Blocks that could be taken now: free plus evictable cached blocks (paged), or the
    # longest run of free blocks (contiguous: a reservation needs one run).
    available: int


@dataclass(slots=True)
class SeqUpdate:
    """What one allocate/append/fork/copy_on_write did to one sequence."""

    # The sequence's whole block table after the call: logical block i -> physical block.
    block_table: list[int]
    # Tokens held by the sequence after the call.
    num_tokens: int
    # Leading tokens whose K/V were already in the pool (prefix-cache hits); allocate only.
    num_cached_tokens: int = 0
    # Slot (block * block_size + offset) of each token this call added, in order.
    slot_mapping: list[int] = field(default_factory=list)
    # Copy-on-write copies made for this call, to be done before the table is used.
    copies: list[BlockCopy] = field(default_factory=list)
    # GetBlockTables asked for token ids: every id the sequence holds, or [] when the pool does
    # not know them all (a token came without its id); None when not asked.
    token_ids: list[int] | None = None


@dataclass(slots=True)
class BatchAppend:
    """What one batched append did to many sequences (the decode hot path)."""

    # Slots of the appended tokens, sequence-major: [num_seqs * num_tokens] int64.
    slot_mapping: npt.NDArray[np.int64]
    # Block-table entries that changed, as three parallel int64 arrays: the index of the
    # sequence in the request, the logical block, and the physical block now there.
    # New blocks and copy-on-write replacements both appear here.
    changed_seq_index: npt.NDArray[np.int64]
    changed_logical_block: npt.NDArray[np.int64]
    changed_block_id: npt.NDArray[np.int64]
    # Copy-on-write copies made for this call.
    copies: list[BlockCopy]
    # Each sequence's token count after the call: [num_seqs] int64.
    num_tokens: npt.NDArray[np.int64]
    # Blocks the call added to the sequences' quota charge (`quota_blocks`): the new table
    # entries of a paged pool (a copy-on-write replaces an entry, adds none), less one for each
    # sequence that was empty (it was charged one entry already); 0 in a contiguous one, whose
    # sequences were charged their whole reservation when they were made.
    charged_blocks: int


@dataclass(frozen=True, slots=True)
class PoolStats:
    """A snapshot of the pool's occupancy and prefix-cache counters."""

    # Physical blocks in the pool (those of the pages it holds: see `BlockPool.withdraw_pages`),
    # and token slots per block.
    num_blocks: int
    block_size: int
    # Blocks an allocation could take now: never-used or released blocks plus evictable
    # cached ones (refcount 0, content still cached). Contiguous: the free blocks whole
    # reservations can take (a run shorter than one is left out).
    free_blocks: int
    # Blocks referenced by at least one live sequence (contiguous: reserved by one).
    used_blocks: int
    # Evictable cached blocks (a subset of free_blocks).
    cached_blocks: int
    # Used blocks that are full and keyed but not committed: their K/V is not yet certified
    # written, so no prompt can match them.
    pending_blocks: int
    # Distinct physical slots that hold a live token (shared slots count once).
    filled_slots: int
    # Slots of the used blocks: used_blocks * block_size (contiguous: reserved slots).
    allocated_slots: int
    # Tokens summed over all live sequences (a shared token counts once per sequence).
    logical_tokens: int
    # Live sequences.
    num_sequences: int
    # Prefix-cache lookups, in tokens: tokens offered for reuse, and tokens found cached.
    prefix_cache_queries: int
    prefix_cache_hits: int

    @property
    def utilization(self) -> float:
        """U = filled slots / slots of used blocks (1.0 for an empty pool)."""
        return self.filled_slots / self.allocated_slots if self.allocated_slots else 1.0

    @property
    def sharing_ratio(self) -> float:
        """Logical tokens per filled physical slot: > 1 when sequences share blocks."""
        return self.logical_tokens / self.filled_slots if self.filled_slots else 1.0
