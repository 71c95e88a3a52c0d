"""The block-pool core: pure bookkeeping of KV blocks (numpy only; no torch, no grpc)."""

from .block_pool import BlockPool
from .contiguous import ContiguousAllocator
from .errors import InvalidArgument, PoolError, SequenceExists, SequenceNotFound
from .journal import Journal
from .physical_blocks import CacheEvents
from .types import BatchAppend, BlockCopy, NoFit, PoolStats, SeqUpdate

__all__ = [
    "BatchAppend",
    "BlockCopy",
    "BlockPool",
    "CacheEvents",
    "ContiguousAllocator",
    "InvalidArgument",
    "Journal",
    "NoFit",
    "PoolError",
    "PoolStats",
    "SeqUpdate",
    "SequenceExists",
    "SequenceNotFound",
]
