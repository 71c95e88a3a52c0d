"""The `pagedkv runner` process: map the daemon's pool, load the model, serve the Runner service.

Start, in this order, so READY=1 is true when sent: connect to the daemon and read its pool
(GetPoolInfo), load the model, register it with the daemon (RegisterModel: its name, KV geometry
and this runner's client target; kvpool.proto's "Models and pages"; the daemon refuses a name
taken by another geometry, or a geometry that does not fit its pages), map the model's view of
the pool memory (the answer's ModelInfo.memory; a daemon that gives none: its own model's, which
the model must then fit), start the step engine, bind the gRPC listener (Runner, health,
reflection), start /metrics, then READY=1. A step on a session of another model than the one
registered is refused before anything changes (StepEngine's model check).

A runner crash loses no KV: the pool lives in the daemon, so a restarted runner maps it again and
clients go on (a sequence it does not know is resent with its history). A daemon restart is seen
by a watcher that reads GetPoolInfo every POOL_CHECK_INTERVAL_S (every AWAY_CHECK_INTERVAL_S
while steps are refused, and at once when a step found the daemon gone, so a restored daemon
is mapped within a poll of its READY=1): while the daemon is away or the pool is new, steps
answer UNAVAILABLE with a clear message, and the runner registers its model again and maps
the new pool (clients' sessions died with the old daemon; they open new ones).
A daemon that restored its predecessor's state onto the same memory (restore = auto:
PoolInfo.previous_pool_id names the pool this runner mapped) kept the sessions, their tables
and the blocks' bytes: the runner registers its model and maps the memory again, and keeps
every sequence it knows; its holds are the restored ones (the daemon re-took its pidfd).
Once the daemon has not answered for POOL_RELEASE_GRACE_S, the runner unmaps its pool, between
two forwards: a crashed daemon's /dev/shm pool keeps its pages for as long as any process maps
it, and a new daemon sized for the same /dev/shm could not create its own. It maps the pool
again when the daemon answers (the same one, if the daemon was only unreachable). With
`keep_pool`, it keeps a descriptor of the pool file it mapped and hands it back to a restarting
daemon that has no fd store (pool_keeper.py).

Its gRPC server is built, bound, drained and stopped by the bring-up the daemon shares
(process/grpc_server.py): the same message limit, bounds, health and reflection. SIGTERM:
health NOT_SERVING, step streams ended between two steps, stop accepting, let in-flight steps
finish for SHUTDOWN_GRACE_S.
"""

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.registry import CollectorRegistry

from pagedkv.client import (
    DaemonUnavailable,
    InvalidArgument,
    ModelExists,
    PagedKVError,
    PoolClient,
    PoolInfo,
    SeqStep,
    StepOutputs,
)
from pagedkv.memory import PoolMemoryHandle
from pagedkv.memory.attach import attach_pool
from pagedkv.memory.cuda_driver import require_driver_for_torch
from pagedkv.model_runner.engine.answer_limits import AnswerLimits
from pagedkv.model_runner.engine.holds import DEFAULT_HOLD_MS
from pagedkv.model_runner.engine.metrics import RunnerMetrics
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.kernels.attention_backend import BackendName, get_backend
from pagedkv.model_runner.models import (
    ModelMismatch,
    ModelSource,
    check_geometry,
    kv_geometry,
    load_model,
)
from pagedkv.model_runner.process.pool_keeper import PoolKeeper
from pagedkv.model_runner.process.scheduling import compute_first
from pagedkv.model_runner.process.servicer import RunnerServicer, RunnerUnavailable
from pagedkv.model_runner.runner import ModelRunner
from pagedkv.process.grpc_server import GrpcServers, grpc_servers
from pagedkv.process.lifecycle import cancel, stop_on_signals
from pagedkv.process.log_setup import get_logger
from pagedkv.process.notify import notify
from pagedkv.process.pool_keeper_socket import keeper_path
from pagedkv.process.probes import metrics_app, start_http
from pagedkv.process.server_bounds import ServerBounds
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.proto import runner_pb2_grpc
from pagedkv.proto.kvpool_pb2 import PoolMemory
from pagedkv.vocab.paths import (
    DAEMON_RUNNER_SOCKET_NAME,
    default_daemon_runner_socket,
    default_runner_listen,
)

log = get_logger(__name__)

# How often the watcher asks the daemon which pool it serves.
POOL_CHECK_INTERVAL_S = 1.0
# How often it asks while steps are refused (the daemon away: an upgrade's gap is waited out
# by every client's step).
AWAY_CHECK_INTERVAL_S = 0.05
# How long the daemon stays away before the runner unmaps its pool: a step whose daemon call
# went through before the daemon left finishes its forward meanwhile, and a restarted daemon
# that adopts the same memory (an upgrade's standby) usually answers sooner.
POOL_RELEASE_GRACE_S = 1.0
RUNNER_SERVICE = rpb.DESCRIPTOR.services_by_name["Runner"].full_name
# Why steps are refused while the daemon does not answer.
UNAVAILABLE = "the pagedkv daemon is unavailable; the runner is reconnecting"
# Group may connect (the clients' group); others may not.
SOCKET_MODE = 0o660


@dataclass(frozen=True, slots=True)
class RunnerConfig:
    """Everything `pagedkv runner` needs."""

    # The model to serve.
    model: ModelSource
    # The name it registers under with the daemon, which its clients' sessions name; None:
    # `model.pool_name` (a preset's name, a model folder's basename), as the daemon names its
    # own model from its model_config.
    model_name: str | None = None
    # The daemon's runner socket: runners alone get the pool memory and act for any session.
    daemon: str = field(default_factory=lambda: default_daemon_runner_socket(os.environ))
    # Where the Runner service listens (a unix socket: the runner is co-located).
    listen: str = field(default_factory=lambda: default_runner_listen(os.environ))
    # "auto" (Triton on CUDA, the C kernels on CPU), "triton", "cpu" or "torch".
    attention_backend: BackendName = "auto"
    # Prometheus /metrics, /healthz, /readyz on host:port, or None.
    metrics_listen: str | None = None
    # Most tokens one forward pass computes (a longer prefill is split across forwards).
    max_batch_tokens: int = 8192
    # How long each daemon call before a forward holds the client's session (kvpool.proto's
    # "Runner holds"); at most the daemon's max_hold_ms.
    hold_ms: int = DEFAULT_HOLD_MS
    # Calls the Runner server serves at once (one more: RESOURCE_EXHAUSTED from gRPC), and its
    # connections' keepalive and idle bounds.
    server_bounds: ServerBounds = field(default_factory=ServerBounds)
    # What one step may ask for: logprobs per sequence, and its answer's encoded size.
    answer_limits: AnswerLimits = field(default_factory=AnswerLimits)
    # The tokenizer's folder, which structured outputs compile against; None: the model
    # folder's (a random-init preset has none: structured outputs are refused).
    tokenizer: str | None = None
    # Replay decode steps from CUDA graphs captured per batch-size bucket (decode_graphs.py);
    # refused on a CPU pool and with the torch backend. Off: every step eager.
    cuda_graphs: bool = False
    # Keep a descriptor of the mapped pool file and hand it back to a restarting daemon that
    # has no fd store (pool_keeper.py); off: the pool's memory is freed once the runner
    # unmaps it while its daemon is away.
    keep_pool: bool = False


class RunnerState:
    """What the servicer reads about the running runner; updated when the pool changes."""

    def __init__(self, engine: StepEngine, info: PoolInfo, model: str, backend: str,
                 model_name: str, kv_cache_dtype: str) -> None:
        self.engine = engine
        self.info = info
        self.model = model
        self.backend = backend
        # The runner's --kv-cache-dtype: RunnerInfo's dtype is its cache's.
        self.kv_cache_dtype = kv_cache_dtype
        # The name the model is registered under with the daemon (RunnerInfo.model_name).
        self.model_name = model_name
        # This process's RunnerInfo.runner_id: a client that sees it change after a lost
        # answer knows the runner restarted and holds none of its sequences.
        self.runner_id = uuid.uuid4().hex
        # Why steps are refused now (the daemon is away or restarted), or None.
        self._unavailable: str | None = None
        # Set when steps start being refused: the watcher checks the pool at once.
        self._check_now = asyncio.Event()
        # When steps last started being refused (monotonic seconds; read while they are).
        self._refused_since = 0.0

    @property
    def unavailable(self) -> str | None:
        """Why steps are refused now (the daemon is away or restarted), or None."""
        return self._unavailable

    @unavailable.setter
    def unavailable(self, reason: str | None) -> None:
        if reason is not None and self._unavailable is None:
            self._check_now.set()
            self._refused_since = time.monotonic()
        self._unavailable = reason

    def refused_for_s(self) -> float:
        """Seconds since steps started being refused (0.0 while they are taken)."""
        return time.monotonic() - self._refused_since if self._unavailable is not None else 0.0

    async def next_check(self) -> None:
        """Wait for the watcher's next pool check: POOL_CHECK_INTERVAL_S while steps are taken,
        AWAY_CHECK_INTERVAL_S while they are refused, none when they just started to be."""
        interval = POOL_CHECK_INTERVAL_S if self._unavailable is None else AWAY_CHECK_INTERVAL_S
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._check_now.wait(), interval)
        self._check_now.clear()

    async def step(self, session_id: str, requests: Sequence[SeqStep],
                   release: Sequence[int]) -> StepOutputs:
        """The engine's step, refused while the pool is unavailable."""
        if self.unavailable is not None:
            raise RunnerUnavailable(self.unavailable)
        try:
            return await self.engine.step(session_id, requests, release)
        except DaemonUnavailable:
            self._daemon_gone(session_id)
            raise

    def _daemon_gone(self, session_id: str) -> None:
        """A daemon call of the session's step met the daemon gone: what the daemon applied is
        unknown (it may come back from its crash log), so the session's sequences are
        forgotten, the client's resend is read back from the daemon's records (the promise of
        a relayed DaemonUnavailable), and steps wait until the watcher has checked the pool."""
        self.engine.sessions.forget(session_id)
        self.unavailable = UNAVAILABLE

    async def follow(self, session_id: str, implied: Sequence[SeqStep],
                     deliver: Callable[[StepOutputs], None],
                     until: asyncio.Future[Any]) -> list[SeqStep] | None:
        """The engine's decode run of a followed session (its implied steps), refused while
        the pool is unavailable. A daemon Step of the run (a reservation renewed) that meets
        the daemon gone is met as in `step`: its push fails with DaemonUnavailable, which the
        client resends with histories."""
        if self.unavailable is not None:
            raise RunnerUnavailable(self.unavailable)
        try:
            return await self.engine.follow(session_id, implied, deliver, until)
        except DaemonUnavailable:
            self._daemon_gone(session_id)
            raise

    @property
    def metrics(self) -> RunnerMetrics | None:
        """The runner's figures (the servicer counts pushes there)."""
        return self.engine.metrics

    def runner_info(self) -> rpb.RunnerInfo:
        runner = self.engine.runner
        layers, kv_heads, head_dim, dtype = kv_geometry(runner.model, self.kv_cache_dtype)
        return rpb.RunnerInfo(model=self.model, vocab_size=runner.vocab_size,
                              num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                              dtype=dtype, eos_token_ids=runner.eos_token_ids,
                              pool_id=self.info.pool_id,
                              block_size=self.info.block_size,
                              attention_backend=self.backend,
                              max_model_len=runner.max_model_len, runner_id=self.runner_id,
                              model_name=self.model_name)


async def serve(config: RunnerConfig, stop: asyncio.Event | None = None) -> None:
    """Run the runner until SIGTERM/SIGINT (or until `stop` is set)."""
    async with contextlib.AsyncExitStack() as stack:
        if stop is None:
            stop = stack.enter_context(stop_on_signals())
        pool = await PoolClient.connect(config.daemon)
        stack.push_async_callback(pool.close)
        info = await pool.pool_info()
        if not info.memory.kind:
            raise ValueError(f"the daemon at {config.daemon} gave no pool memory: connect the "
                             "runner to the daemon's runner socket (its runner_socket, "
                             f"{DAEMON_RUNNER_SOCKET_NAME} by default), not its public one")
        device = _pool_device(info)
        if config.cuda_graphs and device == "cpu":
            raise ValueError("--cuda-graphs needs the pool on a CUDA device: eager is the only "
                             "path on the CPU")
        if device != "cpu":  # before torch opens it: it would only say it sees no device
            require_driver_for_torch()
        model = load_model(config.model, device=device)
        name = config.model_name or config.model.pool_name
        backend = get_backend(config.attention_backend, model.device)
        target = f"unix://{_listen_path(config.listen).absolute()}"
        keeper = _pool_keeper(config, target)

        async def attach(info: PoolInfo) -> ModelRunner:
            """The model registered with the daemon of `info`, on its view of the memory."""
            memory = await _register(pool, name, model, config.model.kv_cache_dtype, target,
                                     info)
            handle = PoolMemoryHandle.from_proto(memory)
            runner = ModelRunner(model, attach_pool(handle, config.daemon), info.block_size,
                                 backend)
            if keeper is not None:
                keeper.keep(handle, config.daemon)
            if config.cuda_graphs:  # captured on this pool's addresses: again on each attach
                await asyncio.to_thread(runner.capture_decode_graphs)
            return runner

        registry = CollectorRegistry()
        runner = await attach(info)
        if runner.pool.device.type == "cuda":  # compile every kernel variant before READY
            await asyncio.to_thread(runner.warm_up)
        engine = StepEngine(pool, runner,
                            max_batch_tokens=config.max_batch_tokens,
                            metrics=RunnerMetrics(registry), hold_ms=config.hold_ms,
                            answer_limits=config.answer_limits, model=name,
                            tokenizer=config.tokenizer or config.model.path)
        await engine.start()
        stack.push_async_callback(engine.stop)
        await engine.forwards.between_forwards(compute_first)  # scheduling.py
        state = RunnerState(engine, info, config.model.name, backend.name, name,
                            config.model.kv_cache_dtype)
        servers = await stack.enter_async_context(_grpc_server(config, state))
        if keeper is not None:  # its socket beside the Runner socket, whose folder is made
            await keeper.start()
            stack.push_async_callback(keeper.close)
        if config.metrics_listen is not None:
            host, _, port = config.metrics_listen.rpartition(":")
            http = await start_http(metrics_app(registry, lambda: state.unavailable),
                                    host, int(port))
            stack.push_async_callback(http.cleanup)
        watcher = asyncio.create_task(_watch_pool(state, pool, attach))
        stack.push_async_callback(cancel, watcher)
        notify("READY=1", f"STATUS=serving {name} on pool {info.pool_id}")
        log.info("ready", model=config.model.name, model_name=name, pool_id=info.pool_id,
                 listen=config.listen, attention_backend=backend.name)
        await _until_stopped(stop, watcher)
        await servers.drain()
    log.info("stopped")


async def _until_stopped(stop: asyncio.Event, watcher: asyncio.Task[None]) -> None:
    """Wait for `stop`; a pool watcher that ended (it runs until cancelled) re-raises its
    error here, so a runner that can no longer map its daemon's pool exits saying why instead
    of serving refusals forever."""
    stopped = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({stopped, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        await cancel(stopped)
    if watcher.done():
        watcher.result()


def _pool_keeper(config: RunnerConfig, target: str) -> PoolKeeper | None:
    """The keeper of the pool's descriptor (`keep_pool`), at the socket the daemon derives
    from the runner target this runner registers."""
    if not config.keep_pool:
        return None
    path = keeper_path(target)
    assert path is not None, "the Runner listens on a unix socket"
    return PoolKeeper(path)


def _pool_device(info: PoolInfo) -> str:
    return "cpu" if info.memory.device_index < 0 else f"cuda:{info.memory.device_index}"


def _listen_path(listen: str) -> Path:
    return Path(listen.removeprefix("unix://").removeprefix("unix:"))


async def _register(pool: PoolClient, name: str, model: Any, kv_cache_dtype: str, target: str,
                    info: PoolInfo) -> PoolMemory:
    """Register the model with the daemon (idempotent: again after the daemon restarted) and
    return its view of the pool memory; from a daemon that gives none, its own model's memory
    (info.memory), which the model must then fit (ModelMismatch otherwise). A name taken by
    another geometry, or a geometry the daemon's pages cannot hold, is ModelMismatch (a restart
    fails alike)."""
    layers, kv_heads, head_dim, dtype = kv_geometry(model, kv_cache_dtype)
    try:
        registered = await pool.register_model(name, layers, kv_heads, head_dim, dtype, target)
    except (ModelExists, InvalidArgument) as exc:
        raise ModelMismatch(f"the daemon refused to register model {name!r}: {exc.message}; "
                            "choose another --model-name, or start the daemon with a "
                            "page_size this model's blocks divide") from None
    if registered.memory.kind:
        return registered.memory
    check_geometry(model, info, kv_cache_dtype)
    return info.memory


@contextlib.asynccontextmanager
async def _grpc_server(config: RunnerConfig, state: RunnerState) -> AsyncIterator[GrpcServers]:
    """The Runner server on `config.listen`, started and SERVING; stopped on exit."""
    # Answers are bounded below MAX_MESSAGE_BYTES (answer_limits); requests up to it.
    servicer = RunnerServicer(state.step, state.runner_info,
                              lambda exc: log.error("step failed", exc_info=exc),
                              state.metrics, state.follow)
    async with grpc_servers(RUNNER_SERVICE, config.server_bounds) as servers:
        servers.on_drain.append(servicer.end_streams)
        server = servers.add_server(
            lambda server: runner_pb2_grpc.add_RunnerServicer_to_server(servicer, server))
        # The socket 0o660 (the pagedkv group), its folder 0o750; a live runner's socket is
        # refused, a crashed one's removed.
        servers.bind_unix(server, _listen_path(config.listen), SOCKET_MODE)
        await servers.start()
        await servers.set_serving()
        yield servers


async def _watch_pool(state: RunnerState, pool: PoolClient,
                      attach: Callable[[PoolInfo], Awaitable[ModelRunner]]) -> None:
    """Notice a daemon that went away or restarted, and map the pool again when it is back
    (`attach`: the model registered again, on its view of the pool memory)."""
    while True:
        await state.next_check()
        try:
            info = await pool.pool_info()
            kept = info.previous_pool_id == state.info.pool_id
            if info.pool_id != state.info.pool_id and kept and info.recovered_from_crash_log:
                log.warning("daemon recovered from its crash log: mapping the same memory, "
                            "forgetting what the runner computed past committed tokens",
                            old=state.info.pool_id, new=info.pool_id)
                state.engine.forget_all()
                state.engine.runner = await attach(info)
                state.info = info
            elif info.pool_id != state.info.pool_id and kept:
                log.info("daemon restarted with its pool kept: registering the model, mapping "
                         "the same memory, keeping the sessions", old=state.info.pool_id,
                         new=info.pool_id)
                state.engine.runner = await attach(info)
                state.info = info
            elif info.pool_id != state.info.pool_id:
                log.warning("daemon restarted: registering the model, mapping its new pool",
                            old=state.info.pool_id, new=info.pool_id)
                state.unavailable = "the pagedkv daemon restarted; open a new session"
                state.engine.runner = await attach(info)
                state.engine.forget_all()
                state.info = info
            elif state.engine.runner.released:  # the daemon was only unreachable
                state.engine.runner = await attach(info)
                log.info("pool mapped again", pool_id=info.pool_id)
        except DaemonUnavailable:
            if state.unavailable is None:
                log.warning("daemon unavailable", daemon_pool=state.info.pool_id)
            state.unavailable = UNAVAILABLE
            if state.refused_for_s() >= POOL_RELEASE_GRACE_S:
                await _release_pool(state)
            continue
        except PagedKVError as exc:  # the daemon answered, but not yet as asked: try again
            log.warning("pool check failed; trying again", error=str(exc))
            continue
        state.unavailable = None


async def _release_pool(state: RunnerState) -> None:
    """Unmap the pool of a daemon that does not answer, once no forward runs (steps are refused
    already): its memory is freed if the daemon is gone, and a new daemon has room for its own."""
    runner = state.engine.runner
    if not runner.released:
        await state.engine.forwards.between_forwards(runner.release_pool)
        log.warning("pool released: the daemon is away", pool_id=state.info.pool_id)
