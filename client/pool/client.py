"""A thin typed async client for the pagedkv daemon.

    async with await PoolClient.connect("unix:///run/pagedkv/pagedkvd.sock") as client:
        async with await client.open_session("scheduler-1", lease_ttl_ms=10_000) as session:
            seq = await session.allocate(1, token_ids=prompt)
            step = await session.step([1, 2, 3])        # one round trip for the whole batch

Every call has a deadline (`timeout`), sends the bearer token when one is given (TCP
listeners need it), and raises a `PagedKVError` subclass named after the cause. The channel
sends and accepts messages up to MAX_MESSAGE_BYTES, the limit the daemon bounds its answers by,
so an answer the daemon sends is never refused here. A session (`session.py`) keeps its lease
alive, and recovers calls whose answer was lost as `retry` says (`recovery.py`).
"""

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import grpc

from pagedkv.client.pool.channel import ChannelOwner, open_channel
from pagedkv.client.pool.errors import (
    STATUS_BY_NUMBER,
    DaemonUnavailable,
    InvalidArgument,
    PagedKVError,
    error_from_rpc,
    error_from_status,
)
from pagedkv.client.pool.ops import Step
from pagedkv.client.pool.recovery import LOST, Outcome, RetryPolicy
from pagedkv.client.pool.session import Session
from pagedkv.client.pool.step_stream import StepStream
from pagedkv.client.pool.tls import TlsOptions
from pagedkv.client.pool.types import ModelInfo, PoolInfo, PoolStats, StepResult
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc

# Seconds every call may take unless the client is told otherwise.
DEFAULT_TIMEOUT_S = 5.0
# How sessions recover calls whose answer was lost, unless told otherwise.
DEFAULT_RETRY = RetryPolicy()

Request = TypeVar("Request")
Response = TypeVar("Response")


class PoolClient(ChannelOwner):
    """One channel to the daemon; opens sessions. Create with `await PoolClient.connect(...)`."""

    def __init__(self, channel: grpc.aio.Channel, *, auth_token: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S,
                 retry: RetryPolicy | None = DEFAULT_RETRY, step_stream: bool = True) -> None:
        self._channel = channel
        # The generated stub: package-private, callers use the typed methods.
        self._stub = kvpool_pb2_grpc.KVPoolStub(channel)
        # Deadline of every call, in seconds.
        self.timeout = timeout
        # How sessions recover a call whose answer was lost; None: they raise at once.
        self.retry = retry
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        # step_many's calls, as messages on one stream (step_stream.py); None: unary StepMany.
        self.steps = StepStream(self._stub, self._metadata) if step_stream else None
        self._sessions: set[Session] = set()
        # The pool's free blocks per the latest answer that told them (Batch, Step, StepMany,
        # through any session): what a scheduler admits new sequences by.
        self.free_blocks = 0

    @classmethod
    async def connect(cls, target: str, *, auth_token: str | None = None,
                      timeout: float = DEFAULT_TIMEOUT_S,
                      tls: TlsOptions | None = None,
                      retry: RetryPolicy | None = DEFAULT_RETRY,
                      step_stream: bool = True) -> "PoolClient":
        """Connect to "unix:/path.sock" or "host:port" (over TLS with `tls`: a daemon's TCP
        listener serves TLS unless it runs with insecure_tcp); waits up to `timeout` for the
        daemon, whose certificate must verify. `retry=None` turns off the recovery of calls
        whose answer was lost; `step_stream=False` sends `step_many` as unary StepMany calls
        instead of messages on one StepStream."""
        channel = await open_channel(target, "daemon", DaemonUnavailable, timeout, tls)
        return cls(channel, auth_token=auth_token, timeout=timeout, retry=retry,
                   step_stream=step_stream)

    async def _call(self, method: "grpc.aio.UnaryUnaryMultiCallable[Request, Response]",
                   make_request: Callable[[], Request], timeout: float | None = None) -> Response:
        """Build the request, call with deadline and token, map errors to exceptions."""
        request = _built(make_request)
        try:
            return await method(request, timeout=timeout or self.timeout,
                                metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    async def pool_info(self) -> PoolInfo:
        reply = await self._call(self._stub.GetPoolInfo, pb.GetPoolInfoRequest)
        return PoolInfo.from_proto(reply)

    async def stats(self) -> PoolStats:
        """The pool's capacity (a Session's `stats()` adds its own figures)."""
        return PoolStats.from_proto(await self._call(self._stub.GetStats, pb.GetStatsRequest))

    async def register_model(self, name: str, num_layers: int, num_kv_heads: int,
                             head_dim: int, dtype: str, runner_target: str = "") -> ModelInfo:
        """Register the model a runner computes (runner socket only; kvpool.proto's "Models
        and pages"): idempotent for the same name and geometry (runner_target updated);
        ModelExists for a name taken by another geometry, InvalidArgument for a geometry whose
        blocks do not divide the pool's page_bytes, nothing changed. The answer carries the
        model's view of the pool memory (`ModelInfo.memory`)."""
        reply = await self._call(self._stub.RegisterModel, lambda: pb.RegisterModelRequest(
            name=name, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
            dtype=dtype, runner_target=runner_target))
        return ModelInfo.from_proto(reply)

    async def set_model_state(self, name: str, asleep: bool) -> ModelInfo:
        """Put a model to sleep (its cached blocks dropped, its sessions closed, new ones
        refused with ModelAsleep) or wake it (runner socket only); ModelNotFound if no model of
        that name is registered."""
        reply = await self._call(self._stub.SetModelState, lambda: pb.SetModelStateRequest(
            name=name, asleep=asleep))
        return ModelInfo.from_proto(reply)

    async def open_session(self, client_name: str = "", lease_ttl_ms: int = 0,
                           max_blocks: int = 0, cache_salt: bytes | str = b"", *,
                           keep_alive: bool = True, model: str = "") -> "Session":
        """A new session. lease_ttl_ms=0: the daemon's default; max_blocks=0: the daemon's
        max_blocks_per_session (more is clamped to it; `Session.max_blocks` says what was
        granted); sessions with the same non-empty cache_salt share prefix-cache blocks.
        `model`: the registered model whose K/V the session holds ("" = the daemon's own;
        `Session.model` says which): step it only on that model's runner. ModelNotFound for a
        name nobody registered, ModelAsleep for a model asleep."""
        salt = cache_salt.encode() if isinstance(cache_salt, str) else cache_salt
        reply = await self._call(self._stub.OpenSession, lambda: pb.OpenSessionRequest(
            client_name=client_name, lease_ttl_ms=lease_ttl_ms, max_blocks=max_blocks,
            cache_salt=salt, model=model))
        session = Session(self, reply.session_id, reply.block_size,
                          lease_ttl_ms=reply.lease_ttl_ms, pool_id=reply.pool_id,
                          max_blocks=reply.max_blocks, model=reply.model)
        self._sessions.add(session)
        if keep_alive:
            session.start_keep_alive()
        return session

    def attach(self, session_id: str, block_size: int) -> Session:
        """A handle on a session another process opened and keeps alive (a runner acting for
        its client): calls under it, with no KeepAlive from here and no close by `close`."""
        return Session(self, session_id, block_size)

    async def step_many(self, steps: Sequence[tuple[Session, Step]]
                        ) -> list[StepResult | PagedKVError]:
        """Several sessions' Steps in one call (kvpool.proto StepMany, sent as a message on the
        client's StepStream unless made with step_stream=False): per entry, in order, its
        result or the exception of its own status (that entry changed nothing). A call whose
        answer was lost (its deadline passed, its stream broke) is read back entry by entry,
        each as its session's lost Step (`Session.step`): some entries may have been applied
        and others not."""
        read_backs = [session.step_read_back(op) for session, op in steps]
        try:
            reply = await self._step_many(lambda: pb.StepManyRequest(
                steps=[op.request(session.session_id) for session, op in steps]))
        except LOST as lost:
            return list(await asyncio.gather(*(
                _recovered(session, op, lost, read_back)
                for (session, op), read_back in zip(steps, read_backs, strict=True))))
        if len(reply.results) != len(steps):
            raise PagedKVError(grpc.StatusCode.INTERNAL, f"StepMany answered {len(reply.results)}"
                               f" results for {len(steps)} entries")
        self.free_blocks = reply.free_blocks
        return [session.stepped(op, StepResult.from_proto(result.step)) if result.code == 0
                else error_from_status(STATUS_BY_NUMBER.get(result.code, grpc.StatusCode.UNKNOWN),
                                       result.cause, result.message)
                for (session, op), result in zip(steps, reply.results, strict=True)]

    async def _step_many(self, make_request: Callable[[], pb.StepManyRequest]
                         ) -> pb.StepManyResponse:
        """A StepMany on the client's stream; a unary call when it has none, or the daemon
        serves none (UNIMPLEMENTED: nothing was applied)."""
        if self.steps is not None and self.steps.served:
            try:
                return await self.steps.call(_built(make_request), self.timeout)
            except PagedKVError:
                if self.steps.served:
                    raise
        return await self._call(self._stub.StepMany, make_request)

    def forget(self, session: "Session") -> None:
        self._sessions.discard(session)

    async def close(self) -> None:
        """Close the sessions still open (best effort), then the channel."""
        for session in list(self._sessions):
            with contextlib.suppress(PagedKVError):
                await session.close()
        if self.steps is not None:
            await self.steps.close()
        await super().close()


def _built(make_request: Callable[[], Request]) -> Request:
    """The request `make_request` builds; InvalidArgument if protobuf refuses a value."""
    try:
        return make_request()
    except (TypeError, ValueError) as exc:  # protobuf refuses e.g. a negative seq_id
        raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


async def _recovered(session: Session, op: Step, lost: PagedKVError,
                     read_back: Callable[[], Awaitable[Outcome[StepResult]]]
                     ) -> StepResult | PagedKVError:
    """A lost StepMany entry's result, read back, or the error that ended its recovery."""
    try:
        return await session.recover_step(op, lost, read_back)
    except PagedKVError as exc:
        return exc
