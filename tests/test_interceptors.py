"""The server interceptor on a real grpc.aio server with dummy handlers: auth, logs, metrics."""

import io
import json
import logging
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from pagedkv.daemon.interceptors import ServerInterceptor, session_label
from pagedkv.daemon.logging import configure
from pagedkv.daemon.metrics import RpcMetrics

TOKEN = "letmein"
SECRET_SESSION = "ab12cd-7-0123456789abcdef"


@dataclass
class Request:
    """A stand-in request message: bytes on the wire, a session_id attribute for the logs."""

    session_id: str


def decode(data: bytes) -> Request:
    return Request(session_id=data.decode())


async def echo(request: Request, context: Any) -> bytes:
    return request.session_id.encode()


async def missing(request: Request, context: Any) -> bytes:
    await context.abort(grpc.StatusCode.NOT_FOUND, "no such sequence")
    raise AssertionError("abort returns only by raising")


async def crash(request: Request, context: Any) -> bytes:
    raise RuntimeError("a bug")


async def count(request: Request, context: Any) -> AsyncIterator[bytes]:
    for i in range(3):
        yield str(i).encode()


@pytest.fixture(autouse=True)
def log_stream() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()
    configure("debug", "json", stream)
    yield stream
    root.handlers, root.level = handlers, level


@dataclass
class Server:
    unix_target: str
    tcp_target: str
    registry: CollectorRegistry


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    registry = CollectorRegistry()
    srv = grpc.aio.server(interceptors=[ServerInterceptor(TOKEN, RpcMetrics(registry))])
    methods = {
        name: grpc.unary_unary_rpc_method_handler(fn, request_deserializer=decode)
        for name, fn in (("Echo", echo), ("Missing", missing), ("Crash", crash))
    }
    methods["Count"] = grpc.unary_stream_rpc_method_handler(count, request_deserializer=decode)
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("test.Dummy", methods),))
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), srv)
    unix_target = f"unix://{tmp_path}/s.sock"
    srv.add_insecure_port(unix_target)
    port = srv.add_insecure_port("127.0.0.1:0")
    await srv.start()
    yield Server(unix_target, f"127.0.0.1:{port}", registry)
    await srv.stop(None)


async def call(target: str, method: str, token: str | None = None) -> bytes:
    metadata = None if token is None else (("authorization", f"Bearer {token}"),)
    async with grpc.aio.insecure_channel(target) as channel:
        stub = channel.unary_unary(f"/test.Dummy/{method}")
        response: bytes = await stub(SECRET_SESSION.encode(), metadata=metadata)
        return response


async def test_unix_peers_need_no_token(server: Server) -> None:
    assert await call(server.unix_target, "Echo") == SECRET_SESSION.encode()


@pytest.mark.parametrize("token", [None, "wrong", ""])
async def test_tcp_without_the_right_token_is_unauthenticated(
    server: Server, token: str | None
) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call(server.tcp_target, "Echo", token)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_tcp_with_the_token_works(server: Server) -> None:
    assert await call(server.tcp_target, "Echo", TOKEN) == SECRET_SESSION.encode()


async def test_streaming_handlers_are_guarded_too(server: Server) -> None:
    async with grpc.aio.insecure_channel(server.tcp_target) as channel:
        stream = channel.unary_stream("/test.Dummy/Count")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [item async for item in stream(b"x")]
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        items = [item async for item in stream(b"x", metadata=(("authorization",
                                                                 f"Bearer {TOKEN}"),))]
        assert items == [b"0", b"1", b"2"]


async def test_health_checks_need_no_token_on_tcp(server: Server) -> None:
    async with grpc.aio.insecure_channel(server.tcp_target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


async def test_health_watch_streams_through_the_interceptor(server: Server) -> None:
    # Watch writes with context.write instead of yielding: the wrapper must keep that shape.
    async with grpc.aio.insecure_channel(server.tcp_target) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        first = await watch.read()
        watch.cancel()
    assert first.status == health_pb2.HealthCheckResponse.SERVING


async def test_outcomes_are_counted_and_logged_without_the_session_secret(
    server: Server, log_stream: io.StringIO
) -> None:
    await call(server.unix_target, "Echo")
    for method, code in (("Missing", grpc.StatusCode.NOT_FOUND),
                         ("Crash", grpc.StatusCode.UNKNOWN)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call(server.unix_target, method)
        assert info.value.code() == code
    with pytest.raises(grpc.aio.AioRpcError):
        await call(server.tcp_target, "Echo")

    def calls(method: str, code: str) -> float | None:
        labels = {"service": "test.Dummy", "method": method, "code": code}
        return server.registry.get_sample_value("pagedkv:rpc_requests_total", labels)

    assert calls("Echo", "OK") == 1
    assert calls("Missing", "NOT_FOUND") == 1
    assert calls("Crash", "UNKNOWN") == 1
    assert calls("Echo", "UNAUTHENTICATED") == 1
    latency = server.registry.get_sample_value(
        "pagedkv:rpc_duration_seconds_count", {"service": "test.Dummy", "method": "Echo"})
    assert latency == 2

    rpc_lines = [line for line in map(json.loads, log_stream.getvalue().splitlines())
                 if line["event"] == "rpc"]
    assert [(line["method"], line["code"], line["level"]) for line in rpc_lines] == [
        ("Echo", "OK", "debug"), ("Missing", "NOT_FOUND", "warning"),
        ("Crash", "UNKNOWN", "warning"), ("Echo", "UNAUTHENTICATED", "warning")]
    assert {line["session"] for line in rpc_lines} == {"#7"}
    assert "0123456789abcdef" not in log_stream.getvalue()


@pytest.mark.parametrize(
    ("session_id", "label"),
    [("pool-12-00ff00ff00ff00ff", "#12"), ("garbage", "invalid"), ("", None)],
)
def test_session_label_never_shows_the_secret(session_id: str, label: str | None) -> None:
    assert session_label(Request(session_id)) == label
    assert session_label(object()) is None
