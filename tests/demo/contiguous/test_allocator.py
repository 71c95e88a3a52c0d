"""The seam between the daemon and the contiguous baseline: what the service is given, and what
the daemon refuses because the baseline cannot do it.

A service over `contiguous_pool` (14 blocks of 4 slots, max_model_len 16: 4 blocks a sequence)
with `lends_pages=False`, as `pagedkvd --allocator contiguous` builds it; beside it, the same
service over a paged pool, which lends pages to a second geometry's format.
"""

from dataclasses import fields

import pytest

from pagedkv.daemon.core import BlockPool, InvalidArgument
from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.service.models import KvShape
from pagedkv.daemon.service.operations import Allocate, Append, Fork
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.demo.contiguous import CANNOT, ContiguousPool, contiguous_pool
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY

OWN = KvShape(2, 2, 64, "float32")  # the tiny model's geometry: format 0
OTHER = KvShape(1, 2, 64, "float32")  # another geometry: a format of its own


def service(pool: BlockPool, lends_pages: bool) -> PoolService:
    return PoolService(pool, None, pool_id="p", geometry=TINY_CPU_GEOMETRY,
                       lends_pages=lends_pages)


async def test_the_service_drives_the_baseline_through_the_block_pool_seam() -> None:
    svc = service(contiguous_pool(14, 4, 16), lends_pages=False)
    assert isinstance(svc.pool, ContiguousPool)
    sid = svc.open_session("c").session_id
    assert (await svc.allocate(sid, Allocate(1, 5))).block_table == [0, 1]
    assert (await svc.fork(sid, Fork(1, 2))).block_table == [4, 5]  # a reservation of its own
    svc.check_invariants()  # the page broker counts every page held by format 0


async def test_a_batch_of_appends_runs_on_the_baseline_as_one_by_one() -> None:
    """A Batch's run of Appends goes to the pool as one `append_batch` (session_ops.py): the
    baseline answers it, each sequence as its own Append would be."""
    together, one_by_one = (service(contiguous_pool(14, 4, 16), lends_pages=False)
                            for _ in range(2))
    answers = []
    for svc in (together, one_by_one):
        sid = svc.open_session("c").session_id
        await svc.batch(sid, [Allocate(1, 5), Allocate(2, 3)])
        ops = [Append(1, 2, [7, 8]), Append(2, 2, [9, 10])]
        updates = (await svc.batch(sid, ops) if svc is together
                   else [(await svc.batch(sid, [op]))[0] for op in ops])
        answers.append([(u.block_table, u.num_tokens, u.slot_mapping) for u in updates])
        svc.check_invariants()
    assert answers[0] == answers[1] == [([0, 1], 7, [5, 6]), ([4, 5], 5, [19, 20])]


def test_a_pool_that_lends_no_pages_serves_one_format() -> None:
    svc = service(contiguous_pool(14, 4, 16), lends_pages=False)
    assert svc.register_model("tiny-ft", OWN).format.number == 0  # its geometry shares it
    with pytest.raises(InvalidArgument, match="this pool serves one format"):
        svc.register_model("half", OTHER)
    assert [m.name for m in svc.models] == ["tiny", "tiny-ft"]  # nothing changed
    svc.check_invariants()
    paged = service(BlockPool(16, 4), lends_pages=True)
    assert paged.register_model("half", OTHER).format.number == 1


def test_every_setting_the_baseline_cannot_honour_is_one_the_config_refuses() -> None:
    assert set(CANNOT) <= {setting.name for setting in fields(DaemonConfig)}
    DaemonConfig(allocator="contiguous", max_model_len=64)  # the baseline with none of them
