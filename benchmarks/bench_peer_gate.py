"""What the peer-credential gate costs a unix caller: round trips with and without it.

Two real `pagedkvd` processes run side by side on private unix sockets: "direct" (no tenant
lists uids: gRPC serves the socket) and "gate" (a tenant lists this process's uid: the gate
serves the socket, reads the caller's uid and copies bytes to gRPC's own socket). The timed
calls alternate between the two in rounds, so a shared VM's drift falls on both alike.
Figures, one per line:

    keepalive_p50_us_{direct,gate}, keepalive_p99_us_...   one KeepAlive (a tiny call), one
                                                           client, one call at a time
    keepalive_p50_ratio                                    gate / direct
    tables_p50_ms_{direct,gate}, tables_p50_ratio          GetBlockTables of TABLE_SEQS
                                                           sequences of TABLE_BLOCKS blocks (an
                                                           answer of about 70 KB)
    calls_per_s_{direct,gate}, calls_per_s_ratio           KeepAlives per second from
                                                           CONCURRENT clients, each on its own
                                                           connection, for CONCURRENT_S seconds

Usage: python benchmarks/bench_peer_gate.py
"""

import asyncio
import functools
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc
import numpy as np
from daemon_process import running_pagedkvd

from pagedkv.client import PoolClient, Session

ROUNDS = 10
CALLS_PER_ROUND = 300
WARMUP_CALLS = 200
TABLE_SEQS = 16
TABLE_BLOCKS = 1024
TABLE_CALLS_PER_ROUND = 20
CONCURRENT = 16
CONCURRENT_S = 5.0
# A pool for one sequence of TABLE_BLOCKS blocks (its forks share them), with room to spare.
DAEMON_ARGS = ("--num-blocks", str(2 * TABLE_BLOCKS), "--log-level", "warning")


@contextmanager
def daemons() -> Iterator[dict[str, str]]:
    """Both daemons, started; their targets by name."""
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="pkv-gate-bench-") as name:
        config = Path(name) / "uids.toml"
        config.write_text(f"[tenants.bench]\nuids = [{os.getuid()}]\n")
        direct = stack.enter_context(running_pagedkvd(*DAEMON_ARGS))
        gate = stack.enter_context(running_pagedkvd(*DAEMON_ARGS, "--config", str(config)))
        yield {"direct": direct.target, "gate": gate.target}


async def own_client(target: str) -> PoolClient:
    """A client on a connection of its own (grpc shares one per target unless told not to)."""
    channel = grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    await asyncio.wait_for(channel.channel_ready(), 30)
    return PoolClient(channel)


async def timed(call: Callable[[], Awaitable[object]], count: int) -> list[float]:
    """Seconds each of `count` calls took, one after another."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        await call()
        times.append(time.perf_counter() - start)
    return times


async def prepare_tables(session: Session) -> None:
    """TABLE_SEQS sequences of TABLE_BLOCKS blocks each (forks of the first: no memory more)."""
    await session.allocate(0, TABLE_BLOCKS * 16)
    for seq_id in range(1, TABLE_SEQS):
        await session.fork(0, seq_id)


async def round_trips(targets: dict[str, str]) -> None:
    clients = {name: await own_client(target) for name, target in targets.items()}
    sessions = {name: await client.open_session("bench") for name, client in clients.items()}
    keepalive: dict[str, list[float]] = {name: [] for name in targets}
    tables: dict[str, list[float]] = {name: [] for name in targets}
    seq_ids = list(range(TABLE_SEQS))
    for session in sessions.values():
        await prepare_tables(session)
        await timed(session.keep_alive, WARMUP_CALLS)
    for _ in range(ROUNDS):
        for name, session in sessions.items():
            keepalive[name] += await timed(session.keep_alive, CALLS_PER_ROUND)
            tables[name] += await timed(functools.partial(session.block_tables, seq_ids),
                                        TABLE_CALLS_PER_ROUND)
    for client in clients.values():
        await client.close()
    p50 = {name: float(np.percentile(times, 50)) for name, times in keepalive.items()}
    for name, times in keepalive.items():
        print(f"keepalive_p50_us_{name}: {p50[name] * 1e6:.1f} us")
        print(f"keepalive_p99_us_{name}: {float(np.percentile(times, 99)) * 1e6:.1f} us")
    print(f"keepalive_p50_ratio: {p50['gate'] / p50['direct']:.2f} ratio")
    table_p50 = {name: float(np.percentile(times, 50)) for name, times in tables.items()}
    for name in targets:
        print(f"tables_p50_ms_{name}: {table_p50[name] * 1e3:.3f} ms")
    print(f"tables_p50_ratio: {table_p50['gate'] / table_p50['direct']:.2f} ratio")


async def throughput(targets: dict[str, str]) -> None:
    """KeepAlives per second from CONCURRENT clients together, in alternating rounds."""
    clients = {name: [await own_client(target) for _ in range(CONCURRENT)]
               for name, target in targets.items()}
    sessions = {name: [await client.open_session("load") for client in group]
                for name, group in clients.items()}
    calls = dict.fromkeys(targets, 0)

    async def load(session: Session, deadline: float) -> int:
        done = 0
        while time.perf_counter() < deadline:
            await session.keep_alive()
            done += 1
        return done

    for _ in range(ROUNDS):
        for name, group in sessions.items():
            deadline = time.perf_counter() + CONCURRENT_S / ROUNDS
            calls[name] += sum(await asyncio.gather(*(load(s, deadline) for s in group)))
    for pool_clients in clients.values():
        for client in pool_clients:
            await client.close()
    rates = {name: count / CONCURRENT_S for name, count in calls.items()}
    for name, rate in rates.items():
        print(f"calls_per_s_{name}: {rate:.0f} calls/s")
    print(f"calls_per_s_ratio: {rates['gate'] / rates['direct']:.2f} ratio")


def main() -> None:
    with daemons() as targets:
        asyncio.run(round_trips(targets))
        asyncio.run(throughput(targets))


if __name__ == "__main__":
    main()
