"""The block-pool core: pure bookkeeping of KV blocks (numpy only; no torch, no grpc)."""

from pagedkv.daemon.core.allocator import ALLOCATORS, AllocatorKind, PoolAllocator, make_pool
from pagedkv.daemon.core.block_pool import BlockPool
from pagedkv.daemon.core.cache_events import CacheEvent
from pagedkv.daemon.core.content_keys import PREFIX_HASHES, PrefixHash
from pagedkv.daemon.core.contiguous import ContiguousPool
from pagedkv.daemon.core.errors import InvalidArgument, PoolError, SequenceExists, SequenceNotFound
from pagedkv.daemon.core.journal import Journal
from pagedkv.daemon.core.types import BatchAppend, BlockCopy, NoFit, PoolStats, SeqUpdate

__all__ = [
    "ALLOCATORS",
    "PREFIX_HASHES",
    "AllocatorKind",
    "BatchAppend",
    "BlockCopy",
    "BlockPool",
    "CacheEvent",
    "ContiguousPool",
    "InvalidArgument",
    "Journal",
    "NoFit",
    "PoolAllocator",
    "PoolError",
    "PoolStats",
    "PrefixHash",
    "SeqUpdate",
    "SequenceExists",
    "SequenceNotFound",
    "make_pool",
]
