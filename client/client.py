"""A thin typed async client for the pagedkv daemon.

    async with await PoolClient.connect("unix:/run/pagedkv/pagedkv.sock") as client:
        async with await client.open_session("scheduler-1", lease_ttl_ms=10_000) as session:
            seq = await session.allocate(1, token_ids=prompt)
            step = await session.step([1, 2, 3])        # one round trip for the whole batch

Every call has a deadline (`timeout`), sends the bearer token when one is given (TCP
listeners need it), and raises a `PagedKVError` subclass named after the cause. A session keeps
its lease alive from a background task (KeepAlive every lease/3), so it lives exactly as long
as this process: if the process dies, the daemon frees its sequences when the lease runs out.
"""

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Self, TypeVar

import grpc

from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc

from .errors import (
    DaemonUnavailable,
    InvalidArgument,
    NotFound,
    PagedKVError,
    SessionExpired,
    error_from_rpc,
)
from .ops import Allocate, Append, Commit, CopyOnWrite, Fork, Free, Operation
from .tls import TlsOptions
from .types import PoolInfo, PoolStats, SequenceBlocks, StepResult

log = logging.getLogger(__name__)

# Seconds every call may take unless the client is told otherwise.
DEFAULT_TIMEOUT_S = 5.0

Request = TypeVar("Request")
Response = TypeVar("Response")


class PoolClient:
    """One channel to the daemon; opens sessions. Create with `await PoolClient.connect(...)`."""

    def __init__(self, channel: grpc.aio.Channel, *, auth_token: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self._channel = channel
        self.stub = kvpool_pb2_grpc.KVPoolStub(channel)
        # Deadline of every call, in seconds.
        self.timeout = timeout
        self._metadata = (("authorization", f"Bearer {auth_token}"),) if auth_token else ()
        self._sessions: set[Session] = set()

    @classmethod
    async def connect(cls, target: str, *, auth_token: str | None = None,
                      timeout: float = DEFAULT_TIMEOUT_S,
                      tls: TlsOptions | None = None) -> "PoolClient":
        """Connect to "unix:/path.sock" or "host:port" (over TLS with `tls`: a daemon's TCP
        listener serves TLS unless it runs with insecure_tcp); waits up to `timeout` for the
        daemon, whose certificate must verify."""
        channel = (grpc.aio.insecure_channel(target) if tls is None else
                   grpc.aio.secure_channel(target, tls.credentials(), tls.channel_options()))
        try:
            await asyncio.wait_for(channel.channel_ready(), timeout)
        except TimeoutError:
            await channel.close(grace=None)
            raise DaemonUnavailable(grpc.StatusCode.UNAVAILABLE, f"no pagedkv daemon answered "
                                    f"at {target} within {timeout} s") from None
        return cls(channel, auth_token=auth_token, timeout=timeout)

    async def call(self, method: "grpc.aio.UnaryUnaryMultiCallable[Request, Response]",
                   make_request: Callable[[], Request], timeout: float | None = None) -> Response:
        """Build the request, call with deadline and token, map errors to exceptions."""
        try:
            request = make_request()
        except (TypeError, ValueError) as exc:  # protobuf refuses e.g. a negative seq_id
            raise InvalidArgument(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        try:
            return await method(request, timeout=timeout or self.timeout,
                                metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc) from None

    async def pool_info(self) -> PoolInfo:
        reply = await self.call(self.stub.GetPoolInfo, pb.GetPoolInfoRequest)
        return PoolInfo.from_proto(reply)

    async def stats(self) -> PoolStats:
        """Pool-wide figures (a Session's `stats()` adds its own)."""
        return PoolStats.from_proto(await self.call(self.stub.GetStats, pb.GetStatsRequest))

    async def open_session(self, client_name: str = "", lease_ttl_ms: int = 0,
                           max_blocks: int = 0, cache_salt: bytes | str = b"", *,
                           keep_alive: bool = True) -> "Session":
        """A new session. lease_ttl_ms=0: the daemon's default; max_blocks=0: no quota;
        sessions with the same non-empty cache_salt share prefix-cache blocks."""
        salt = cache_salt.encode() if isinstance(cache_salt, str) else cache_salt
        reply = await self.call(self.stub.OpenSession, lambda: pb.OpenSessionRequest(
            client_name=client_name, lease_ttl_ms=lease_ttl_ms, max_blocks=max_blocks,
            cache_salt=salt))
        session = Session(self, reply)
        self._sessions.add(session)
        if keep_alive:
            session.start_keep_alive()
        return session

    def forget(self, session: "Session") -> None:
        self._sessions.discard(session)

    async def close(self) -> None:
        """Close the sessions still open (best effort), then the channel."""
        for session in list(self._sessions):
            with contextlib.suppress(PagedKVError):
                await session.close()
        await self._channel.close(grace=None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class Session:
    """A lease on the daemon and the sequences under it. Get one from `open_session`."""

    def __init__(self, client: PoolClient, reply: pb.OpenSessionResponse) -> None:
        self._client = client
        self._stub = client.stub
        # The credential naming this session on every call.
        self.session_id = reply.session_id
        # The lease the daemon granted, the daemon run, and the pool's tokens per block.
        self.lease_ttl_ms = reply.lease_ttl_ms
        self.pool_id = reply.pool_id
        self.block_size = reply.block_size
        # Why the background KeepAlive stopped (the session expired), else None.
        self.lease_error: PagedKVError | None = None
        self._keep_alive_task: asyncio.Task[None] | None = None
        self._closed = False

    # ------------------------------------------------------------------ lease

    def start_keep_alive(self) -> None:
        if self._keep_alive_task is None:
            self._keep_alive_task = asyncio.create_task(self._keep_alive_forever())

    async def _keep_alive_forever(self) -> None:
        period = self.lease_ttl_ms / 3000
        while True:
            await asyncio.sleep(period)
            try:
                await self._client.call(self._stub.KeepAlive, self._session_request(
                    pb.KeepAliveRequest), timeout=min(period, self._client.timeout))
            except (SessionExpired, NotFound) as exc:
                self.lease_error = exc
                log.warning("pagedkv session lease lost: %s", exc.message)
                return
            except PagedKVError as exc:  # a slow or restarting daemon: try again next period
                log.warning("pagedkv KeepAlive failed: %s", exc)

    async def keep_alive(self) -> int:
        """Renew the lease now (any call does); returns the lease in ms."""
        reply = await self._client.call(self._stub.KeepAlive,
                                        self._session_request(pb.KeepAliveRequest))
        return reply.lease_ttl_ms

    async def close(self) -> int:
        """Free every sequence and end the session; returns how many sequences were freed.

        Idempotent; a session the daemon already expired has nothing left to free (0). A close
        that fails otherwise (INTERNAL, UNAVAILABLE) changed nothing and may be retried.
        """
        if self._keep_alive_task is not None:
            self._keep_alive_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keep_alive_task
            self._keep_alive_task = None
        if self._closed:
            return 0
        try:
            reply = await self._client.call(self._stub.CloseSession,
                                            self._session_request(pb.CloseSessionRequest))
            freed = reply.freed_sequences
        except (SessionExpired, NotFound):
            freed = 0
        self._closed = True
        self._client.forget(self)
        return freed

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -------------------------------------------------------------- sequences

    async def allocate(self, seq_id: int, num_tokens: int | None = None,
                       token_ids: Sequence[int] = ()) -> SequenceBlocks:
        """A new sequence; num_tokens defaults to len(token_ids)."""
        op = Allocate(seq_id, num_tokens, token_ids)
        return await self._sequence(self._stub.Allocate, lambda: op.request(self.session_id))

    async def append(self, seq_id: int, num_tokens: int | None = None,
                     token_ids: Sequence[int] = ()) -> SequenceBlocks:
        """Grow a sequence; num_tokens defaults to len(token_ids), else 1."""
        op = Append(seq_id, num_tokens, token_ids)
        return await self._sequence(self._stub.Append, lambda: op.request(self.session_id))

    async def fork(self, parent_seq_id: int, child_seq_id: int) -> SequenceBlocks:
        op = Fork(parent_seq_id, child_seq_id)
        return await self._sequence(self._stub.Fork, lambda: op.request(self.session_id))

    async def copy_on_write(self, seq_id: int, logical_block: int) -> SequenceBlocks:
        op = CopyOnWrite(seq_id, logical_block)
        return await self._sequence(self._stub.CopyOnWrite, lambda: op.request(self.session_id))

    async def free(self, seq_id: int) -> int:
        """Drop a sequence; returns how many blocks went back to the pool."""
        reply = await self._client.call(self._stub.Free,
                                        lambda: Free(seq_id).request(self.session_id))
        return reply.released_blocks

    async def commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int] = ()) -> int:
        """Certify the sequences' K/V written (all their tokens, or the first num_tokens[i]);
        returns how many blocks became shareable."""
        op = Commit(seq_ids, num_tokens)
        reply = await self._client.call(self._stub.Commit, lambda: op.request(self.session_id))
        return reply.committed_blocks

    async def batch(self, ops: Sequence[Operation]) -> list[SequenceBlocks]:
        """Several ops in order, all-or-nothing; one result per op (empty table for a free or
        a commit)."""
        reply = await self._client.call(self._stub.Batch, lambda: pb.BatchRequest(
            session_id=self.session_id, ops=[op.batch_op() for op in ops]))
        return [SequenceBlocks.from_proto(result) for result in reply.results]

    async def step(self, seq_ids: Sequence[int], token_ids: Sequence[int] | None = None,
                   num_tokens: int = 1, *, commit: bool = False) -> StepResult:
        """Append num_tokens tokens to every sequence in one round trip, all-or-nothing.

        token_ids, if given, holds len(seq_ids) * num_tokens ids, sequence-major. With
        `commit`, the caller certifies that the K/V of every token the sequences already hold
        is written: their pending blocks become shareable first.
        """
        reply = await self._client.call(self._stub.Step, lambda: pb.StepRequest(
            session_id=self.session_id, seq_ids=seq_ids, num_tokens=num_tokens,
            token_ids=token_ids or (), commit=commit))
        return StepResult.from_proto(reply)

    async def block_tables(self, seq_ids: Sequence[int]) -> list[SequenceBlocks]:
        reply = await self._client.call(self._stub.GetBlockTables, lambda: (
            pb.GetBlockTablesRequest(session_id=self.session_id, seq_ids=seq_ids)))
        return [SequenceBlocks.from_proto(table) for table in reply.tables]

    async def stats(self) -> PoolStats:
        """Pool-wide figures plus this session's (`.session`)."""
        reply = await self._client.call(self._stub.GetStats,
                                        self._session_request(pb.GetStatsRequest))
        return PoolStats.from_proto(reply)

    # ---------------------------------------------------------------- helpers

    async def _sequence(
        self, method: "grpc.aio.UnaryUnaryMultiCallable[Request, pb.SequenceBlocks]",
        make_request: Callable[[], Request],
    ) -> SequenceBlocks:
        return SequenceBlocks.from_proto(await self._client.call(method, make_request))

    def _session_request(self, kind: Callable[..., Request]) -> Callable[[], Request]:
        return lambda: kind(session_id=self.session_id)
