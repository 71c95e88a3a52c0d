"""The seam between the daemon and the contiguous baseline it is measured against.

The daemon's service speaks to `BlockPool` only. `ContiguousPool` (pool.py: the baseline paging
replaced, one max-length reservation per sequence) answers `PoolAllocator`, the calls the service
makes of its own model's pool when none of the settings in `CANNOT` is set: `BlockPool` answers
it too, so one daemon serves either behind the same API (`pagedkvd --allocator contiguous`).
The daemon refuses those settings once, at config time, naming them, and builds the baseline's
pool through `contiguous_pool` alone (tests/project/test_layering.py: daemon/process is the one
room that may import this package). Both pools keep the same contract: block tables and slots
in answers, `NoFit` for "does not fit", a `PoolError` for a caller mistake, both with nothing
changed, and an undo journal that makes any run of calls all-or-nothing (`transaction()`).
"""

from collections.abc import Hashable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol, cast

import numpy as np
import numpy.typing as npt

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.core.cache_events import CacheEvent
from pagedkv.daemon.core.host_tier import HostTier
from pagedkv.daemon.core.journal import Journal
from pagedkv.daemon.core.types import BatchAppend, NoFit, PoolStats, SeqUpdate
from pagedkv.daemon.core.validation import TokenIds
from pagedkv.demo.contiguous.pool import ContiguousPool

# What a contiguous pool cannot do, by the daemon setting (DaemonConfig field) that asks for it,
# and why: the daemon refuses each of them with allocator = "contiguous".
CANNOT: dict[str, str] = {
    "page_size": "it serves one model's format, in pages of one block",
    "models": "it lends no pages to other models' formats, so it parks no reserve",
    "host_tier_memory": "it caches nothing to offload",
    "restore": "its state is not kept across restarts",
}


class PoolAllocator(Protocol):
    """The bookkeeping of one pool of KV blocks (see `BlockPool` for each call's contract)."""

    # Physical blocks in the pool, and token slots per block.
    num_blocks: int
    block_size: int
    # Whether identical prompt prefixes share blocks (never in a contiguous pool).
    enable_prefix_caching: bool

    @property
    def journal(self) -> Journal: ...

    def transaction(self) -> AbstractContextManager[Journal]: ...

    @property
    def blocks_per_page(self) -> int: ...

    @property
    def held_pages(self) -> int: ...

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new sequence could take now (a contiguous one needs a whole reservation)."""

    @property
    def reservation_blocks(self) -> int:
        """Blocks each sequence reserves when allocated or forked; 0: taken as tokens need."""

    def __contains__(self, seq: Hashable) -> bool: ...

    def __len__(self) -> int: ...

    def block_table(self, seq: Hashable) -> list[int]: ...

    def num_tokens(self, seq: Hashable) -> int: ...

    def table_length(self, seq: Hashable) -> int:
        """Entries of `block_table(seq)`: ceil(num_tokens / B), or more where `seq` reserved
        slots ahead."""

    def committed_tokens(self, seq: Hashable) -> int: ...

    def token_ids(self, seq: Hashable) -> list[int] | None:
        """Every token id `seq` holds, or None when some came without an id (or the pool keeps
        none): what a runner checks a client's claimed history against."""

    def held_blocks(self, seq: Hashable) -> list[int]:
        """The blocks `seq` keeps from new sequences: its table, or its whole reservation."""

    def quota_blocks(self, num_tokens: int) -> int:
        """What a sequence of `num_tokens` tokens counts against session and tenant quotas."""

    def quota_of(self, seq: Hashable) -> int:
        """What `seq` counts against quotas now: `quota_blocks` of its tokens, or more where
        it reserved slots ahead (paged: every table entry)."""

    def fork_copies(self, num_tokens: int) -> int:
        """Block copies a fork of a sequence of `num_tokens` tokens reports."""

    def allocate(self, seq: Hashable, num_tokens: int, token_ids: TokenIds | None = None,
                 salt: bytes = b"", use_host_tier: bool = True) -> SeqUpdate | NoFit:
        """A new sequence; with `use_host_tier`, its prefix may be restored from the host
        tier, where the pool has one (paged pools only)."""

    def append(self, seq: Hashable, num_tokens: int = 1,
               token_ids: TokenIds | None = None) -> SeqUpdate | NoFit: ...

    def append_batch(self, seqs: Sequence[Hashable], num_tokens: int = 1,
                     token_ids: npt.ArrayLike | None = None,
                     reserve_tokens: int = 0) -> BatchAppend | NoFit: ...

    def commit(self, seqs: Sequence[Hashable],
               num_tokens: npt.ArrayLike | None = None) -> int: ...

    def fork(self, parent: Hashable, child: Hashable) -> SeqUpdate | NoFit: ...

    def copy_on_write(self, seq: Hashable, logical_block: int) -> SeqUpdate | NoFit: ...

    def free(self, seq: Hashable) -> list[int]: ...

    def recording_events(self) -> AbstractContextManager[None]: ...

    def take_events(self) -> list[CacheEvent]: ...

    @property
    def host_tier(self) -> HostTier | None:
        """Where evicted committed blocks are copied (`host_tier.py`); None: nowhere."""

    def track_holders(self, levels: int) -> None:
        """Count, from now on, the distinct blocks held by each group of sequences, for
        `levels` ways of grouping them; before any sequence exists."""

    def holding(self, groups: Sequence[int]) -> AbstractContextManager[None]:
        """Sequences made inside belong to `groups`, one per level of `track_holders`."""

    def blocks_held(self, level: int, group: int) -> int:
        """Distinct blocks the sequences of one group reference (O(1))."""

    def uncache(self, candidates: Mapping[int, bytes]) -> list[int]: ...

    def cached_keys(self) -> dict[int, bytes]: ...

    def root_key(self, salt: bytes) -> bytes: ...

    def parent_block(self, block: int) -> int | None: ...

    def block_content(self, blocks: Sequence[int]) -> tuple[list[bytes], list[bytes],
                                                            npt.NDArray[np.int64]]: ...

    def stats(self) -> PoolStats: ...

    def check_invariants(self) -> None: ...


def contiguous_pool(num_blocks: int, block_size: int, max_model_len: int) -> BlockPool:
    """The baseline's pool of `num_blocks` blocks, each sequence reserving `max_model_len`
    slots, typed as the `BlockPool` the service speaks to: it answers every call the service
    makes with the settings of `CANNOT` refused (`PoolAllocator`, which mypy checks here), and
    no other (the service lends none of its pages: `PoolService(lends_pages=False)`)."""
    pool: PoolAllocator = ContiguousPool(num_blocks, block_size, max_model_len)
    return cast(BlockPool, pool)
