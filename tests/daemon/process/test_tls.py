"""TLS on TCP listeners (in-process daemon, production `grpc_server`) and its settings.

A throwaway CA signs the daemon's certificate (localhost, 127.0.0.1) and a client's. A TLS
client that trusts the CA works; a plaintext client gets nowhere; with a client CA (mutual
TLS) a client without a certificate is refused at the handshake, and the token is still
needed on top of a certificate.
"""

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pagedkv.client import DaemonUnavailable, PoolClient, TlsOptions, Unauthenticated
from pagedkv.daemon.edge.tls import ServerTls, load_server_tls
from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.process.settings import ConfigError
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc

from daemon_harness import TOKEN, running_daemon
from tls_certs import TlsFiles, make_tls_files


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


def server_tls(files: TlsFiles, *, mutual: bool = False) -> ServerTls:
    return load_server_tls(files.server_cert, files.server_key,
                           files.ca if mutual else None)


async def allocate_over(target: str, tls: TlsOptions | None, token: str | None = TOKEN,
                        timeout: float = 5) -> int:
    """Open a session and allocate 5 tokens over `target`; the blocks it got."""
    async with await PoolClient.connect(target, auth_token=token, tls=tls,
                                        timeout=timeout) as client:
        session = await client.open_session("tls")
        return len((await session.allocate(1, 5)).block_ids)


async def test_a_tls_client_works_and_a_plaintext_client_fails(files: TlsFiles) -> None:
    async with running_daemon(tcp=True, tls=server_tls(files)) as daemon:
        assert daemon.tcp_target is not None
        assert await allocate_over(daemon.tcp_target, TlsOptions(ca_file=files.ca)) == 2
        with pytest.raises(Unauthenticated):  # TLS does not replace the token
            await allocate_over(daemon.tcp_target, TlsOptions(ca_file=files.ca), token=None)
        with pytest.raises(DaemonUnavailable):  # no TLS: the channel never comes up
            await allocate_over(daemon.tcp_target, None, timeout=1)
        async with grpc.aio.insecure_channel(daemon.tcp_target) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await kvpool_pb2_grpc.KVPoolStub(channel).GetPoolInfo(
                    pb.GetPoolInfoRequest(), timeout=1)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # The certificate names localhost too.
        localhost = daemon.tcp_target.replace("127.0.0.1", "localhost")
        assert await allocate_over(localhost, TlsOptions(ca_file=files.ca)) == 2
        # The unix socket stays plaintext and tokenless.
        assert await allocate_over(daemon.unix_target, None, token=None) == 2


async def test_a_daemon_it_cannot_verify_is_refused(files: TlsFiles, tmp_path: Path) -> None:
    other = make_tls_files(tmp_path)  # another CA
    async with running_daemon(tcp=True, tls=server_tls(files)) as daemon:
        assert daemon.tcp_target is not None
        with pytest.raises(DaemonUnavailable):
            await allocate_over(daemon.tcp_target, TlsOptions(ca_file=other.ca), timeout=1)
        with pytest.raises(DaemonUnavailable):  # the certificate does not name "elsewhere"
            await allocate_over(daemon.tcp_target, TlsOptions(
                ca_file=files.ca, server_name="elsewhere"), timeout=1)


async def test_mutual_tls_needs_a_client_certificate(files: TlsFiles) -> None:
    async with running_daemon(tcp=True, tls=server_tls(files, mutual=True)) as daemon:
        assert daemon.tcp_target is not None
        with_cert = TlsOptions(ca_file=files.ca, cert_file=files.client_cert,
                               key_file=files.client_key)
        assert await allocate_over(daemon.tcp_target, with_cert) == 2
        with pytest.raises(DaemonUnavailable):
            await allocate_over(daemon.tcp_target, TlsOptions(ca_file=files.ca), timeout=1)


# ------------------------------------------------------------------------------ settings

@pytest.fixture
def token_file(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    path.chmod(0o600)
    yield path


def tcp_config(token_file: Path, **settings: object) -> DaemonConfig:
    return DaemonConfig(listen=("127.0.0.1:7001",), auth_token_file=token_file,
                        **settings)  # type: ignore[arg-type]


def test_a_tcp_listener_needs_tls_or_insecure_tcp(files: TlsFiles, token_file: Path) -> None:
    with pytest.raises(ConfigError, match=r"a TCP listener needs TLS .* or insecure_tcp"):
        tcp_config(token_file)
    assert tcp_config(token_file, insecure_tcp=True).server_tls() is None
    config = tcp_config(token_file, tls_cert_file=files.server_cert,
                        tls_key_file=files.server_key, tls_client_ca_file=files.ca)
    tls = config.server_tls()
    assert tls is not None and tls.client_ca == files.ca.read_bytes()


def test_unusable_tls_settings_are_refused(files: TlsFiles, token_file: Path,
                                           tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="give both or neither"):
        tcp_config(token_file, tls_cert_file=files.server_cert)
    with pytest.raises(ConfigError, match=r"tls_client_ca_file .* needs tls_cert_file"):
        tcp_config(token_file, insecure_tcp=True, tls_client_ca_file=files.ca)
    with pytest.raises(ConfigError, match=r"tls_cert_file: .* holds no PEM certificate"):
        tcp_config(token_file, tls_cert_file=token_file, tls_key_file=files.server_key)
    with pytest.raises(ConfigError, match="tls_key_file: cannot read"):
        tcp_config(token_file, tls_cert_file=files.server_cert, tls_key_file=tmp_path / "no")
    open_key = tmp_path / "open.key"
    open_key.write_bytes(files.server_key.read_bytes())
    open_key.chmod(0o644)
    with pytest.raises(ConfigError, match=r"tls_key_file: .* readable by every user"):
        tcp_config(token_file, tls_cert_file=files.server_cert, tls_key_file=open_key)
