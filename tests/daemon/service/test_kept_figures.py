"""GetStats and /metrics read figures kept by the operations, never the tables.

Walking every table entry on the event loop took 14 ms (GetStats) and 31-35 ms (/metrics) at a
million entries, stalling every other client: producing the figures must not read a single table
entry, however much the pool holds; that the kept figures equal a recount is checked by
`check_invariants` after random operations (tests/daemon/core/test_block_pool_stateful.py,
tests/daemon/service/test_pool_service.py).
"""

from typing import Any

import pytest

from pagedkv.daemon.core import BlockPool, pool_checks
from pagedkv.daemon.edge.metrics import PoolCollector
from pagedkv.daemon.service.operations import Allocate, Commit, Fork
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.demo.contiguous import ContiguousPool


def _walking(*_: Any) -> Any:
    raise AssertionError("a figure walked the block tables")


async def test_get_stats_and_metrics_read_no_table_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    service = PoolService(BlockPool(64, 4), None, pool_id="figures")
    sids = [service.open_session(name, cache_salt=b"team").session_id for name in "ab"]
    prompt = list(range(30))
    for sid in sids:  # b's prompt hits a's cached blocks once a commits
        await service.allocate(sid, Allocate(1, 30, prompt))
        await service.commit(sid, Commit([1]))
        await service.fork(sid, Fork(1, 2))
    service.check_invariants()  # the kept figures equal a recount
    expected = service.stats_of(sids[0]), service.pool_stats(), service.tenant_figures()
    for name in ("block_table", "held_blocks", "num_tokens", "_recount_stats"):
        monkeypatch.setattr(service.pool, name, _walking, raising=False)
    monkeypatch.setattr(pool_checks, "table_entries", _walking)
    for name in ("table", "entries", "tables"):  # every way to the entries, old layout too
        monkeypatch.setattr(service.pool._seqs, name, _walking,  # type: ignore[attr-defined]
                            raising=False)
    assert (service.stats_of(sids[0]), service.pool_stats(),
            service.tenant_figures()) == expected
    # 7 full blocks shared by a and b count once for their tenant, beside 2 partial ones.
    assert expected[0].blocks_held == 8 and expected[2][0].blocks_held == 9
    families = {metric.name: metric for metric in PoolCollector(service).collect()}
    assert families["pagedkv:num_sequences"].samples[0].value == 4


def test_a_contiguous_pool_counts_whole_reservations_per_group() -> None:
    pool = ContiguousPool(num_blocks=16, block_size=4, max_model_len=16)  # 4 blocks a sequence
    pool.track_holders(2)
    with pool.holding((1, 0)):
        pool.allocate("a", 3)
        pool.fork("a", "b")
    with pool.holding((2, 0)):
        pool.allocate("c", 0)
    assert [pool.blocks_held(0, g) for g in (1, 2)] == [8, 4] and pool.blocks_held(1, 0) == 12
    with pytest.raises(RuntimeError), pool.transaction():
        pool.free("a")
        with pool.holding((2, 0)):
            pool.allocate("d", 1)  # may reuse a's row and blocks
        raise RuntimeError("undo")
    assert [pool.blocks_held(0, g) for g in (1, 2)] == [8, 4] and pool.blocks_held(1, 0) == 12
    pool.check_invariants()
    pool.free("a")
    assert pool.blocks_held(0, 1) == 4
    pool.check_invariants()
