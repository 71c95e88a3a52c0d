"""A bystander's wait behind the largest call one client may make, with and without max_call_work.

Issue 17 #12: a Batch of 1,024 Commits, each naming the 4,096 sequences of its session, answers
a few kilobytes yet held the pool lock for 0.85 s; another client's Allocate + Free waited as
long. `max_call_work` (daemon/service/call_work.py) refuses such a call before the lock; the most a
client can then ask in one call is max_call_work items (here: Commits of 4,096 seq ids each).

Measured in process, through the service layer (`PoolService`, a real `BlockPool`, no pool
memory, no gRPC), one asyncio loop: the attacker's call starts, the bystander's Allocate(1 token)
+ Free of another session arrives just after it, and is timed from then until it is answered
(the attacker's call runs first). The median of ROUNDS rounds each:

    bystander_wait_ms_unbounded   the attacker sends the issue's Batch (max_call_work raised to
                                  its maximum, 2^24, which lets it through)
    bystander_wait_ms_bounded     default limits: that Batch is refused (counted below), so the
                                  attacker sends the largest Batch of Commits the limit allows
    bystander_wait_ratio_unbounded_vs_bounded
    attacker_batch_refused        1 when the default limits refused the issue's Batch

Usage: python benchmarks/bench_call_work.py [--rounds N]
"""

import argparse
import asyncio
import statistics
import time

from pagedkv.daemon.core import BlockPool, InvalidArgument
from pagedkv.daemon.service.limits import LIMITS, Limits
from pagedkv.daemon.service.operations import Allocate, Commit, Free, Operation
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.process import log_setup

BLOCK_SIZE = 16
# The attacker's session: as many sequences as a session may hold by default, a block each.
SEQS = 4096
# Commit ops in the Batch.
COMMITS = 1024
ROUNDS = 5


async def attacker_and_bystander(limits: Limits) -> tuple[PoolService, str, str]:
    """A service with the attacker's SEQS sequences, and the bystander's session."""
    service = PoolService(BlockPool(2 * SEQS, BLOCK_SIZE), None, pool_id="bench", limits=limits)
    attacker = service.open_session("attacker", lease_ttl_ms=600_000).session_id
    for first in range(0, SEQS, limits.max_batch_ops):
        await service.batch(attacker, [Allocate(seq, BLOCK_SIZE)
                                       for seq in range(first, first + limits.max_batch_ops)])
    bystander = service.open_session("bystander", lease_ttl_ms=600_000).session_id
    return service, attacker, bystander


async def bystander_wait_ms(service: PoolService, attacker: str, bystander: str,
                            ops: list[Operation], round_: int) -> float:
    """The bystander's Allocate + Free arriving just after the attacker's Batch: the time
    from its arrival to its answer (the attacker's call runs first, holding loop and lock)."""

    async def allocate_free() -> float:
        await service.allocate(bystander, Allocate(round_, 1))
        await service.free(bystander, Free(round_))
        return time.perf_counter()

    start = time.perf_counter()
    attack = asyncio.create_task(service.batch(attacker, ops))
    done = await asyncio.create_task(allocate_free())
    await attack
    return (done - start) * 1000


async def main(rounds: int) -> None:
    log_setup.configure("warning", "console")
    every = Commit(list(range(SEQS)), [])
    unbounded = Limits(max_call_work=LIMITS["max_call_work"].maximum)
    service, attacker, bystander = await attacker_and_bystander(unbounded)
    waits = {"unbounded": [await bystander_wait_ms(service, attacker, bystander,
                                                   [every] * COMMITS, r) for r in range(rounds)]}
    bounded = Limits()
    service, attacker, bystander = await attacker_and_bystander(bounded)
    try:
        await service.batch(attacker, [every] * COMMITS)
        refused = 0
    except InvalidArgument:
        refused = 1
    largest = bounded.max_call_work // (1 + SEQS)  # an op and its seq ids
    waits["bounded"] = [await bystander_wait_ms(service, attacker, bystander,
                                                [every] * largest, r) for r in range(rounds)]
    medians = {name: statistics.median(values) for name, values in waits.items()}
    for name, median in medians.items():
        print(f"bystander_wait_ms_{name}: {median:.1f} ms "
              f"(rounds: {', '.join(f'{v:.1f}' for v in waits[name])})")
    print(f"bystander_wait_ratio_unbounded_vs_bounded: "
          f"{medians['unbounded'] / medians['bounded']:.1f} ratio")
    print(f"attacker_batch_refused: {refused} (largest Batch allowed: {largest} Commits of "
          f"{SEQS} seq ids)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    asyncio.run(main(parser.parse_args().rounds))
