"""The real pagedkvd process: start-up, systemd notifications, drain on SIGTERM, clean exit."""

import asyncio
import signal
import socket
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedkv.client import PoolClient
from pagedkv.process.launch import NoNotification

from pagedkvd_process import Pagedkvd, pagedkvd, short_tmp_dir

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def refused_soon(target: str, timeout: float = 10.0) -> bool:
    """True once a fresh connection's call fails UNAVAILABLE (the server stopped accepting)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        async with grpc.aio.insecure_channel(target) as channel:
            try:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1.0)
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNAVAILABLE:
                    return True
        await asyncio.sleep(0.05)
    return False


async def drain_while_a_call_is_in_flight(daemon: Pagedkvd) -> None:
    """SIGTERM with a reflection stream open: new calls are refused, the open one still works."""
    async with grpc.aio.insecure_channel(daemon.unix_target) as channel:
        in_flight = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo()
        await in_flight.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        assert (await in_flight.read()).HasField("list_services_response")
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        assert (await watch.read()).status == SERVING

        daemon.send(signal.SIGTERM)
        assert (await watch.read()).status == NOT_SERVING  # drain has begun
        watch.cancel()
        assert await refused_soon(daemon.unix_target)
        await in_flight.write(reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="pagedkv.v1.KVPool"))
        answer = await in_flight.read()
        assert answer.file_descriptor_response.file_descriptor_proto
        await in_flight.done_writing()
        assert await in_flight.read() == grpc.aio.EOF
        assert await in_flight.code() == grpc.StatusCode.OK


async def test_start_serve_drain_and_exit_cleanly(tmp_path: Path) -> None:
    # Settings from a TOML file, one of them overridden by a flag.
    toml = tmp_path / "pagedkv.toml"
    toml.write_text("num_blocks = 64\nblock_size = 32\nlease_ttl_ms = 4000\n")
    with short_tmp_dir() as workdir:
        # A pool file left by a daemon that crashed (pid 2^31 - 1 is never alive).
        stale = workdir / f"pagedkv-{2**31 - 1}-00ff00ff00ff00ff.kv"
        stale.write_bytes(b"x")
        with pagedkvd("--config", str(toml), "--block-size", "8", workdir=workdir) as daemon:
            ready = daemon.notifications[-1]
            assert "STATUS=serving pool" in ready and "64 blocks x 8 tokens" in ready
            assert not stale.exists()
            (pool_file,) = daemon.pool_files()
            async with await PoolClient.connect(daemon.runners_target) as runner:
                assert (await runner.pool_info()).memory.shm_path == str(pool_file)
            async with await PoolClient.connect(daemon.unix_target) as client:
                info = await client.pool_info()
                assert (info.num_blocks, info.block_size) == (64, 8)
                assert info.memory.kind == ""  # only runners get the memory
                session = await client.open_session("lifecycle")
                await session.allocate(1, token_ids=list(range(20)))
                assert (await client.stats()).free_blocks == 64 - 3

            await drain_while_a_call_is_in_flight(daemon)
            assert await asyncio.to_thread(daemon.process.wait, 30) == 0
            daemon.wait_for_notification("STOPPING=1", timeout=1)
            assert daemon.pool_files() == []
            assert not (workdir / "pagedkvd.sock").exists()
            events = daemon.stderr()
            assert '"event": "stopping"' in events and '"event": "stopped"' in events


def test_watchdog_pings_from_the_event_loop_and_sigint_stops() -> None:
    with pagedkvd(env={"WATCHDOG_USEC": "200000"}) as daemon:  # a ping every 0.1 s
        for _ in range(3):
            daemon.wait_for_notification("WATCHDOG=1", timeout=5)
        assert daemon.stop(signal.SIGINT) == 0
        assert daemon.pool_files() == []


def test_watchdog_of_another_process_is_not_fed() -> None:
    with pagedkvd(env={"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"}) as daemon:
        # With a ping due every 0.1 s, a second without one means none are sent.
        with pytest.raises(NoNotification, match="no WATCHDOG=1"):
            daemon.wait_for_notification("WATCHDOG=1", timeout=1)
        assert daemon.stop() == 0


async def test_a_dead_socket_is_replaced_and_a_live_one_refused() -> None:
    with short_tmp_dir() as folder:
        path = folder / "shared.sock"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as leftover:
            leftover.bind(str(path))  # closed without unlink: what a crash leaves behind
        with pagedkvd(listen_path=path) as first:
            with pagedkvd(listen_path=path, wait_ready=False) as second:
                assert second.process.wait(60) == 1
                assert f"cannot listen on {path}: another process is serving it" in (
                    second.stderr())
            # The refused daemon left the first one's socket alone.
            async with await PoolClient.connect(first.unix_target) as client:
                assert (await client.stats()).num_blocks > 0
            assert first.stop() == 0
        assert not path.exists()
