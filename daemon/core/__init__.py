"""The block-pool core: pure bookkeeping of KV blocks (numpy only; no torch, no grpc)."""

from .block_pool import BlockPool
from .contiguous import ContiguousAllocator
from .errors import InvalidArgument, PoolError, SequenceExists, SequenceNotFound
from .types import BatchAppend, BlockCopy, NoFit, PoolStats, SeqKey, SeqUpdate

__all__ = [
    "BatchAppend",
    "BlockCopy",
    "BlockPool",
    "ContiguousAllocator",
    "InvalidArgument",
    "NoFit",
    "PoolError",
    "PoolStats",
    "SeqKey",
    "SeqUpdate",
    "SequenceExists",
    "SequenceNotFound",
]
