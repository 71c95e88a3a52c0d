"""A running pagedkvd seen from outside: metrics, HTTP probes, gRPC health and reflection."""

from collections.abc import Iterator
from pathlib import Path

import aiohttp
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from pagedkv.client import PoolClient

from pagedkvd_process import Pagedkvd, free_tcp_port, pagedkvd

BLOCK_SIZE = 16
NUM_BLOCKS = 128


@pytest.fixture(scope="module")
def daemon() -> Iterator[tuple[Pagedkvd, str]]:
    """One daemon for the module, with its metrics endpoint on a free loopback port."""
    port = free_tcp_port()
    with pagedkvd("--num-blocks", str(NUM_BLOCKS), "--block-size", str(BLOCK_SIZE),
                  "--metrics-listen", f"127.0.0.1:{port}") as running:
        yield running, f"http://127.0.0.1:{port}"
        assert running.stop() == 0


async def scrape(base: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    async with aiohttp.ClientSession() as http, http.get(f"{base}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
          **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


async def test_metrics_move_after_an_allocate(daemon: tuple[Pagedkvd, str]) -> None:
    running, base = daemon
    before = await scrape(base)
    assert value(before, "pagedkv:num_blocks") == NUM_BLOCKS
    assert value(before, "pagedkv:used_blocks") == 0
    assert value(before, "pagedkv:kv_cache_usage_perc") == 0

    prompt = list(range(40))  # 40 tokens: 3 blocks of 16
    async with await PoolClient.connect(running.unix_target) as client:
        session = await client.open_session("metrics-test")
        await session.allocate(1, token_ids=prompt)
        await session.commit([1])  # its K/V is written (by a runner): the full blocks are shared
        await session.allocate(2, token_ids=prompt)  # the 2 full blocks come from the cache
        during = await scrape(base)
        await session.close()

    assert value(during, "pagedkv:used_blocks") == 4  # 2 shared full blocks + 2 partial ones
    assert value(during, "pagedkv:kv_cache_usage_perc") == 4 / NUM_BLOCKS
    assert value(during, "pagedkv:num_sessions") == 1
    assert value(during, "pagedkv:num_sequences") == 2
    assert value(during, "pagedkv:prefix_cache_hits_total") == 2 * BLOCK_SIZE
    assert value(during, "pagedkv:prefix_cache_queries_total") >= 2 * BLOCK_SIZE
    kvpool = {"service": "pagedkv.v1.KVPool"}
    assert value(during, "pagedkv:rpc_requests_total", **kvpool, method="Allocate",
                 code="OK") == 2
    assert value(during, "pagedkv:rpc_duration_seconds_count", **kvpool,
                 method="Allocate") == 2
    for name in ("pagedkv:free_blocks", "pagedkv:cached_blocks", "pagedkv:lease_expiries_total",
                 "pagedkv:kv_cache_slot_fill_ratio"):
        assert (name, frozenset()) in during


async def test_http_probes_answer(daemon: tuple[Pagedkvd, str]) -> None:
    _, base = daemon
    async with aiohttp.ClientSession() as http:
        for path, body in (("/healthz", "ok\n"), ("/readyz", "ready\n")):
            async with http.get(f"{base}{path}") as response:
                assert (response.status, await response.text()) == (200, body)


@pytest.mark.parametrize("service", ["", "pagedkv.v1.KVPool"])
async def test_grpc_health_is_serving(daemon: tuple[Pagedkvd, str], service: str) -> None:
    running, _ = daemon
    async with grpc.aio.insecure_channel(running.unix_target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_reflection_lists_the_services(daemon: tuple[Pagedkvd, str]) -> None:
    running, _ = daemon
    async with grpc.aio.insecure_channel(running.unix_target) as channel:
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        (reply,) = [reply async for reply in stream]
    names = {service.name for service in reply.list_services_response.service}
    assert {"pagedkv.v1.KVPool", "grpc.health.v1.Health"} <= names


async def test_metrics_ask_for_the_token_of_metrics_token_file(tmp_path: Path) -> None:
    token = tmp_path / "metrics.token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    port = free_tcp_port()
    with pagedkvd("--num-blocks", "8", "--metrics-listen", f"127.0.0.1:{port}",
                  "--metrics-token-file", str(token)) as running:
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as http:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                async with http.get(f"{base}/metrics", headers=headers) as response:
                    assert response.status == 401, headers
                    assert response.headers["WWW-Authenticate"] == "Bearer"
                    assert "pagedkv:" not in await response.text()
            async with http.get(f"{base}/metrics",
                                headers={"Authorization": "Bearer s3cret"}) as response:
                assert response.status == 200
                assert "pagedkv:tenant_sessions" in await response.text()
            async with http.get(f"{base}/healthz") as response:  # probes need no token
                assert response.status == 200
        assert running.stop() == 0
