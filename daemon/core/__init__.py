"""The block-pool core: pure bookkeeping of KV blocks (numpy only; no torch, no grpc)."""

from .allocator import ALLOCATORS, AllocatorKind, PoolAllocator, make_pool
from .block_pool import BlockPool
from .contiguous import ContiguousPool
from .errors import InvalidArgument, PoolError, SequenceExists, SequenceNotFound
from .journal import Journal
from .physical_blocks import CacheEvents
from .types import BatchAppend, BlockCopy, NoFit, PoolStats, SeqUpdate, blocks_for

__all__ = [
    "ALLOCATORS",
    "AllocatorKind",
    "BatchAppend",
    "BlockCopy",
    "BlockPool",
    "CacheEvents",
    "ContiguousPool",
    "InvalidArgument",
    "Journal",
    "NoFit",
    "PoolAllocator",
    "PoolError",
    "PoolStats",
    "SeqUpdate",
    "SequenceExists",
    "SequenceNotFound",
    "blocks_for",
    "make_pool",
]
