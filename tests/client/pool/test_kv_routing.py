"""Routing across three daemons by their KV events (issue 22): the events are worth publishing
only if a router that reads nothing else sends requests where their prefixes are, and the hits
then happen.

Three real `pagedkvd` processes on loopback, each with a pool of 32 blocks of 4 tokens and its
own KV events endpoints; tests/support/kv_router.py subscribes to all three and indexes their
blocks by chained token ids. A workload of shared-prefix groups (a prompt: the group's 2-block
prefix, a block of its own, 2 more tokens) is served by allocating each prompt with its token
ids in the chosen daemon, committing it (a committed block under a salt is what is published)
and freeing it (its blocks stay cached). The router waits until it has indexed a request's
blocks before it routes the next one, so the outcome does not depend on timing.

Asserted: every later request of a group goes to the daemon its first one went to and finds
the group's prefix cached there (num_cached_tokens = the prefix); the same workload routed round
robin gets strictly fewer cached tokens; and once a daemon evicts a group's prefix (its pool
filled with other tokens), its BlockRemoved events stop the router from sending the group there.
"""

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import msgpack
import pytest

from pagedkv.client import PoolClient
from pagedkv.client.pool.session import Session
from pagedkv.process.launch import READY_STATE, Launched

from kv_router import EventSource, Feed, KvRouter, decode_events
from pagedkvd_process import free_tcp_port, pagedkvd

BLOCK = 4
NUM_BLOCKS = 32
DAEMONS = ("pod-0", "pod-1", "pod-2")
GROUPS, PER_GROUP = 4, 4
PREFIX_TOKENS = 2 * BLOCK
SALT = b"shared"
# Token ids of the round-robin run: the same workload, sharing nothing with the first run.
SECOND_RUN = 500
FILLER = 950


@dataclass
class Served:
    """One request's outcome."""

    group: int
    daemon: str
    # Tokens of its prefix the router found indexed on `daemon`.
    matched_tokens: int
    # Tokens the daemon found in its prefix cache.
    cached_tokens: int


def prompt(group: int, request: int, offset: int = 0) -> list[int]:
    """The group's prefix, a block of the request's own, two more tokens."""
    base = offset + 100 * group
    own = [base + 10 + BLOCK * request + i for i in range(BLOCK)]
    return [base + i for i in range(PREFIX_TOKENS)] + own + [base + 90, base + 91]


def workload(offset: int = 0) -> Iterator[tuple[int, list[int]]]:
    """The groups' requests interleaved: each group's first request, then each's second..."""
    for request in range(PER_GROUP):
        for group in range(GROUPS):
            yield group, prompt(group, request, offset)


class Cluster:
    """The daemons, a session with the shared salt on each, and the router."""

    def __init__(self, router: KvRouter, sessions: dict[str, Session]) -> None:
        self.router = router
        self.sessions = sessions
        self.next_seq = 1

    async def serve(self, daemon: str, tokens: list[int]) -> int:
        """Allocate `tokens` in `daemon`, commit, free; wait until the router indexed its full
        blocks there. The tokens found cached."""
        session, seq = self.sessions[daemon], self.next_seq
        self.next_seq += 1
        cached = (await session.allocate(seq, token_ids=tokens)).num_cached_tokens
        await session.commit([seq])
        await session.free(seq)
        await asyncio.to_thread(self.router.wait_until,
                                lambda: self.router.holds(daemon, tokens))
        return cached

    async def routed(self, group: int, tokens: list[int]) -> Served:
        route = self.router.route(tokens)
        cached = await self.serve(route.daemon, tokens)
        return Served(group, route.daemon, route.matched_tokens, cached)

    async def round_robin(self, offset: int) -> list[Served]:
        served = []
        for number, (group, tokens) in enumerate(workload(offset)):
            daemon = DAEMONS[number % len(DAEMONS)]
            served.append(Served(group, daemon, 0, await self.serve(daemon, tokens)))
        return served

    async def fill(self, daemon: str) -> None:
        """Take every block of `daemon`'s pool with uncommitted tokens, evicting every cached
        block, then free them."""
        session, seq = self.sessions[daemon], self.next_seq
        self.next_seq += 1
        await session.allocate(seq, token_ids=[FILLER] * (NUM_BLOCKS * BLOCK))
        await session.free(seq)


def daemon_args(name: str, pub_port: int, replay_port: int) -> tuple[str, ...]:
    """pagedkvd's flags: a tiny pool; its PUB connects to the router's SUB (a host name:
    connected), its ROUTER is bound; every salt published (no tenants here)."""
    return ("--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK),
            "--kv-events-endpoint", f"tcp://127.0.0.1:{pub_port}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
            "--kv-events-topic", f"kv@{name}@", "--kv-events-all-salts")


@contextlib.asynccontextmanager
async def cluster() -> AsyncIterator[Cluster]:
    """The router bound first, then the three daemons started at once."""
    ports = {name: (free_tcp_port(), free_tcp_port()) for name in DAEMONS}
    router = KvRouter([EventSource(name, f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}")
                       for name, (pub, replay) in ports.items()], BLOCK)
    try:
        with contextlib.ExitStack() as stack:
            daemons: dict[str, Launched] = {
                name: stack.enter_context(pagedkvd(*daemon_args(name, *ports[name]),
                                                   wait_ready=False))
                for name in DAEMONS}
            for daemon in daemons.values():
                daemon.wait_for_notification(READY_STATE)
            async with contextlib.AsyncExitStack() as clients:
                sessions = {}
                for name, daemon in daemons.items():
                    client = await clients.enter_async_context(
                        await PoolClient.connect(daemon.unix_target))
                    sessions[name] = await client.open_session(name, cache_salt=SALT)
                yield Cluster(router, sessions)
    finally:
        router.close()


def cached_total(served: list[Served]) -> int:
    return sum(s.cached_tokens for s in served)


async def test_events_route_each_group_to_its_prefix_and_eviction_moves_it() -> None:
    async with cluster() as nodes:
        by_events = [await nodes.routed(group, tokens) for group, tokens in workload()]
        await evicted_group_moves(nodes, by_events)
        by_turns = await nodes.round_robin(SECOND_RUN)
    assert nodes.router.index.unanchored == 0
    home = {s.group: s.daemon for s in by_events[:GROUPS]}
    assert len(set(home.values())) == len(DAEMONS)  # no hit: least loaded, so spread
    for later in by_events[GROUPS:]:
        assert later.daemon == home[later.group]
        assert later.matched_tokens == later.cached_tokens == PREFIX_TOKENS
    assert cached_total(by_events) == GROUPS * (PER_GROUP - 1) * PREFIX_TOKENS
    assert cached_total(by_events) > cached_total(by_turns) > 0


async def evicted_group_moves(nodes: Cluster, by_events: list[Served]) -> None:
    """Group 0's prefix served on a second daemon too; its first daemon then evicts it: the
    router sends group 0 to the second one only, and the hit happens there."""
    first = by_events[0].daemon
    second = next(name for name in DAEMONS if name != first)
    assert await nodes.serve(second, prompt(0, PER_GROUP)) == 0
    prefix = prompt(0, 0)[:PREFIX_TOKENS]
    assert nodes.router.holds(first, prefix) and nodes.router.holds(second, prefix)
    await nodes.fill(first)
    await asyncio.to_thread(nodes.router.wait_until,
                            lambda: not nodes.router.holds(first, prefix[:BLOCK]))
    for request in range(PER_GROUP + 1, PER_GROUP + 4):
        moved = await nodes.routed(0, prompt(0, request))
        assert (moved.daemon, moved.matched_tokens, moved.cached_tokens) == \
            (second, PREFIX_TOKENS, PREFIX_TOKENS)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_the_router_reads_both_event_encodings(encoding: str) -> None:
    """vLLM wrote each event as an array [tag, fields...] before it switched to maps tagged
    under "type" (vllm-project/vllm#42892); the daemon writes maps, routers meet both."""
    stored = {"type": "BlockStored", "block_hashes": [7, 8], "parent_block_hash": None,
              "token_ids": [1, 2, 3, 4, 5, 6, 7, 8], "block_size": BLOCK}
    removed = {"type": "BlockRemoved", "block_hashes": [8]}
    events = [stored, removed] if encoding == "map" else [
        ["BlockStored", [7, 8], None, [1, 2, 3, 4, 5, 6, 7, 8], BLOCK], ["BlockRemoved", [8]]]
    payload = msgpack.packb([1.0, events, 0])
    assert [tag for tag, _ in decode_events(payload)] == ["BlockStored", "BlockRemoved"]
    router = KvRouter([], BLOCK)
    try:
        router.feeds["pod-0"] = Feed()
        router.apply("pod-0", payload)
        assert router.holds("pod-0", [1, 2, 3, 4])
        assert not router.holds("pod-0", [1, 2, 3, 4, 5, 6, 7, 8])  # block 8 removed
        assert router.route([1, 2, 3, 4, 9]).matched_tokens == BLOCK
    finally:
        router.close()
