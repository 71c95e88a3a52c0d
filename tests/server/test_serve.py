"""serve() in-process, and the start-up checks that turn bad settings into clear errors."""

import asyncio
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedkv.daemon.process import server
from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.daemon.process.server import check_device, pool_geometry, pool_num_blocks, serve
from pagedkv.daemon.process.settings import ConfigError
from pagedkv.memory import cuda_driver
from pagedkv.process.grpc_server import StartupError
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc
from pagedkv.proto.limits import MAX_MESSAGE_BYTES
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY

# The tiny geometry in float32: 2 layers x 2 (K, V) x 2 heads x 64 x 4 bytes x 16 slots.
BLOCK_BYTES = 2 * 2 * 2 * 64 * 4 * 16


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="pkvs-") as folder:
        yield Path(folder)


def config_in(folder: Path, **settings: Any) -> DaemonConfig:
    return DaemonConfig(listen=(f"unix://{folder}/d.sock",), shm_dir=folder, **settings)


async def test_serve_until_the_stop_event(short_dir: Path) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(serve(config_in(short_dir, num_blocks=8), stop))
    async with grpc.aio.insecure_channel(f"unix://{short_dir}/d.sock") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pagedkv.v1.KVPool"), wait_for_ready=True,
            timeout=30)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        # A request over MAX_MESSAGE_BYTES is refused, and the server keeps serving.
        huge = pb.GetStatsRequest(session_id="x" * (MAX_MESSAGE_BYTES + 1))
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await kvpool_pb2_grpc.KVPoolStub(channel).GetStats(huge, timeout=30)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        stats = await kvpool_pb2_grpc.KVPoolStub(channel).GetStats(pb.GetStatsRequest())
        assert stats.num_blocks == 8
    assert len(list(short_dir.glob("pagedkv-*.kv"))) == 1
    stop.set()
    await asyncio.wait_for(task, 30)
    assert list(short_dir.iterdir()) == []  # pool file and socket both gone


async def test_socket_and_its_folder_get_explicit_modes_under_umask_000(short_dir: Path) -> None:
    socket_path = short_dir / "run" / "sub" / "d.sock"  # two folders the daemon creates
    stop = asyncio.Event()
    previous = os.umask(0)  # as if started from a shell or unit with UMask=0000
    try:
        task = asyncio.create_task(serve(DaemonConfig(
            listen=(f"unix://{socket_path}",), shm_dir=short_dir, num_blocks=8), stop))
        async with grpc.aio.insecure_channel(f"unix://{socket_path}") as channel:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), wait_for_ready=True, timeout=30)
        modes = {path: stat.S_IMODE(path.stat().st_mode)
                 for path in (socket_path, socket_path.parent, socket_path.parent.parent,
                              *short_dir.glob("pagedkv-*.kv"))}
    finally:
        os.umask(previous)
        stop.set()
        await asyncio.wait_for(task, 30)
    assert modes.pop(socket_path) == 0o660
    assert modes.pop(socket_path.parent) == modes.pop(socket_path.parent.parent) == 0o750
    assert list(modes.values()) == [0o600]  # the pool file


async def test_a_port_in_use_stops_the_start_and_frees_the_pool(short_dir: Path) -> None:
    token = short_dir / "token"
    token.write_text("t")
    token.chmod(0o600)
    blocker = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    port = blocker.add_insecure_port("127.0.0.1:0")
    await blocker.start()
    try:
        config = DaemonConfig(listen=(f"127.0.0.1:{port}",), auth_token_file=token,
                              shm_dir=short_dir, insecure_tcp=True)
        with pytest.raises(StartupError, match=f"cannot listen on 127.0.0.1:{port}"):
            await serve(config, asyncio.Event())
    finally:
        await blocker.stop(None)
    assert list(short_dir.glob("pagedkv-*.kv")) == []


def test_pool_size_from_bytes_and_too_small(short_dir: Path) -> None:
    geometry, dtype = pool_geometry(config_in(short_dir))
    assert (geometry, dtype) == (TINY_CPU_GEOMETRY, "float32")
    config = config_in(short_dir, num_blocks=None, kv_memory=10 * BLOCK_BYTES + 1)
    assert pool_num_blocks(config, geometry, dtype) == 10
    with pytest.raises(ConfigError, match=r"pool size: .* cannot hold one block"):
        pool_num_blocks(config_in(short_dir, num_blocks=None, kv_memory=100), geometry, dtype)


def test_unknown_model_is_a_config_error(short_dir: Path) -> None:
    with pytest.raises(ConfigError, match="model_config: unknown model 'no-such-model'"):
        pool_geometry(config_in(short_dir, model_config="no-such-model"))


def test_cuda_without_a_visible_device_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server.torch.cuda, "is_available", lambda: False)
    with pytest.raises(StartupError, match="device cuda: torch sees no CUDA device"):
        check_device("cuda")
    check_device("cpu")  # no CUDA needed


def test_cuda_with_a_driver_too_old_for_torch_is_refused_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # torch would only say it sees no device; the check names both versions.
    monkeypatch.setattr(server.torch.version, "cuda", "13.0")
    monkeypatch.setattr(cuda_driver, "driver_cuda_version", lambda: 12080)
    monkeypatch.setattr(server.torch.cuda, "is_available", lambda: False)
    with pytest.raises(StartupError, match=r"device cuda:1: torch .* was built for CUDA 13\.0, "
                                           r"but the NVIDIA driver supports CUDA up to 12\.8"):
        check_device("cuda:1")
    check_device("cpu")  # no CUDA needed
