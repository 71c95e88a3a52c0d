"""The block-pool core: pure bookkeeping of KV blocks (numpy only; no torch, no grpc)."""

from pagedkv.daemon.core.block_pool import BlockPool
from pagedkv.daemon.core.cache_events import CacheEvent
from pagedkv.daemon.core.content_keys import PREFIX_HASHES, PrefixHash
from pagedkv.daemon.core.errors import InvalidArgument, PoolError, SequenceExists, SequenceNotFound
from pagedkv.daemon.core.journal import Journal
from pagedkv.daemon.core.types import BatchAppend, BlockCopy, NoFit, PoolStats, SeqUpdate

__all__ = [
    "PREFIX_HASHES",
    "BatchAppend",
    "BlockCopy",
    "BlockPool",
    "CacheEvent",
    "InvalidArgument",
    "Journal",
    "NoFit",
    "PoolError",
    "PoolStats",
    "PrefixHash",
    "SeqUpdate",
    "SequenceExists",
    "SequenceNotFound",
]
