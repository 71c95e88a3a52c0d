"""TCP listeners of a real pagedkvd: bearer token required, health exempt, no token no start."""

import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc
from pagedkvd_process import COMMAND, Pagedkvd, free_tcp_port, pagedkvd

from pagedkv.client import PoolClient, Unauthenticated

TOKEN = "correct-horse-battery-staple"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Pagedkvd, str]]:
    """A daemon on its unix socket and on a loopback TCP port with a token file."""
    token_file = tmp_path_factory.mktemp("auth") / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    tcp_target = f"127.0.0.1:{free_tcp_port()}"
    with pagedkvd("--listen", tcp_target, "--auth-token-file", str(token_file)) as running:
        yield running, tcp_target
        assert running.stop() == 0


async def test_tcp_with_the_token_works(daemon: tuple[Pagedkvd, str]) -> None:
    _, tcp_target = daemon
    async with await PoolClient.connect(tcp_target, auth_token=TOKEN) as client:
        session = await client.open_session("tcp-client")
        blocks = await session.allocate(1, num_tokens=5)
        assert len(blocks.block_ids) == 1
        await session.close()


@pytest.mark.parametrize("token", [None, "wrong-token"])
async def test_tcp_without_the_right_token_is_unauthenticated(
    daemon: tuple[Pagedkvd, str], token: str | None
) -> None:
    _, tcp_target = daemon
    async with await PoolClient.connect(tcp_target, auth_token=token) as client:
        with pytest.raises(Unauthenticated):
            await client.open_session("intruder")
        with pytest.raises(Unauthenticated):
            await client.stats()


async def test_unix_socket_needs_no_token(daemon: tuple[Pagedkvd, str]) -> None:
    running, _ = daemon
    async with await PoolClient.connect(running.unix_target) as client:
        assert (await client.stats()).num_blocks > 0


async def test_health_is_open_and_reflection_guarded_on_tcp(
    daemon: tuple[Pagedkvd, str],
) -> None:
    _, tcp_target = daemon
    async with grpc.aio.insecure_channel(tcp_target) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pagedkv.v1.KVPool"), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # No request message: the server refuses at call start, and a message still in flight
        # then would fail on the client's side (INTERNAL) before the server's status arrives.
        stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter(()), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            [reply async for reply in stream]
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_tcp_without_a_token_file_refuses_to_start(tmp_path: Path) -> None:
    result = subprocess.run([*COMMAND, "--listen", f"127.0.0.1:{free_tcp_port()}",
                             "--shm-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "a TCP listener needs auth_token_file (--auth-token-file)" in result.stderr
    assert list(tmp_path.iterdir()) == []  # refused before allocating anything
