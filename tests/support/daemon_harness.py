"""An in-process pagedkv daemon for tests, served by the production gRPC server.

    async with running_daemon(num_blocks=16, block_size=4, with_memory=True) as daemon:
        async with await PoolClient.connect(daemon.unix_target) as client: ...
        async with await PoolClient.connect(daemon.runners_target) as runner: ...  # a runner
        daemon.service.check_invariants()

The gRPC server is `pagedkv.daemon.process.server.grpc_server`, the one pagedkvd runs: the same
interceptor (TCP calls need TOKEN, or a token of the `tenants` given; a log line and metrics
per call, in `daemon.registry`),
message limit, health and reflection. The pool is tiny so tests can assert exact block ids;
`with_memory=True` backs it with a real CPU KVPoolMemory (the tiny geometry, in a private temp
dir, never /dev/shm).
"""

from __future__ import annotations

import secrets
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.edge.addresses import ListenAddress, parse_listen
from pagedkv.daemon.edge.metrics import PoolCollector, RpcMetrics
from pagedkv.daemon.edge.peer_gate import PeerGate
from pagedkv.daemon.edge.tls import ServerTls
from pagedkv.daemon.events.publisher import EventPublisher
from pagedkv.daemon.events.sender import EventSettings
from pagedkv.daemon.memory.kv_memory import KVMemory, KVPoolMemory
from pagedkv.daemon.process.server import grpc_server
from pagedkv.daemon.process.settings import AllocatorKind
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.tenants import Tenants
from pagedkv.demo.contiguous import contiguous_pool
from pagedkv.process.grpc_server import GrpcServers
from pagedkv.vocab.geometry import TINY_CPU_GEOMETRY, dtype_bytes

# The bearer token TCP callers of every test daemon must send.
TOKEN = "s3cret-token"
# An ephemeral loopback port (config refuses port 0; the server reports the port it got).
ANY_LOOPBACK_PORT = ListenAddress(target="127.0.0.1:0", unix_path=None)


@dataclass
class Daemon:
    """A running in-process daemon and the handles tests poke at."""

    # The domain layer (its pool, sessions and check_invariants()).
    service: PoolService
    # "unix:///.../pagedkv.sock", always served.
    unix_target: str
    # "unix:///.../runners.sock", the runner socket (its callers are runners), always served.
    runners_target: str
    # "127.0.0.1:<port>" when started with tcp=True, else None.
    tcp_target: str | None
    # The pool memory when started with with_memory=True.
    memory: KVPoolMemory | None
    # The daemon's Prometheus figures: pool collector and per-RPC metrics.
    registry: CollectorRegistry
    # The peer-credential gate serving the unix socket, when the tenants list uids.
    gate: PeerGate | None = None
    # Its gRPC servers (what pagedkvd drains on SIGTERM: `servers.drain()`).
    servers: GrpcServers | None = None
    # Its KV events' publisher, when started with kv_events.
    events: EventPublisher | None = None

    @property
    def pool(self) -> BlockPool:
        return self.service.pool


def tiny_memory(num_blocks: int, block_size: int, blocks_per_page: int,
                directory: Path) -> KVPoolMemory:
    """A CPU arena of num_blocks / blocks_per_page pages, seen as the tiny model's blocks."""
    if blocks_per_page == 1:
        return KVPoolMemory.create(TINY_CPU_GEOMETRY, num_blocks, block_size, "float32",
                                   shm_dir=str(directory))
    per_block = TINY_CPU_GEOMETRY.bytes_per_block(block_size, dtype_bytes("float32"))
    arena = KVMemory.create(num_blocks // blocks_per_page, blocks_per_page * per_block,
                            shm_dir=str(directory))
    return KVPoolMemory(arena, arena.view(TINY_CPU_GEOMETRY.num_layers,
                                          TINY_CPU_GEOMETRY.num_kv_heads,
                                          TINY_CPU_GEOMETRY.head_dim, "float32", block_size))


@asynccontextmanager
async def running_daemon(*, num_blocks: int = 16, block_size: int = 4, with_memory: bool = False,
                         tcp: bool = False, tls: ServerTls | None = None,
                         pool_id: str | None = None, tenants: Tenants | None = None,
                         allocator: AllocatorKind = "paged", max_model_len: int | None = None,
                         blocks_per_page: int = 1, kv_events: EventSettings | None = None,
                         kv_events_all_salts: bool = False,
                         **service_options: Any) -> AsyncIterator[Daemon]:
    """Start a daemon; `service_options` go to PoolService (leases, limits, zeroing, clock).
    With `tcp`, a loopback TCP listener too, serving TLS with `tls` when given. `tenants`
    default to one, "default", whose token is TOKEN. `allocator` and `max_model_len` choose
    the pool's bookkeeping as pagedkvd's settings of the same names do. `blocks_per_page`:
    pages of that many of the tiny model's blocks (page_size; several models on one pool).
    `kv_events`: publish KV events so (every salt's blocks with `kv_events_all_salts`)."""
    async with AsyncExitStack() as stack:
        # Short and private: unix socket paths are limited to ~107 bytes, pytest's tmp_path is
        # long.
        directory = Path(tempfile.mkdtemp(prefix="pkv-"))
        stack.callback(shutil.rmtree, directory, ignore_errors=True)
        memory = None
        if with_memory:
            memory = stack.enter_context(tiny_memory(num_blocks, block_size, blocks_per_page,
                                                     directory))
        pool = BlockPool(num_blocks, block_size, blocks_per_page=blocks_per_page)
        if allocator == "contiguous":
            assert max_model_len is not None, "a contiguous daemon needs max_model_len"
            pool = contiguous_pool(num_blocks, block_size, max_model_len)
            service_options["lends_pages"] = False
        if blocks_per_page > 1:
            dtype = "float32" if with_memory else TINY_CPU_GEOMETRY.default_dtype
            service_options["page_bytes"] = blocks_per_page * TINY_CPU_GEOMETRY.bytes_per_block(
                block_size, dtype_bytes(dtype))
        service = PoolService(pool, memory,
                              pool_id=pool_id or secrets.token_hex(8),
                              geometry=TINY_CPU_GEOMETRY,
                              tenants=tenants or Tenants.single(TOKEN), **service_options)
        await service.start()
        stack.push_async_callback(service.stop)
        events = None
        if kv_events is not None:
            events = EventPublisher(kv_events, service.formats.kv_snapshot)
            events.start()
            stack.push_async_callback(events.close)
            service.formats.publish_events(events, kv_events_all_salts,
                                           service.tenants.public_salts)
        registry = CollectorRegistry()
        registry.register(PoolCollector(service))
        listeners = [parse_listen(f"unix://{directory / 'pagedkv.sock'}")]
        if tcp:
            listeners.append(ANY_LOOPBACK_PORT)
        running = await stack.enter_async_context(grpc_server(
            service, listeners, rpc_metrics=RpcMetrics(registry), tls=tls,
            runner_socket=directory / "runners.sock"))
        tcp_target = running.targets[1] if tcp else None
        assert running.runner_target is not None
        yield Daemon(service, running.targets[0], running.runner_target, tcp_target, memory,
                     registry, running.gate, running.servers, events)
