"""Metrics read at scrape time, RPC counters, and the HTTP probes on a real aiohttp server."""

from collections.abc import AsyncIterator

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.edge.metrics import PoolCollector, Readiness, RpcMetrics
from pagedkv.daemon.service.operations import Allocate, Commit
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.process.probes import metrics_app, start_http

# The pool's lease clock, moved by hand.
Clock = list[float]


def make_service(clock: Clock) -> PoolService:
    """A real service over a real pool of 8 blocks of 16 slots, on a clock the test moves."""
    return PoolService(BlockPool(8, 16), None, pool_id="metrics", clock=lambda: clock[0])


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, keyed by name and sorted labels."""
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_pool_figures_are_read_at_each_scrape() -> None:
    clock = [0.0]
    service = make_service(clock)
    registry = CollectorRegistry()
    registry.register(PoolCollector(service))
    before = samples(registry)
    assert before[("pagedkv:kv_cache_usage_perc", ())] == 0.0
    assert before[("pagedkv:free_blocks", ())] == 8
    # No slot allocated: no fill ratio at all, rather than a vacuous 1.0.
    assert ("pagedkv:kv_cache_slot_fill_ratio", ()) not in before

    # a and b share a 40-token prompt under one salt: a commits its full blocks 0 and 1 (its
    # K/V is written), b finds those 32 tokens cached; 2 and 3 are their partial last blocks.
    # c's one full block, committed under a shared salt, is cached (evictable) once c's lease
    # lapses and the reaper frees its sequence (a private salt's would be dropped: no one
    # could hit it); d's, never committed, stays pending.
    prompt = list(range(100, 140))
    for name in ("a", "b"):
        sid = service.open_session(name, cache_salt=b"team").session_id
        await service.allocate(sid, Allocate(1, 40, prompt))
        await service.commit(sid, Commit([1]))
    lapsing = service.open_session("c", lease_ttl_ms=100, cache_salt=b"c-team").session_id
    await service.allocate(lapsing, Allocate(1, 16, list(range(16))))
    await service.commit(lapsing, Commit([1]))
    pending = service.open_session("d").session_id
    await service.allocate(pending, Allocate(1, 16, list(range(16))))
    clock[0] += 0.2
    assert await service.expire_due() == 1
    after = samples(registry)
    assert after[("pagedkv:kv_cache_usage_perc", ())] == 5 / 8
    assert after[("pagedkv:used_blocks", ())] == 5
    assert after[("pagedkv:cached_blocks", ())] == 1
    assert after[("pagedkv:pending_blocks", ())] == 1
    assert after[("pagedkv:free_blocks", ())] == 3  # cached blocks count as free
    assert after[("pagedkv:num_sequences", ())] == 3
    assert after[("pagedkv:num_sessions", ())] == 3
    assert after[("pagedkv:prefix_cache_queries_total", ())] == 40 + 40 + 16 + 16
    assert after[("pagedkv:prefix_cache_hits_total", ())] == 32
    assert after[("pagedkv:lease_expiries_total", ())] == 1
    # Filled slots / slots of used blocks: (16 + 16 + 8 + 8 + 16) / (5 * 16).
    assert after[("pagedkv:kv_cache_slot_fill_ratio", ())] == 64 / 80


def test_rpc_metrics_count_by_code_and_time_by_method() -> None:
    registry = CollectorRegistry()
    rpc = RpcMetrics(registry)
    rpc.observe("pagedkv.v1.KVPool", "Allocate", "OK", 0.0002)
    rpc.observe("pagedkv.v1.KVPool", "Allocate", "OK", 0.0004)
    rpc.observe("pagedkv.v1.KVPool", "Allocate", "NOT_FOUND", 0.0001)
    got = samples(registry)
    labels = (("method", "Allocate"), ("service", "pagedkv.v1.KVPool"))
    assert got[("pagedkv:rpc_requests_total", (("code", "OK"), *labels))] == 2
    assert got[("pagedkv:rpc_requests_total", (("code", "NOT_FOUND"), *labels))] == 1
    assert got[("pagedkv:rpc_duration_seconds_count", labels)] == 3
    assert got[("pagedkv:rpc_duration_seconds_bucket", (("le", "0.00025"), *labels))] == 2


@pytest.mark.parametrize(
    ("readiness", "reason"),
    [
        (Readiness(), "pool not allocated"),
        (Readiness(pool_allocated=True), "listeners not up"),
        (Readiness(pool_allocated=True, listeners_up=True, draining=True), "draining"),
        (Readiness(pool_allocated=True, listeners_up=True), None),
    ],
)
def test_readiness_reasons(readiness: Readiness, reason: str | None) -> None:
    assert readiness.reason_not_ready() == reason


@pytest.fixture
async def http() -> AsyncIterator[tuple[str, PoolService, Readiness]]:
    service, readiness = make_service([0.0]), Readiness(pool_allocated=True)
    registry = CollectorRegistry()
    registry.register(PoolCollector(service))
    runner = await start_http(metrics_app(registry, readiness.reason_not_ready), "127.0.0.1", 0)
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", service, readiness
    await runner.cleanup()


async def test_http_endpoints(http: tuple[str, PoolService, Readiness]) -> None:
    base, service, readiness = http
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{base}/healthz") as response:
            assert response.status == 200
        async with session.get(f"{base}/readyz") as response:
            assert response.status == 503
            assert "listeners not up" in await response.text()
        readiness.listeners_up = True
        async with session.get(f"{base}/readyz") as response:
            assert response.status == 200
        await service.allocate(service.open_session("h").session_id, Allocate(1, 20))  # 2 blocks
        async with session.get(f"{base}/metrics") as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            assert "pagedkv:kv_cache_usage_perc 0.25" in await response.text()
