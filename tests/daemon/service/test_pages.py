"""A model's min_memory is its own from the start (pages.py, "parked" pages).

The pool: 16 blocks of the daemon's own model ("tiny": 8 KiB a block) in 8 pages of 16 KiB
(two own blocks a page). "half" (1 layer: 4 KiB a block, 4 a page) reserves 2 pages; it
registers only after tiny's sessions asked for the whole pool.
"""

import pytest

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.service.errors import PoolExhausted
from pagedkv.daemon.service.models import KvShape, ModelPolicy
from pagedkv.daemon.service.operations import Allocate
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY

PAGE = 16384
HALF = KvShape(1, 2, 64, "float32")


def service(policies: dict[str, ModelPolicy]) -> PoolService:
    return PoolService(BlockPool(16, 4, blocks_per_page=2), None, pool_id="p",
                       geometry=TINY_CPU_GEOMETRY, page_bytes=PAGE, model_policies=policies)


async def test_a_reserve_is_kept_from_the_other_formats_before_its_model_registers() -> None:
    svc = service({"half": ModelPolicy(min_memory=PAGE + 1)})  # 2 pages, rounded up
    pages = svc.formats.pages
    own = svc.models.own.format
    # Pages 6 and 7 are parked for half: tiny holds 6 pages, 12 blocks.
    assert (pages.held(own), pages.parked, own.pool.num_free_blocks) == (6, {"half": [6, 7]},
                                                                         12)
    svc.check_invariants()
    tiny = svc.open_session("tiny")
    assert (await svc.allocate(tiny.session_id, Allocate(1, 48))).block_table == list(range(12))
    with pytest.raises(PoolExhausted):
        await svc.allocate(tiny.session_id, Allocate(2, 4))  # the parked pages stay half's
    svc.check_invariants()
    half = svc.register_model("half", HALF)
    # Its format holds its reserve at once: half's block ids 24-31 are pages 6 and 7.
    assert (pages.held(half.format), pages.held(own), pages.parked) == (2, 6, {})
    svc.register_model("half", HALF)  # idempotent: nothing moves again
    b = svc.open_session("b", model="half")
    assert (await svc.allocate(b.session_id, Allocate(1, 32))).block_table == list(range(24, 32))
    with pytest.raises(PoolExhausted):
        await svc.allocate(b.session_id, Allocate(2, 4))  # tiny's pages are all in use
    assert svc.page_moves_total == 0
    svc.check_invariants()


async def test_a_reserved_model_of_the_own_geometry_gets_its_pages_back_in_format_0() -> None:
    svc = service({"tiny-ft": ModelPolicy(min_memory=3 * PAGE)})
    own = svc.models.own.format
    assert svc.formats.pages.held(own) == 5
    model = svc.register_model("tiny-ft", KvShape(2, 2, 64, "float32"))
    assert model.format is own
    assert (svc.formats.pages.held(own), own.pool.num_free_blocks) == (8, 16)
    svc.check_invariants()


def test_reserves_larger_than_the_pool_are_refused_naming_min_memory() -> None:
    with pytest.raises(ValueError, match=r"min_memory \(a, b and the daemon's own\) sum to 9 "
                                         r"pages of 16384 bytes; the pool has 8"):
        service({"a": ModelPolicy(min_memory=4 * PAGE), "b": ModelPolicy(min_memory=4 * PAGE),
                 "tiny": ModelPolicy(min_memory=1)})
