"""Random calls of a service's sessions (allocate, append, free, commit, copy-on-write, and
failing batches that are undone), and the committed blocks of every format read from the core:
what the KV events a subscriber reads, and the host tier's copies, must agree with."""

import random

from pagedkv.daemon.core import BlockPool, PoolError
from pagedkv.daemon.service.kv_events import hash64
from pagedkv.daemon.service.operations import Allocate, Append, Commit, CopyOnWrite, Free
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.sessions import Session

# Private sessions' prompts use these ids, shared ones the others: a published block's
# tokens tell which it was.
PRIVATE_IDS = range(10, 13)
SHARED_IDS = range(3)


def committed(svc: PoolService, roots: set[bytes]) -> set[tuple[int, int, tuple[int, ...],
                                                                  int | None]]:
    """Every committed block of every format, from the core: (format, hash, tokens,
    parent hash or None for a chain's first block)."""
    found = set()
    for fmt in svc.models.formats:
        assert isinstance(fmt.pool, BlockPool)
        blocks = list(fmt.pool._blocks.cache.block_of.values())
        keys, parents, tokens = fmt.pool.block_content(blocks)
        for key, parent, ids in zip(keys, parents, tokens.tolist(), strict=True):
            found.add((fmt.number, hash64(key), tuple(ids),
                       None if parent in roots else hash64(parent)))
    return found


async def random_calls(svc: PoolService, sessions: list[Session], rng: random.Random,
                       steps: int, check: object) -> int:
    """Random calls of the sessions; returns how many were refused."""
    next_id, refused = 1, 0
    for _ in range(steps):
        session = rng.choice(sessions)
        live = sorted(session.seq_ids)
        kind = rng.choice(["allocate", "allocate", "append", "free", "commit", "commit",
                           "cow"])
        if kind != "allocate" and not live:
            kind = "allocate"
        ids = PRIVATE_IDS if session.private_salt else SHARED_IDS
        try:
            if kind == "allocate":
                n = rng.randrange(1, 20)
                await svc.allocate(session.session_id, Allocate(
                    next_id, n, [rng.choice(ids) for _ in range(n)]))
                next_id += 1
            elif kind == "append":
                k = rng.randrange(1, 6)
                await svc.batch(session.session_id, [Append(
                    rng.choice(live), k, [rng.choice(ids) for _ in range(k)])])
            elif kind == "free":
                await svc.free(session.session_id, Free(rng.choice(live)))
            elif kind == "cow":
                await svc.copy_on_write(session.session_id, CopyOnWrite(rng.choice(live), 0))
            else:  # a commit, sometimes with a failing op after it: undone, events too
                ops: list[object] = [Commit(live)]
                if rng.random() < 0.3:
                    ops.append(Free(10**6))
                await svc.batch(session.session_id, ops)  # type: ignore[arg-type]
        except PoolError:
            refused += 1
        assert callable(check)
        check()
    return refused
