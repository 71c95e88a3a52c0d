"""The server interceptor in the production gRPC server (in-process): auth, logs, metrics.

The daemon under test is built by `grpc_server`, as pagedkvd builds it;
tests/daemon/process/test_auth.py checks the same rules once more against a real pagedkvd
process.
"""

import io
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedkv.daemon.edge.interceptors import session_label
from pagedkv.daemon.edge.servicer import KVPoolServicer
from pagedkv.process.log_setup import RateLimitedLog, configure
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc

from daemon_harness import TOKEN, Daemon, running_daemon

KVPOOL = "pagedkv.v1.KVPool"


@pytest.fixture(autouse=True)
def log_stream(restore_root_logger: None) -> io.StringIO:
    stream = io.StringIO()
    configure("debug", "json", stream)
    return stream


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(tcp=True) as running:
        yield running


def bearer(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return None if token is None else (("authorization", f"Bearer {token}"),)


async def pool_id_over(target: str, token: str | None = None) -> str:
    async with grpc.aio.insecure_channel(target) as channel:
        info = await kvpool_pb2_grpc.KVPoolStub(channel).GetPoolInfo(
            pb.GetPoolInfoRequest(), metadata=bearer(token))
        return info.pool_id


async def list_services(target: str, token: str | None) -> set[str]:
    async with grpc.aio.insecure_channel(target) as channel:
        # A refused call gets no request: the server refuses at call start, and a message
        # still in flight then would fail on the client's side (INTERNAL) first.
        requests = [] if token is None else [reflection_pb2.ServerReflectionRequest(
            list_services="")]
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter(requests), metadata=bearer(token))
        return {service.name for reply in [reply async for reply in stream]
                for service in reply.list_services_response.service}


async def test_tcp_calls_need_the_token_unix_and_health_calls_do_not(daemon: Daemon) -> None:
    assert daemon.tcp_target is not None
    pool_id = daemon.service.pool_id
    assert await pool_id_over(daemon.unix_target) == pool_id
    assert await pool_id_over(daemon.tcp_target, TOKEN) == pool_id  # the same pool on TCP
    for token in (None, "wrong", ""):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pool_id_over(daemon.tcp_target, token)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # Streaming handlers are wrapped too: reflection is a stream-stream RPC.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await list_services(daemon.tcp_target, None)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert {KVPOOL, "grpc.health.v1.Health"} <= await list_services(daemon.tcp_target, TOKEN)
    async with grpc.aio.insecure_channel(daemon.tcp_target) as channel:
        for service in ("", KVPOOL):
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_health_watch_streams_through_the_interceptor(daemon: Daemon) -> None:
    # Watch writes with context.write instead of yielding: the wrapper must keep that shape.
    assert daemon.tcp_target is not None
    async with grpc.aio.insecure_channel(daemon.tcp_target) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        first = await watch.read()
        watch.cancel()
    assert first.status == health_pb2.HealthCheckResponse.SERVING


async def crash(self: KVPoolServicer, request: Any, context: Any) -> Any:
    raise RuntimeError("a bug that escaped grpc_errors")


async def test_outcomes_are_counted_and_logged_without_the_session_secret(
    log_stream: io.StringIO, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(KVPoolServicer, "GetStats", crash)  # before the server binds it
    async with running_daemon(tcp=True) as daemon, \
            grpc.aio.insecure_channel(daemon.unix_target) as unix, \
            grpc.aio.insecure_channel(str(daemon.tcp_target)) as tcp:
        stub, anonymous = kvpool_pb2_grpc.KVPoolStub(unix), kvpool_pb2_grpc.KVPoolStub(tcp)
        sid = (await stub.OpenSession(pb.OpenSessionRequest(client_name="t"))).session_id
        await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1, num_tokens=4))
        # Each call starts when it is made: make them one at a time, in this order.
        failing: list[tuple[Callable[[], Awaitable[object]], grpc.StatusCode]] = [
            (lambda: stub.Append(pb.AppendRequest(session_id=sid, seq_id=9, num_tokens=1)),
             grpc.StatusCode.NOT_FOUND),
            (lambda: stub.GetStats(pb.GetStatsRequest(session_id=sid)),
             grpc.StatusCode.UNKNOWN),
            (lambda: anonymous.Allocate(pb.AllocateRequest(session_id=sid, seq_id=2,
                                                           num_tokens=4)),
             grpc.StatusCode.UNAUTHENTICATED),
        ]
        for call, code in failing:
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await call()
            assert failure.value.code() == code
        assert daemon.pool.stats().used_blocks == 1  # the refused Allocate never ran

    def calls(method: str, code: str) -> float | None:
        labels = {"service": KVPOOL, "method": method, "code": code}
        return daemon.registry.get_sample_value("pagedkv:rpc_requests_total", labels)

    assert calls("OpenSession", "OK") == calls("Allocate", "OK") == 1
    assert calls("Append", "NOT_FOUND") == 1
    assert calls("GetStats", "UNKNOWN") == 1
    assert calls("Allocate", "UNAUTHENTICATED") == 1
    latency = daemon.registry.get_sample_value(
        "pagedkv:rpc_duration_seconds_count", {"service": KVPOOL, "method": "Allocate"})
    assert latency == 2

    lines = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    rpc_lines = [line for line in lines if line["event"] == "rpc"]
    assert [(line["method"], line["code"], line["level"], line["session"])
            for line in rpc_lines] == [
        ("OpenSession", "OK", "debug", None), ("Allocate", "OK", "debug", "#1"),
        ("Append", "NOT_FOUND", "warning", "#1"), ("GetStats", "UNKNOWN", "warning", "#1")]
    # Refused before its request is parsed (no session to name), and logged rate-limited.
    assert [(line["method"], line["count"]) for line in lines
            if line["event"] == "unauthenticated_calls"] == [("Allocate", 1)]
    # The bug's traceback is logged once, by the interceptor.
    assert [line["method"] for line in lines if line["event"] == "rpc_failed"] == ["GetStats"]
    assert sid.rpartition("-")[2] not in log_stream.getvalue()


async def test_malformed_requests_are_invalid_argument_counted_and_logged_rarely(
    daemon: Daemon, log_stream: io.StringIO,
) -> None:
    # Bytes that are no protobuf message: a field tag whose varint never ends.
    garbage = b"\xff" * 12
    assert daemon.tcp_target is not None
    async with grpc.aio.insecure_channel(daemon.tcp_target) as channel:
        allocate = channel.unary_unary("/pagedkv.v1.KVPool/Allocate")
        for _ in range(20):  # no token: refused before the bytes are looked at
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await allocate(garbage)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for _ in range(30):  # with the token: INVALID_ARGUMENT, not UNKNOWN
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await allocate(garbage, metadata=bearer(TOKEN))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid Allocate message" in str(refused.value.details())
    async with grpc.aio.insecure_channel(daemon.unix_target) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await channel.unary_unary("/pagedkv.v1.KVPool/Allocate")(garbage)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def calls(code: str) -> float | None:
        labels = {"service": KVPOOL, "method": "Allocate", "code": code}
        return daemon.registry.get_sample_value("pagedkv:rpc_requests_total", labels)

    assert calls("UNAUTHENTICATED") == 20
    assert calls("INVALID_ARGUMENT") == 31
    assert calls("UNKNOWN") is None
    lines = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    # One line for 31 malformed requests within the rate window, and one for 20 calls without
    # the token; no traceback, no error.
    for event in ("malformed_requests", "unauthenticated_calls"):
        assert [(line["level"], line["count"]) for line in lines
                if line["event"] == event] == [("warning", 1)]
    assert not [line for line in lines if line["event"] == "rpc" and line["level"] != "debug"]
    assert not [line for line in lines if line["level"] in ("error", "critical")]
    assert not [line for line in lines if "exception" in line]
    assert daemon.pool.stats().num_sequences == 0


def test_a_rate_limited_log_reports_what_it_held_back() -> None:
    now = [0.0]
    limit = RateLimitedLog(10.0, clock=lambda: now[0])
    assert limit.event() == 1  # the first at once
    assert [limit.event() for _ in range(5)] == [None] * 5
    now[0] = 10.0
    assert limit.event() == 6  # the five held back, and this one
    now[0] = 15.0
    assert limit.event() is None


@pytest.mark.parametrize(
    ("session_id", "label"),
    # Only an id of the shape sessions.py issues has a number (a short secret is no such id).
    [("pool-12-00ff00ff00ff00ff", "#12"), ("pool-12-00ff", "invalid"), ("garbage", "invalid"),
     ("", None)],
)
def test_session_label_never_shows_the_secret(session_id: str, label: str | None) -> None:
    assert session_label(pb.GetStatsRequest(session_id=session_id)) == label
    assert session_label(object()) is None


async def test_failed_calls_are_logged_rarely_for_every_caller(
    daemon: Daemon, log_stream: io.StringIO,
) -> None:
    # Issue 17 #15: a burst of failing calls, from a unix caller and an authenticated TCP one.
    burst = 200
    assert daemon.tcp_target is not None
    for target, metadata in ((daemon.unix_target, None), (daemon.tcp_target, bearer(TOKEN))):
        async with grpc.aio.insecure_channel(target) as channel:
            stub = kvpool_pb2_grpc.KVPoolStub(channel)
            sid = (await stub.OpenSession(pb.OpenSessionRequest(client_name="t"),
                                          metadata=metadata)).session_id
            for _ in range(burst):
                with pytest.raises(grpc.aio.AioRpcError) as failure:
                    await stub.Free(pb.FreeRequest(session_id=sid, seq_id=9), metadata=metadata)
                assert failure.value.code() == grpc.StatusCode.NOT_FOUND
    labels = {"service": KVPOOL, "method": "Free", "code": "NOT_FOUND"}
    assert daemon.registry.get_sample_value("pagedkv:rpc_requests_total", labels) == 2 * burst
    lines = [json.loads(line) for line in log_stream.getvalue().splitlines()]
    warnings = [line for line in lines if line["event"] == "rpc" and line["level"] == "warning"]
    # Every failure counted, one line for the lot within the rate window.
    assert [(line["method"], line["code"], line["count"]) for line in warnings] == [
        ("Free", "NOT_FOUND", 1)]
