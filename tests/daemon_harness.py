"""An in-process pagedkv daemon for tests: a real grpc.aio server on a unix socket (and TCP).

    async with running_daemon(num_blocks=16, block_size=4, with_memory=True) as daemon:
        async with await PoolClient.connect(daemon.unix_target) as client: ...
        daemon.service.check_invariants()

The pool is tiny so tests can assert exact block ids; `with_memory=True` backs it with a real
CPU KVPoolMemory (the tiny geometry, in a private temp dir, never /dev/shm).
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.geometry import TINY_CPU_GEOMETRY
from pagedkv.daemon.kv_memory import KVPoolMemory
from pagedkv.daemon.service import PoolService
from pagedkv.daemon.servicer import KVPoolServicer, add_to_server


@dataclass
class Daemon:
    """A running in-process daemon and the handles tests poke at."""

    # The domain layer (its pool, sessions and check_invariants()).
    service: PoolService
    # The grpc.aio server serving it.
    server: grpc.aio.Server
    # "unix:/.../pagedkv.sock", always served.
    unix_target: str
    # "127.0.0.1:<port>" when started with tcp=True, else None.
    tcp_target: str | None
    # The pool memory when started with with_memory=True.
    memory: KVPoolMemory | None

    @property
    def pool(self) -> BlockPool:
        return self.service.pool


@asynccontextmanager
async def running_daemon(*, num_blocks: int = 16, block_size: int = 4, with_memory: bool = False,
                         tcp: bool = False, pool_id: str | None = None,
                         interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                         socket_dir: Path | None = None,
                         **service_options: Any) -> AsyncIterator[Daemon]:
    """Start a daemon; `service_options` go to PoolService (leases, limits, zeroing)."""
    # A short private dir: unix socket paths are limited to ~107 bytes, pytest's tmp_path is long.
    own_dir = socket_dir is None
    directory = Path(tempfile.mkdtemp(prefix="pkv-")) if socket_dir is None else socket_dir
    memory = None
    if with_memory:
        memory = KVPoolMemory.create(TINY_CPU_GEOMETRY, num_blocks, block_size, "float32",
                                     shm_dir=str(directory))
    service = PoolService(BlockPool(num_blocks, block_size), memory,
                          pool_id=pool_id or secrets.token_hex(8), geometry=TINY_CPU_GEOMETRY,
                          **service_options)
    server = grpc.aio.server(interceptors=interceptors)
    add_to_server(KVPoolServicer(service), server)
    unix_target = f"unix:{directory / 'pagedkv.sock'}"
    server.add_insecure_port(unix_target)
    tcp_target = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}" if tcp else None
    await server.start()
    await service.start()
    try:
        yield Daemon(service, server, unix_target, tcp_target, memory)
    finally:
        await server.stop(grace=None)
        await service.stop()
        if memory is not None:
            memory.close()
        if own_dir:
            shutil.rmtree(directory, ignore_errors=True)

