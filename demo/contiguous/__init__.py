"""The contiguous baseline paging replaced, kept to be measured against (the demo's plot,
benchmarks/bench_block_pool.py, bench_e2e_concurrency.py, `pagedkvd --allocator contiguous`)."""

from pagedkv.demo.contiguous.allocator import CANNOT, PoolAllocator, contiguous_pool
from pagedkv.demo.contiguous.pool import ContiguousPool

__all__ = ["CANNOT", "ContiguousPool", "PoolAllocator", "contiguous_pool"]
