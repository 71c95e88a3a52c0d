"""TCP listeners of a real pagedkvd: TLS, bearer token required, health exempt, no token (or
no TLS without --insecure-tcp) no start.

The interceptor's rules in detail (every token form, streams, metrics, logs) are tested
in-process through the same server construction in tests/daemon/edge/test_interceptors.py, TLS
in test_tls.py.
"""

import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2_grpc

from pagedkv.client import DaemonUnavailable, PoolClient, TlsOptions, Unauthenticated

from pagedkvd_process import COMMAND, Pagedkvd, free_tcp_port, pagedkvd
from tls_certs import TlsFiles, make_tls_files

TOKEN = "correct-horse-battery-staple"


def write_token(folder: Path) -> Path:
    token_file = folder / "token"
    token_file.write_text(TOKEN + "\n")
    token_file.chmod(0o600)
    return token_file


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[tuple[Pagedkvd, str, TlsFiles]]:
    """A daemon on its unix socket and on a loopback TCP port with TLS and a token file."""
    tls = make_tls_files(tmp_path)
    tcp_target = f"127.0.0.1:{free_tcp_port()}"
    with pagedkvd("--listen", tcp_target, "--auth-token-file", str(write_token(tmp_path)),
                  "--tls-cert-file", str(tls.server_cert),
                  "--tls-key-file", str(tls.server_key)) as running:
        yield running, tcp_target, tls
        assert running.stop() == 0


async def test_tcp_needs_tls_and_the_token_unix_and_health_do_not(
    daemon: tuple[Pagedkvd, str, TlsFiles],
) -> None:
    running, tcp_target, files = daemon
    tls = TlsOptions(ca_file=files.ca)
    async with await PoolClient.connect(tcp_target, auth_token=TOKEN, tls=tls) as client:
        session = await client.open_session("tcp-client")
        blocks = await session.allocate(1, num_tokens=5)
        assert len(blocks.block_ids) == 1
        await session.close()
    with pytest.raises(DaemonUnavailable):  # plaintext: the token is never sent in clear
        await PoolClient.connect(tcp_target, auth_token=TOKEN, timeout=1)
    for token in (None, "wrong-token"):
        async with await PoolClient.connect(tcp_target, auth_token=token, tls=tls) as client:
            with pytest.raises(Unauthenticated):
                await client.open_session("intruder")
            with pytest.raises(Unauthenticated):
                await client.stats()
    async with await PoolClient.connect(running.unix_target) as client:
        assert (await client.stats()).num_blocks > 0
    async with grpc.aio.secure_channel(tcp_target, tls.credentials()) as channel:
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


def test_tcp_without_tls_needs_insecure_tcp_and_warns(tmp_path: Path) -> None:
    token_file = write_token(tmp_path)
    listen = ["--listen", f"127.0.0.1:{free_tcp_port()}", "--auth-token-file", str(token_file)]
    result = subprocess.run([*COMMAND, *listen, "--shm-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "a TCP listener needs TLS (tls_cert_file and tls_key_file) or insecure_tcp" in \
        result.stderr
    with pagedkvd(*listen, "--insecure-tcp") as running:
        assert running.stop() == 0
        assert "plaintext TCP listener" in running.stderr()
