"""Metrics read at scrape time, RPC counters, and the HTTP probes on a real aiohttp server."""

from collections.abc import AsyncIterator
from dataclasses import replace

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.daemon.core.types import PoolStats
from pagedkv.daemon.metrics import PoolCollector, Readiness, RpcMetrics, metrics_app, start_http

EMPTY = PoolStats(num_blocks=8, block_size=16, free_blocks=8, used_blocks=0, cached_blocks=0,
                  pending_blocks=0, filled_slots=0, allocated_slots=0, logical_tokens=0,
                  num_sequences=0, prefix_cache_queries=0, prefix_cache_hits=0)


class FakeService:
    """Stands in for PoolService: the figures the collector reads."""

    def __init__(self) -> None:
        self.stats = EMPTY
        self.num_sessions = 0
        self.lease_expiries_total = 0

    def pool_stats(self) -> PoolStats:
        return self.stats


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape, keyed by name and sorted labels."""
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_pool_figures_are_read_at_each_scrape() -> None:
    service = FakeService()
    registry = CollectorRegistry()
    registry.register(PoolCollector(service))
    before = samples(registry)
    assert before[("pagedkv:kv_cache_usage_perc", ())] == 0.0
    assert before[("pagedkv:free_blocks", ())] == 8

    # 3 of 8 blocks used, 40 of 48 slots filled, one cached block, a prefix hit.
    service.stats = replace(EMPTY, free_blocks=5, used_blocks=3, cached_blocks=1,
                            filled_slots=40, allocated_slots=48, num_sequences=2,
                            prefix_cache_queries=32, prefix_cache_hits=16)
    service.num_sessions, service.lease_expiries_total = 2, 1
    after = samples(registry)
    assert after[("pagedkv:kv_cache_usage_perc", ())] == 3 / 8
    assert after[("pagedkv:used_blocks", ())] == 3
    assert after[("pagedkv:cached_blocks", ())] == 1
    assert after[("pagedkv:num_sequences", ())] == 2
    assert after[("pagedkv:num_sessions", ())] == 2
    assert after[("pagedkv:prefix_cache_queries_total", ())] == 32
    assert after[("pagedkv:prefix_cache_hits_total", ())] == 16
    assert after[("pagedkv:lease_expiries_total", ())] == 1
    assert after[("pagedkv:kv_cache_utilization", ())] == 40 / 48


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
async def http() -> AsyncIterator[tuple[str, FakeService, Readiness]]:
    service, readiness = FakeService(), Readiness(pool_allocated=True)
    registry = CollectorRegistry()
    registry.register(PoolCollector(service))
    runner = await start_http(metrics_app(registry, readiness), "127.0.0.1", 0)
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", service, readiness
    await runner.cleanup()


async def test_http_endpoints(http: tuple[str, FakeService, Readiness]) -> None:
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
        service.stats = replace(EMPTY, used_blocks=2, free_blocks=6)
        async with session.get(f"{base}/metrics") as response:
            assert response.status == 200
            assert response.headers["Content-Type"].startswith("text/plain")
            assert "pagedkv:kv_cache_usage_perc 0.25" in await response.text()
