"""Several models on one pool across a restart: a service restored from its image has the same
models (numbers, formats, runner targets, asleep), the same pages in each format, the same
tables, caches and host copies, and goes on answering random calls exactly as the original.

The pool: 8 pages of 16 KiB; "tiny" (the daemon's own, 2 blocks a page, with a host tier) and
"tiny-ft" (its geometry), "half" (4 blocks a page, min_memory one page, capped at 20 blocks)
and "sleepy" (half's geometry, asleep at the stop).
"""

import random

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.service.models import KvShape, ModelPolicy
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.service_image import NotKept, restore_service, service_image
from pagedkv.daemon.service.sessions import Session
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY

from hand_clock import HandClock
from service_calls import random_calls

BLOCK = 4
HALF = KvShape(1, 2, 64, "float32")
POLICIES = {"half": ModelPolicy(min_memory=16384, max_memory=20 * 4096)}


def service(pool_id: str, clock: HandClock,
            policies: dict[str, ModelPolicy] = POLICIES) -> PoolService:
    """A fresh daemon's service: its own model alone, with a host tier of 8 slots."""
    svc = PoolService(BlockPool(16, BLOCK, blocks_per_page=2), None, pool_id=pool_id,
                      geometry=TINY_CPU_GEOMETRY, page_bytes=16384, model_policies=policies,
                      zero_freed_blocks=True, clock=clock)
    svc.attach_host_tier(None, 8)
    return svc


def state(svc: PoolService) -> object:
    """Everything the image must bring back, by value."""
    models = [(m.name, m.number, m.format.number, m.format.shape, m.runner_target, m.asleep)
              for m in svc.models]
    tables = {}
    for session in svc.sessions:
        pool = svc.model_of(session).format.pool
        for seq_id in sorted(session.seq_ids):
            key = session.key(seq_id)
            tables[key] = (list(pool.block_table(key)), pool.num_tokens(key))
    figures = [(f.model.name, f.used_blocks, f.cached_blocks, f.format_pages)
               for f in svc.model_figures()]
    tier = svc.host_tier
    assert tier is not None
    pages = svc.formats.pages
    return (models, tables, figures, list(pages.owner), pages.moves_total, pages.parked,
            dict(tier.slot_of), list(tier.lru), [f.pool.stats() for f in svc.models.formats])


def restarted(svc: PoolService, clock: HandClock) -> PoolService:
    """The next daemon's service, with `svc`'s image read back as a snapshot reads it."""
    image = msgpack.unpackb(msgpack.packb(service_image(svc), use_bin_type=True),
                            raw=False, strict_map_key=False)
    again = service("next", clock)
    restore_service(again, image, adopted_from=svc.pool_id)
    again.check_invariants()
    return again


async def busy_service(clock: HandClock, seed: int) -> tuple[PoolService, list[Session]]:
    """Four models, six sessions, random calls: pages moved, blocks cached and offloaded."""
    svc = service("first", clock)
    svc.register_model("tiny-ft", KvShape(2, 2, 64, "float32"), "unix:/run/ft.sock")
    svc.register_model("half", HALF, "unix:/run/half.sock")
    svc.register_model("sleepy", HALF)
    sessions = [svc.open_session(f"{model}-{i}", cache_salt=b"shared" if i else b"",
                                 model=model)
                for model in ("", "tiny-ft", "half") for i in range(2)]
    await random_calls(svc, sessions, random.Random(seed), 120, svc.check_invariants)
    await svc.set_model_state("sleepy", asleep=True)
    return svc, sessions


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**16))
async def test_models_formats_and_pages_come_back_and_go_on_alike(seed: int) -> None:
    clock = HandClock()
    svc, sessions = await busy_service(clock, seed)
    again = restarted(svc, clock)
    assert state(again) == state(svc)
    assert again.model_figures()[3].model.asleep  # sleepy still sleeps
    # Both go on alike: the same random calls get the same answers and leave the same state.
    mine = [again.sessions.peek(s.session_id) for s in sessions]
    assert all(s is not None for s in mine)
    refused = [await random_calls(svc, sessions, random.Random(seed + 100), 60,
                                  svc.check_invariants),
               await random_calls(again, mine, random.Random(seed + 100), 60,  # type: ignore[arg-type]
                                  again.check_invariants)]
    assert refused[0] == refused[1]
    assert state(again) == state(svc)


async def test_other_model_policies_refuse_the_image() -> None:
    clock = HandClock()
    svc, _ = await busy_service(clock, 0)
    assert svc.page_moves_total  # pages went between formats: the image says where
    image = service_image(svc)
    other = service("next", clock, policies={})
    with pytest.raises(NotKept, match="model policies"):
        restore_service(other, image, adopted_from="first")
