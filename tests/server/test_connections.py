"""Slowloris protection of `pagedkv serve` (issue 31), with real sockets: the app of app.py
(over a stand-in engine) served by the production runner and site of listener.py, the clients
bound to distinct loopback addresses (127.0.0.2, ...) where the test needs several.

A connection that never completes its request head is reset after --header-timeout-s (an
idle kept-alive one after --idle-timeout-s); one address gets at most
--max-connections-per-address connections, everybody at most --max-connections, while a
request from another address is answered; refusals are logged once per interval.
"""

import argparse
import asyncio
import errno
import io
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import cast

import pytest

from pagedkv.client.engine.engine import Engine
from pagedkv.process.log_setup import HOSTILE_LOG_INTERVAL_S
from pagedkv.server.app import build_app
from pagedkv.server.backend import Backend, ServeConfig
from pagedkv.server.cli import main, parser
from pagedkv.server.connections import ConnectionGuard, ConnectionLimits, address_key
from pagedkv.server.listener import (
    FD_RESERVE,
    LISTEN_BACKLOG,
    GuardedSite,
    connection_limits,
    http_runner,
    listen,
)
from pagedkv.server.metrics import ServerMetrics

from failing_engine import FailingEngine
from log_capture import events

# A head a slowloris client sends and never finishes.
PARTIAL_HEAD = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
# Long enough that a connection never waits it out in a test that does not mean it to.
LONG_S = 60.0
# How long a test waits for what must happen (far beyond the timeouts it sets).
PATIENCE_S = 10.0


def limits(**bounds: float) -> ConnectionLimits:
    defaults = dict(header_timeout_s=LONG_S, idle_timeout_s=LONG_S, max_connections=1000,
                    max_per_address=0)
    return ConnectionLimits(**{**defaults, **bounds})  # type: ignore[arg-type]


@asynccontextmanager
async def serving(guard: ConnectionGuard) -> AsyncIterator[int]:
    """The app on a free loopback port (yielded), its connections bounded by `guard`."""
    backend = Backend(cast(Engine, FailingEngine()), None, "a preset", ServeConfig("m"),
                      ServerMetrics("m"))
    runner = http_runner(build_app(backend), guard.limits, shutdown_timeout_s=1.0)
    await runner.setup()
    try:
        site = GuardedSite(runner, listen("127.0.0.1", 0), guard)
        await site.start()
        yield site.port
    finally:
        await runner.cleanup()


async def connect(port: int, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader,
                                                                 asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0))


async def half_open(port: int, source: str = "127.0.0.1") -> tuple[asyncio.StreamReader,
                                                                   asyncio.StreamWriter]:
    """A connection that sends part of a request head and no more."""
    reader, writer = await connect(port, source)
    writer.write(PARTIAL_HEAD)
    await writer.drain()
    return reader, writer


async def closed_by_server(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes or resets the connection (within PATIENCE_S)."""
    try:
        return await asyncio.wait_for(reader.read(), PATIENCE_S) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


async def models(port: int, source: str) -> int:
    """GET /v1/models from `source`, on a new connection: the status."""
    reader, writer = await connect(port, source)
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), PATIENCE_S)
    writer.close()
    return int(answer.split(b" ", 2)[1])


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(int(PATIENCE_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the server never got there")




async def test_a_head_not_complete_in_time_is_reset_and_a_complete_one_is_answered(
        log_lines: io.StringIO) -> None:
    guard = ConnectionGuard(limits(header_timeout_s=0.2))
    async with serving(guard) as port:
        slow, _ = await half_open(port)
        assert await closed_by_server(slow)
        await until(lambda: guard.open_connections == 0)  # the count went down with it
        assert await models(port, "127.0.0.1") == 200
        [line] = events(log_lines, "http_connection_timed_out")
        assert line["limit"] == "--header-timeout-s" and line["address"] == "127.0.0.1"


async def test_a_kept_alive_connection_idle_past_the_idle_timeout_is_closed() -> None:
    guard = ConnectionGuard(limits(header_timeout_s=0.2, idle_timeout_s=0.5))
    async with serving(guard) as port:
        reader, writer = await connect(port)
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")  # kept alive
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        assert head.startswith("HTTP/1.1 200")
        length = next(int(line.partition(":")[2]) for line in head.splitlines()
                      if line.lower().startswith("content-length:"))
        await reader.readexactly(length)
        # Idle after its answer: the idle timeout (aiohttp's keep-alive timer) closes it.
        assert await closed_by_server(reader)
        writer.close()


async def test_one_address_gets_its_cap_and_another_is_still_answered(
        log_lines: io.StringIO) -> None:
    guard = ConnectionGuard(limits(max_per_address=3))
    async with serving(guard) as port:
        held = [await half_open(port) for _ in range(3)]
        await until(lambda: guard.open_by_address["127.0.0.1"] == 3)
        refused, _ = await half_open(port)
        assert await closed_by_server(refused)
        assert await models(port, "127.0.0.2") == 200
        assert guard.open_by_address == {"127.0.0.1": 3}
        [line] = events(log_lines, "http_connection_refused")
        assert line["limit"] == "--max-connections-per-address" and line["value"] == 3
        # One of the address's connections closed makes room for one more.
        held.pop()[1].close()
        await until(lambda: guard.open_by_address["127.0.0.1"] == 2)
        held.append(await half_open(port))
        await until(lambda: guard.open_by_address["127.0.0.1"] == 3)
        assert all(not reader.at_eof() for reader, _ in held)


async def test_refusals_at_the_total_cap_are_logged_once_per_interval(
        log_lines: io.StringIO) -> None:
    now = [0.0]
    guard = ConnectionGuard(limits(max_connections=2), clock=lambda: now[0])
    async with serving(guard) as port:
        held = [await half_open(port, source) for source in ("127.0.0.2", "127.0.0.3")]
        await until(lambda: guard.open_connections == 2)
        for source in ("127.0.0.4", "127.0.0.5", "127.0.0.4", "127.0.0.6"):
            assert await closed_by_server((await half_open(port, source))[0])
        lines = events(log_lines, "http_connection_refused")
        assert [(line["limit"], line["count"]) for line in lines] == [("--max-connections", 1)]
        now[0] += HOSTILE_LOG_INTERVAL_S  # the next refusal's line counts the silent ones
        assert await closed_by_server((await half_open(port, "127.0.0.7"))[0])
        lines = events(log_lines, "http_connection_refused")
        assert [line["count"] for line in lines] == [1, 4]
        assert guard.open_connections == 2 and all(not r.at_eof() for r, _ in held)


async def test_accept_errors_for_lack_of_descriptors_are_logged_once_per_interval(
        log_lines: io.StringIO) -> None:
    guard = ConnectionGuard(limits())
    async with serving(guard):
        loop = asyncio.get_running_loop()
        for _ in range(50):  # what asyncio reports each time accept() meets EMFILE
            loop.call_exception_handler({
                "message": "socket.accept() out of system resource",
                "exception": OSError(errno.EMFILE, "Too many open files")})
    [line] = events(log_lines, "http_accept_out_of_resources")
    assert line["count"] == 1


def flags(*argv: str) -> argparse.Namespace:
    return parser().parse_args(["--model", "tiny-llama", *argv])


def test_the_total_cap_defaults_below_the_descriptor_limit_and_one_too_large_is_refused(
        ) -> None:
    room = 20_000 - FD_RESERVE - LISTEN_BACKLOG
    assert connection_limits(flags(), 20_000).max_connections == room
    assert connection_limits(flags("--max-connections", "100"), 20_000).max_connections == 100
    with pytest.raises(ValueError, match=f"--max-connections must be between 1 and {room}"):
        connection_limits(flags("--max-connections", str(room + 1)), 20_000)
    with pytest.raises(ValueError, match="--max-connections must be between 1 and -"):
        connection_limits(flags(), 300)  # no room at all
    with pytest.raises(ValueError, match="--header-timeout-s must be > 0 and at most"):
        connection_limits(flags("--header-timeout-s", "80", "--idle-timeout-s", "75"), 20_000)
    with pytest.raises(ValueError, match="--max-connections-per-address must be >= 0"):
        connection_limits(flags("--max-connections-per-address", "-1"), 20_000)


def test_serve_refuses_a_cap_that_cannot_fit_before_anything_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", "tiny-llama", "--max-connections", str(2**40)]) == 2
    assert "--max-connections must be between 1 and" in capsys.readouterr().err


def test_an_ipv6_client_counts_as_its_64() -> None:
    assert address_key("2001:db8::1") == address_key("2001:db8::ffff:1") == "2001:db8::/64"
    assert address_key("2001:db8:0:1::1") != address_key("2001:db8::1")
    assert address_key("::ffff:10.0.0.1") == address_key("10.0.0.1") == "10.0.0.1"
    assert address_key("fe80::1%eth0") == "fe80::/64"
