"""A PoolService without gRPC on a tiny pool, and what a refused call must leave as it was."""

from typing import Any

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.service.pool_service import PoolService


def make_service(num_blocks: int = 8, block_size: int = 4, **options: Any) -> PoolService:
    return PoolService(BlockPool(num_blocks, block_size), options.pop("memory", None),
                       pool_id="testpool", **options)


def snapshot(service: PoolService) -> tuple[object, ...]:
    """Everything a failed call must leave as it was."""
    tables = {(s.label, q): (service.pool.block_table(s.key(q)), service.pool.num_tokens(s.key(q)))
              for s in service.sessions for q in s.seq_ids}
    books = {s.label: (sorted(s.seq_ids), s.table_entries, s.prefix_cache_queries,
                       s.prefix_cache_hits) for s in service.sessions}
    tier = service.host_tier
    host = None if tier is None else (dict(tier.slot_of), list(tier.lru), tier.stores,
                                      tier.restores)
    return service.pool_stats(), tables, books, host
