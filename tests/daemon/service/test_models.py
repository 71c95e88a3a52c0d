"""Several models on one pool, at the service: random calls of three models (two geometries,
two models sharing one), with the invariants checked after every call and every refusal shown
to change nothing.

The pool: 8 pages of 16 KiB; "tiny" (the daemon's own, 8 KiB blocks: 2 a page) and "tiny-ft"
(its geometry: the same format), "half" (4 KiB blocks: 4 a page, capped at 20 blocks).
"""

import random
from itertools import pairwise

import pytest

from pagedkv.daemon.core import BlockPool, PoolError
from pagedkv.daemon.service.models import KvShape, ModelPolicy
from pagedkv.daemon.service.operations import Allocate, Append, Commit, Free
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.sessions import Session
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY

BLOCK = 4


def service(host_slots: int = 0) -> PoolService:
    pool = BlockPool(16, BLOCK, blocks_per_page=2)
    svc = PoolService(pool, None, pool_id="p", geometry=TINY_CPU_GEOMETRY, page_bytes=16384,
                      model_policies={"half": ModelPolicy(max_memory=20 * 4096)},
                      zero_freed_blocks=True)
    svc.register_model("tiny-ft", KvShape(2, 2, 64, "float32"))
    svc.register_model("half", KvShape(1, 2, 64, "float32"))
    if host_slots:  # the own format's (tiny, tiny-ft) evicted blocks go to a host tier
        svc.attach_host_tier(None, host_slots)
    return svc


def snapshot(svc: PoolService) -> object:
    """Everything a refused call must leave as it was."""
    tables = {}
    for session in svc.sessions:
        pool = svc.model_of(session).format.pool
        for seq_id in session.seq_ids:
            key = session.key(seq_id)
            tables[key] = (pool.block_table(key), pool.num_tokens(key))
    models = [(f.model.name, f.used_blocks, f.cached_blocks) for f in svc.model_figures()]
    tier = svc.host_tier
    host = None if tier is None else (dict(tier.slot_of), list(tier.lru), tier.stores)
    return tables, models, list(svc.formats.pages.owner), svc.page_moves_total, host


@pytest.mark.parametrize(("seed", "host_slots"), [(seed, 0) for seed in range(6)]
                         + [(seed, 8) for seed in range(3)])
async def test_random_calls_of_three_models_keep_every_invariant(seed: int,
                                                                 host_slots: int) -> None:
    rng = random.Random(seed)
    svc = service(host_slots)
    sessions: list[Session] = [
        svc.open_session(f"{model}-{i}", cache_salt=b"shared" if i else b"", model=model)
        for model in ("", "tiny-ft", "half") for i in range(2)]
    next_id = 1
    refused = 0
    own = svc.models.own.format
    pages = [svc.formats.pages.held(own)]  # the daemon's own format's pages after each call
    for _ in range(400):
        session = rng.choice(sessions)
        live = sorted(session.seq_ids)
        kind = rng.choice(["allocate", "allocate", "append", "free", "free", "commit"])
        if kind != "allocate" and not live:
            kind = "allocate"
        if kind == "allocate":
            n = rng.randrange(1, 20)
            prompt = [rng.randrange(3) for _ in range(n)]  # a tiny vocabulary: prefix hits
            op: object = Allocate(next_id, n, prompt)
            next_id += 1
        elif kind == "append":
            op = Append(rng.choice(live), rng.randrange(1, 6))
        elif kind == "free":
            op = Free(rng.choice(live))
        else:
            op = Commit(live)
        before = snapshot(svc)
        try:
            if isinstance(op, Free):
                await svc.free(session.session_id, op)
            elif isinstance(op, Commit):
                await svc.commit(session.session_id, op)
            else:
                await svc.allocate(session.session_id, op) if isinstance(op, Allocate) \
                    else await svc.append(session.session_id, op)  # type: ignore[arg-type]
        except PoolError:
            refused += 1
            assert snapshot(svc) == before, f"a refused {kind} changed something"
        svc.check_invariants()
        pages.append(svc.formats.pages.held(own))
        half = next(f for f in svc.model_figures() if f.model.name == "half")
        assert half.used_blocks + half.cached_blocks <= 20  # its cap
    assert refused  # the pool filled up at least once
    assert not host_slots or (svc.host_tier is not None and svc.host_tier.stores)
    assert min(pages) < 8  # pages went to half
    assert any(later > earlier for earlier, later in pairwise(pages))  # and came back
