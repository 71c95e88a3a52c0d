"""The pagedkvd process: allocate the pool, serve gRPC, tell systemd, drain on SIGTERM.

Start, in this order, so that READY=1 is true when sent: remove pool files left by a crashed
daemon, allocate the pool memory and the block pool, build the gRPC servers (`grpc_server`,
through the runner's bring-up too, process/grpc_server.py: interceptor, message limit, bounds,
KVPool, health, reflection; one for the listeners, one for the runner socket, whose every
caller is a runner), bind every listener, start them, start the metrics HTTP server, then
READY=1. The tests' in-process daemon builds its gRPC servers with the same `grpc_server`.

Stop (SIGTERM or SIGINT): STOPPING=1 and health NOT_SERVING so balancers and clients move
away, then the gRPC server stops accepting and lets in-flight calls finish for up to
SHUTDOWN_GRACE_S (process/grpc_server.py), then the lease reaper stops, with restore = "auto"
the sessions and tables are written to a snapshot (restart.py), and the pool memory is
released (its shm file unlinked unless the service manager keeps it, or, without one, a
runner keeps its descriptor: daemon/memory/pool_keepers.py). The next start has a new pool_id:
clients recompute their tables from scratch, unless it restored the snapshot onto the same
memory (restart.py), before any listener was bound. Pool memory work that fails
stops the daemon the same way (fail-stop, daemon/service/memory_order.py), with a failure
exit status: its supervisor restarts it.
"""

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch
from prometheus_client.registry import CollectorRegistry

from pagedkv.daemon.core import BlockPool
from pagedkv.daemon.edge.addresses import ListenAddress, parse_host_port
from pagedkv.daemon.edge.interceptors import ServerInterceptor
from pagedkv.daemon.edge.metrics import EventCollector, PoolCollector, Readiness, RpcMetrics
from pagedkv.daemon.edge.peer_gate import PeerGate, gate_folder
from pagedkv.daemon.edge.servicer import KVPoolServicer, add_to_server
from pagedkv.daemon.edge.tls import ServerTls
from pagedkv.daemon.events.sink import ManagedSink
from pagedkv.daemon.memory.host_memory import HostMemory
from pagedkv.daemon.memory.kv_memory import KVMemory, KVPoolMemory, cleanup_stale_files
from pagedkv.daemon.memory.memory_server import MemoryServer
from pagedkv.daemon.memory.pool_handover import HOST_FD_PREFIX, PoolHandover, PoolLayout
from pagedkv.daemon.memory.pool_keepers import leave_for_keepers, taken_back
from pagedkv.daemon.process.config import (
    DEFAULT_SOCKET_MODE,
    MAX_LEASE_TTL_MS,
    RUNNER_GROUP_MODE,
    RUNNERS_ONLY_MODE,
    DaemonConfig,
)
from pagedkv.daemon.process.crash_restore import (
    end_crash_log,
    replay_crash_log,
    start_crash_log,
)
from pagedkv.daemon.process.event_sink import make_event_sink, start_event_sink
from pagedkv.daemon.process.restart import (
    keep_state,
    pool_identity,
    restore_state,
    state_dir,
    state_image,
)
from pagedkv.daemon.process.settings import ConfigError
from pagedkv.daemon.service.memory_order import MemoryOrder
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.demo.contiguous import contiguous_pool
from pagedkv.memory.cuda_driver import CudaDriverTooOld, require_driver_for_torch
from pagedkv.memory.device_memory import measure
from pagedkv.memory.memory_socket import memory_socket_path
from pagedkv.process.fd_store import listened_fds, store_enabled
from pagedkv.process.grpc_server import GrpcServers, StartupError, grpc_servers
from pagedkv.process.lifecycle import cancel, stop_on_signals
from pagedkv.process.log_setup import get_logger
from pagedkv.process.notify import notify, watchdog_interval_s
from pagedkv.process.probes import metrics_app, start_http
from pagedkv.process.socket_files import SocketInUse, claim_socket_path
from pagedkv.proto import kvpool_pb2
from pagedkv.vocab.geometry import ModelGeometry, cache_dtype, dtype_bytes, resolve_geometry
from pagedkv.vocab.pool_sizing import kv_budget, num_blocks_for_bytes
from pagedkv.vocab.units import format_bytes

# The gRPC service name clients, health checks and reflection use.
KVPOOL_SERVICE = kvpool_pb2.DESCRIPTOR.services_by_name["KVPool"].full_name

log = get_logger(__name__)


@dataclass(frozen=True, slots=True)
class GrpcServer:
    """The daemon's started gRPC servers and what their owner drains or inspects."""

    # The listeners' server and the runner socket's (when there is one); serve() drains them.
    servers: GrpcServers
    # The target each listener serves, in order; a TCP port 0 becomes the port it got.
    targets: tuple[str, ...]
    # The peer-credential gate serving the unix listeners, when tenants list uids.
    gate: PeerGate | None = None
    # The runner socket's target (its callers are runners); None: none.
    runner_target: str | None = None


async def serve(config: DaemonConfig, stop: asyncio.Event | None = None) -> None:
    """Run the daemon until SIGTERM/SIGINT (or until `stop` is set, when given), or until its
    pool memory work fails: then it drains and raises MemoryFailed (fail-stop, memory_order.py),
    and pagedkvd exits with a failure status for its supervisor to restart it."""
    readiness = Readiness()
    async with contextlib.AsyncExitStack() as stack:
        if stop is None:
            stop = stack.enter_context(stop_on_signals())
        running, order = await _start(config, readiness, stack)
        waits = [asyncio.create_task(event.wait()) for event in (stop, order.failed)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        readiness.draining = True
        await running.servers.drain()
    order.check()
    log.info("stopped")


async def _start(config: DaemonConfig, readiness: Readiness,
                 stack: contextlib.AsyncExitStack) -> tuple[GrpcServer, MemoryOrder]:
    """Everything up to READY=1, each part's clean-up pushed on `stack` (undone in reverse);
    returns the servers and the service's memory work (whose failure stops the daemon)."""
    service, memory = await stack.enter_async_context(_pool_service(config))
    readiness.pool_allocated = True
    registry = CollectorRegistry()
    registry.register(PoolCollector(service))
    if config.kv_events_endpoint:  # off: nothing recorded, nothing sent
        crash_log = service.calls.log
        events = make_event_sink(config, service.formats.kv_snapshot, service.event_seq,
                                 None if crash_log is None else crash_log.numbered)
        start_event_sink(events)
        if service.events_cleared_at_start:  # log_replay.py: published events may be lost
            for model in service.models:
                events.cleared(model.name)
        stack.callback(_keep_event_seq, service, events)  # once closed: nothing more is sent
        stack.push_async_callback(events.close)
        service.formats.publish_events(events, config.kv_events_all_salts,
                                       service.tenants.public_salts)
        registry.register(EventCollector(events.counts))
    rpc_metrics = RpcMetrics(registry) if config.metrics_listen else None
    running = await stack.enter_async_context(
        grpc_server(service, config.listeners(), rpc_metrics=rpc_metrics,
                    socket_mode=config.socket_mode, tls=config.server_tls(),
                    runner_socket=config.runner_listener().unix_path,
                    runner_gid=config.runner_gid()))
    await _serve_memory(config, memory.arena, stack)
    readiness.listeners_up = True
    if config.metrics_listen is not None:
        host, port = parse_host_port(config.metrics_listen)
        if config.metrics_open_beyond_loopback():
            log.warning("metrics_listen is not a loopback address and metrics_token_file is "
                        "unset: whoever reaches it reads every tenant's name and figures; set "
                        "metrics_token_file, bind it to 127.0.0.1, or firewall it",
                        metrics_listen=config.metrics_listen)
        http = await start_http(metrics_app(registry, readiness.reason_not_ready,
                                            config.metrics_token()), host, port)
        stack.push_async_callback(http.cleanup)
    status = (f"serving pool {service.pool_id}: {service.pool.num_blocks} blocks x "
              f"{service.pool.block_size} tokens, {format_bytes(memory.nbytes, binary=True)}, "
              f"{config.allocator}")
    notify("READY=1", f"STATUS={status}")
    log.info("ready", status=status, listen=list(running.targets),
             runner_socket=running.runner_target, metrics_listen=config.metrics_listen)
    interval = watchdog_interval_s()
    if interval is not None:
        stack.push_async_callback(cancel, asyncio.create_task(_feed_watchdog(interval)))
    return running, service.memory_order


async def _serve_memory(config: DaemonConfig, arena: KVMemory,
                        stack: contextlib.AsyncExitStack) -> None:
    """Serve a VMM arena's descriptor to the runners beside their socket (memory_server.py),
    once the runner socket is claimed; nothing for a pool the runners open by name or handle."""
    runner_socket = config.runner_listener().unix_path
    if arena.memory_fd < 0 or runner_socket is None:
        return
    server = MemoryServer(memory_socket_path(runner_socket), config.runners_mode,
                          config.runner_gid())
    await server.start(arena.memory_fd, arena.pool_id)
    stack.push_async_callback(server.close)


@contextlib.asynccontextmanager
async def _pool_service(config: DaemonConfig) -> AsyncIterator[tuple[PoolService, KVPoolMemory]]:
    """The pool memory, the block pool and the service with its lease reaper."""
    passed = listened_fds() or _taken_back(config)  # what the last daemon stored, taken once
    handover, host_handover = PoolHandover(passed), PoolHandover(passed, HOST_FD_PREFIX)
    removed = cleanup_stale_files(str(config.shm_dir),
                                  keep=handover.files() + host_handover.files())
    if removed:
        log.info("removed stale pool files", files=[str(path) for path in removed])
    check_device(config.device)
    # The daemon's only tensor work is the memory worker's block copies and zeroing: one
    # intra-op thread leaves a core to the event loop (two threads on a loaded 2-core host made
    # copies 10x slower and stalled KeepAlives; benchmarks/bench_keepalive_stall.py).
    torch.set_num_threads(1)
    geometry, dtype = pool_geometry(config)
    per_block = geometry.bytes_per_block(config.block_size, dtype_bytes(dtype))
    blocks_per_page = pool_blocks_per_page(config, per_block)
    # Whole pages: the daemon's own format's blocks, blocks_per_page of them a page.
    num_blocks = pool_num_blocks(config, geometry, dtype) // blocks_per_page * blocks_per_page
    if not num_blocks:
        raise ConfigError(f"the pool is smaller than one page of page_size={config.page_size}")
    config.check_reservation(num_blocks)
    memory = pool_memory(config, geometry, dtype, num_blocks, blocks_per_page, handover)
    host: HostMemory | None = None
    try:
        host = host_memory(config, memory, geometry, dtype, host_handover)
        log.info("pool allocated", pool_id=memory.pool_id, model=geometry.name, dtype=dtype,
                 device=config.device, num_blocks=num_blocks, block_size=config.block_size,
                 bytes=memory.nbytes, shm_path=memory.handle().shm_path or None,
                 adopted_from=memory.arena.adopted_from or None,
                 allocator=config.allocator, max_model_len=config.max_model_len,
                 prefix_hash=config.prefix_hash)
        build = functools.partial(pool_service, config, memory, host, geometry, num_blocks,
                                  blocks_per_page, per_block)
        service = build()
        identity = pool_identity(config, geometry, dtype, service)
        restored = restore_state(config, service, memory, identity)
        if not restored and config.restore == "auto":  # a refused snapshot may have touched it
            service = build()
            restored = await replay_crash_log(config, service, memory)
            if not restored:  # a refused log may have touched it
                service = build()
        if not restored:
            _start_cold(config, service, memory, host)
        start_crash_log(config, service)
        await service.start()
        image = None
        try:
            yield service, memory
            image = state_image(config, service)  # a clean stop: the calls have drained
        finally:
            await service.stop()
        keep_state(config, service, identity, image)
        end_crash_log(service)
        _leave_for_runners(config, service, memory, geometry, dtype)
    finally:
        if host is not None:
            host.close()
        memory.close()


def _start_cold(config: DaemonConfig, service: PoolService, memory: KVPoolMemory,
                host: HostMemory | None) -> None:
    """Nothing was restored: adopted memory holds no one's blocks now (zeroed when the daemon
    zeroes freed blocks), and the host tier's copy rate is measured before anyone is served
    (a restored one keeps the previous daemon's figure: its pool's blocks are in use)."""
    if memory.arena.adopted_from and config.zero_freed_blocks:
        memory.arena.zero_pages(range(memory.arena.num_pages))  # every block is free
    if host is None:
        return
    if host.adopted_from and config.zero_freed_blocks:
        host.zero(range(host.num_slots))  # every slot is free
    service.host_copy_rate = host.measure_copy_rate()
    log.info("host tier allocated", slots=host.num_slots,
             bytes=host.num_slots * host.bytes_per_block, copy_bytes_per_s=service.host_copy_rate,
             pinned=memory.kv.is_cuda, adopted_from=host.adopted_from or None)


def _taken_back(config: DaemonConfig) -> dict[str, list[int]]:
    """With restore = auto and no fd store: the pool descriptor the runners hand back
    (pool_keepers.py), by its stored name."""
    if config.restore != "auto" or store_enabled():
        return {}
    return taken_back(state_dir(config))


def _leave_for_runners(config: DaemonConfig, service: PoolService, memory: KVPoolMemory,
                       geometry: ModelGeometry, dtype: str) -> None:
    """With restore = auto and no fd store, at a clean stop: the pool file left for the
    runners that keep its descriptor to hand back (pool_keepers.py)."""
    if config.restore != "auto" or store_enabled():
        return
    arena = memory.arena
    layout = pool_layout(config, geometry, dtype, arena.num_pages, arena.page_bytes)
    leave_for_keepers(state_dir(config), arena, layout.fd_name(arena.pool_id),
                      [model.runner_target for model in service.models])


def _keep_event_seq(service: PoolService, events: ManagedSink) -> None:
    """The stopped sink's next seq, for the restart image (the next daemon goes on from it)."""
    service.event_seq = events.next_seq


def own_pool(config: DaemonConfig, num_blocks: int, blocks_per_page: int) -> BlockPool:
    """The daemon's own model's pool: paged, or the contiguous baseline it is measured against
    (the one place the daemon builds it; the config refused what the baseline cannot do)."""
    if config.allocator == "paged":
        return BlockPool(num_blocks, config.block_size, config.enable_prefix_caching,
                         config.prefix_hash, blocks_per_page=blocks_per_page)
    assert config.max_model_len is not None, "a contiguous config without max_model_len"
    return contiguous_pool(num_blocks, config.block_size, config.max_model_len)


def pool_service(config: DaemonConfig, memory: KVPoolMemory, host: HostMemory | None,
                 geometry: ModelGeometry, num_blocks: int, blocks_per_page: int,
                 per_block: int) -> PoolService:
    """The block pool of `num_blocks` blocks of `per_block` bytes, `blocks_per_page` a page,
    over `memory`, and the service on it with `host` as its host tier, with no session."""
    pool = own_pool(config, num_blocks, blocks_per_page)
    try:
        service = PoolService(pool, memory, pool_id=memory.pool_id,
                           default_lease_ttl_ms=config.lease_ttl_ms,
                           max_lease_ttl_ms=MAX_LEASE_TTL_MS, geometry=geometry,
                           zero_freed_blocks=config.zero_freed_blocks,
                           tenants=config.build_tenants(), limits=config.limits(),
                           page_bytes=blocks_per_page * per_block,
                           model_policies=dict(config.models),
                           max_models=config.max_models, prefix_hash=config.prefix_hash,
                           lends_pages=config.allocator == "paged")
    except ValueError as exc:  # the [models.NAME] reserves do not fit in the pool
        raise ConfigError(f"models: {exc}") from exc
    if host is not None:
        service.attach_host_tier(host)
    return service


def host_memory(config: DaemonConfig, memory: KVPoolMemory, geometry: ModelGeometry, dtype: str,
                handover: PoolHandover) -> HostMemory | None:
    """The host tier's slots, `host_tier_memory` bytes of them: the previous daemon's when the
    service manager passed slots of this layout (pool_handover.py), else new ones; stored for
    the next daemon. None without the setting."""
    if not config.host_tier_memory:
        return None
    slots = config.host_tier_memory // memory.bytes_per_block
    if not slots:
        raise ConfigError(f"host_tier_memory={config.host_tier_memory} holds no block of "
                          f"{memory.bytes_per_block} bytes")
    # One block a page, the pool's own format: slot s is page s.
    layout = pool_layout(config, geometry, dtype, slots, memory.bytes_per_block)
    shm_dir = str(config.shm_dir)
    arena = (handover.adopt(layout, shm_dir, 0o600, None)  # the daemon's alone
             or KVMemory.create(slots, memory.bytes_per_block, "cpu", shm_dir, mode=0o600))
    host = HostMemory.over(arena, memory)
    try:
        handover.offer(arena, layout)
    except BaseException:
        host.close()
        raise
    return host


def check_device(device: str) -> None:
    """A clear StartupError when a CUDA device is asked for and torch cannot see it, or the
    driver is too old for torch's CUDA build (torch would only say it sees no device)."""
    if not device.startswith("cuda"):
        return
    try:
        require_driver_for_torch()
    except CudaDriverTooOld as exc:
        raise StartupError(f"device {device}: {exc}") from None
    if not torch.cuda.is_available():
        raise StartupError(f"device {device}: torch sees no CUDA device (driver, "
                           "CUDA_VISIBLE_DEVICES, or a CPU-only torch build)")
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise StartupError(f"device {device}: only {torch.cuda.device_count()} CUDA "
                           "device(s) visible")


def pool_memory(config: DaemonConfig, geometry: ModelGeometry, dtype: str, num_blocks: int,
                blocks_per_page: int, handover: PoolHandover) -> KVPoolMemory:
    """The arena of num_blocks / blocks_per_page pages, seen as the daemon's own model's
    blocks (every other format a view of it: kv_memory.py): the previous daemon's when the
    service manager passed one of this layout (pool_handover.py), else a new one; stored for
    the next daemon."""
    shm_dir, mode, group = str(config.shm_dir), config.runners_mode, config.runner_gid()
    per_block = geometry.bytes_per_block(config.block_size, dtype_bytes(dtype))
    layout = pool_layout(config, geometry, dtype, num_blocks // blocks_per_page,
                         blocks_per_page * per_block)
    arena = handover.adopt(layout, shm_dir, mode, group, config.device)
    if arena is None:  # restore = auto on CUDA: a VMM allocation, which can outlive the daemon
        arena = KVMemory.create(layout.num_pages, layout.page_bytes, device=config.device,
                                shm_dir=shm_dir, mode=mode, group=group,
                                vmm=config.restore == "auto")
    try:
        memory = KVPoolMemory(arena, arena.view(geometry.num_layers, geometry.num_kv_heads,
                                                geometry.head_dim, dtype, config.block_size))
        handover.offer(arena, layout)
    except BaseException:
        arena.close()
        raise
    return memory


def pool_layout(config: DaemonConfig, geometry: ModelGeometry, dtype: str, num_pages: int,
                page_bytes: int) -> PoolLayout:
    """What the pool's bytes mean: `num_pages` pages of `page_bytes`, the own model's format."""
    return PoolLayout(num_pages, page_bytes, dtype, geometry.num_layers, geometry.num_kv_heads,
                      geometry.head_dim, config.block_size)


def pool_blocks_per_page(config: DaemonConfig, per_block: int) -> int:
    """Blocks of the daemon's own model in one page of `page_size` (1 without one)."""
    if config.page_size is None:
        return 1
    if config.page_size % per_block:
        raise ConfigError(f"page_size={config.page_size} is not a multiple of the model's "
                          f"{per_block} bytes per block of {config.block_size} tokens")
    return config.page_size // per_block


def pool_geometry(config: DaemonConfig) -> tuple[ModelGeometry, str]:
    """The model geometry and the canonical KV dtype the pool is laid out for."""
    try:
        geometry = resolve_geometry(config.model_config)
    except ValueError as exc:
        raise ConfigError(f"model_config: {exc}") from exc
    return geometry, cache_dtype(config.dtype or geometry.default_dtype, config.kv_cache_dtype)


def pool_num_blocks(config: DaemonConfig, geometry: ModelGeometry, dtype: str) -> int:
    """Blocks in the pool: given, or what kv_memory or kv_fraction of the device holds."""
    if config.num_blocks is not None:
        return config.num_blocks
    per_block = geometry.bytes_per_block(config.block_size, dtype_bytes(dtype))
    try:
        if config.kv_memory is not None:
            return num_blocks_for_bytes(config.kv_memory, per_block)
        assert config.kv_fraction is not None, "config guarantees one sizing setting"
        memory = measure(config.device, str(config.shm_dir))
        return num_blocks_for_bytes(kv_budget(memory, config.kv_fraction), per_block)
    except ValueError as exc:
        raise ConfigError(f"pool size: {exc}") from exc


@contextlib.asynccontextmanager
async def grpc_server(service: PoolService, listeners: Sequence[ListenAddress], *,
                      rpc_metrics: RpcMetrics | None,
                      socket_mode: int = DEFAULT_SOCKET_MODE,
                      tls: ServerTls | None = None, runner_socket: Path | None = None,
                      runner_gid: int | None = None) -> AsyncIterator[GrpcServer]:
    """The daemon's gRPC server for `service`, started on every listener and SERVING, and a
    second one for runners on `runner_socket` when given (mode 0o600, or 0o660 with group
    `runner_gid`; every call there is a runner's).

    Both are built, bound and stopped by the bring-up the runner shares
    (process/grpc_server.py): messages up to MAX_MESSAGE_BYTES (pagedkv.proto.limits, the limit
    the bundled clients share), the limits' server bounds. Every call passes the interceptor
    (TCP calls need a token of one of `service.tenants`; a log line per call, and `rpc_metrics`
    when given). Unix sockets get exactly `socket_mode` whatever the umask, and are served
    through the peer-credential gate when the tenants list uids (peer_gate.py); TCP listeners
    serve TLS with `tls` (plaintext, with a warning, without it). Stopped, and the socket files
    and gate folders it created removed, on exit. serve() and the tests' daemon both use this.
    """
    # The gate, when unix callers are told apart by uid, and for the runner socket (the pid of
    # each runner: fence.py); its folders are known before binding.
    public_gate = service.tenants.maps_uids
    gate = (PeerGate(service.limits, service.tenants, service.runner_processes)
            if public_gate or runner_socket is not None else None)
    folders = frozenset(str(gate_folder(lst.unix_path)) for lst in listeners
                        if public_gate and lst.unix_path is not None)
    runner_folders = frozenset(() if runner_socket is None else (str(gate_folder(runner_socket)),))
    async with contextlib.AsyncExitStack() as stack:
        if gate is not None:  # stopped after gRPC: the calls it drained needed the gate
            stack.push_async_callback(gate.stop)
        servers = await stack.enter_async_context(
            grpc_servers(KVPOOL_SERVICE, service.limits.server_bounds()))
        # Both servers' calls queue for the same pool: they share its request budget.
        server = _kvpool_server(servers, service, ServerInterceptor(
            service.tenants, rpc_metrics, folders, requests=service.requests))
        runners = None if runner_socket is None else _kvpool_server(
            servers, service, ServerInterceptor(service.tenants, rpc_metrics, runner_folders,
                                                runners=service.runner_processes,
                                                requests=service.requests))
        targets = tuple(_bind(servers, server, listener, socket_mode, tls,
                              gate if public_gate else None)
                        for listener in listeners)
        runner_target = None
        if runners is not None and runner_socket is not None:  # after the listeners' folders
            assert gate is not None, "the runner socket is gated"
            runner_target = _bind_runners(runners, runner_socket, runner_gid, gate)
        await servers.start()
        if gate is not None:
            assert gate.folders() == folders, "the interceptor knows every gate folder"
            assert gate.folders(runners=True) == runner_folders
            await gate.start()
        await servers.set_serving()
        yield GrpcServer(servers, targets, gate, runner_target)


def _kvpool_server(servers: GrpcServers, service: PoolService,
                   interceptor: ServerInterceptor) -> grpc.aio.Server:
    """A gRPC server of KVPool, health and reflection, every call through `interceptor`."""
    # What calls waiting for the pool hold is bounded by the server bounds' calls at once and
    # the request budget (request_budget.py).
    servicer = KVPoolServicer(service)
    servers.on_drain.append(servicer.end_streams)
    return servers.add_server(lambda server: add_to_server(servicer, server), [interceptor])


def _bind(servers: GrpcServers, server: grpc.aio.Server, listener: ListenAddress,
          socket_mode: int, tls: ServerTls | None, gate: PeerGate | None) -> str:
    """Add the listener's port (a unix one through `gate` when given); returns the target it
    serves (with the port TCP got)."""
    if listener.unix_path is not None and gate is None:
        return servers.bind_unix(server, listener.unix_path, socket_mode)
    if listener.unix_path is not None:
        assert gate is not None, "an ungated unix listener was bound above"
        _bind_gated(server, listener.unix_path, socket_mode, gate)
        return listener.target
    try:
        port = _bind_tcp(server, listener.target, tls)
    except RuntimeError as exc:
        raise StartupError(f"cannot listen on {listener.target}: address in use or "
                           "not permitted") from exc
    return f"{listener.target.rpartition(':')[0]}:{port}"


def _bind_runners(server: grpc.aio.Server, path: Path, group: int | None,
                  gate: PeerGate) -> str:
    """Serve the runner socket `path` through `gate`: mode 0o600, or 0o660 with `group` (a
    folder it creates lets the group in). Returns its target."""
    mode = RUNNERS_ONLY_MODE if group is None else RUNNER_GROUP_MODE
    _bind_gated(server, path, mode, gate, group=group, runners=True)
    return f"unix://{path}"


def _bind_gated(server: grpc.aio.Server, path: Path, mode: int, gate: PeerGate, *,
                group: int | None = None, runners: bool = False) -> None:
    """Claim the unix socket `path` and serve it through `gate` (given to `group` when given;
    `runners`: the runner socket). gRPC's own socket is in the gate's private folder: the
    folder's mode guards it; the gate removes the socket it binds when it stops."""
    try:
        claim_socket_path(path, mode)
        server.add_insecure_port(gate.add(path, mode, group=group, runners=runners))
    except SocketInUse as exc:
        raise StartupError(str(exc)) from exc
    except PermissionError as exc:
        raise StartupError(f"cannot give {path} to group {group}: {exc.strerror} (this "
                           "process's user must be a member)") from exc
    except RuntimeError as exc:
        raise StartupError(f"cannot listen on unix://{path}: address in use or not "
                           "permitted") from exc


def _bind_tcp(server: grpc.aio.Server, target: str, tls: ServerTls | None) -> int:
    """Add a TCP port, with TLS when given (else plaintext, with a warning); returns it."""
    if tls is not None:
        return server.add_secure_port(target, tls.credentials())
    log.warning("plaintext TCP listener: bearer tokens cross the network in clear; serve TLS "
                "(tls_cert_file, tls_key_file) unless a private network or a proxy protects it",
                listen=target)
    return server.add_insecure_port(target)


async def _feed_watchdog(interval_s: float) -> None:
    """WATCHDOG=1 every interval from the event loop: a stuck loop stops the pings."""
    while True:
        notify("WATCHDOG=1")
        await asyncio.sleep(interval_s)
