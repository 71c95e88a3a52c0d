"""A session: a lease on the daemon and the sequences under it, one method per RPC.

A session keeps its lease alive from a background task (KeepAlive every lease/3), so it lives
exactly as long as this process: if the process dies, the daemon frees its sequences when the
lease runs out. `allocate`, `step` and `free` recover a call whose answer was lost (UNAVAILABLE,
DEADLINE_EXCEEDED, CANCELLED) by reading the state back, as kvpool.proto's retry rules say
(`recovery.py`), unless the client was made with `retry=None`. A runner reaches its clients'
sessions through handles that `PoolClient.attach` makes: the same methods (with the runner's
`hold_ms` and `end_hold`), no KeepAlive of their own.
"""

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Self, TypeVar

import grpc

from pagedkv.client.pool.errors import (
    NotFound,
    PagedKVError,
    SequenceNotFound,
    SessionBusy,
    SessionExpired,
)
from pagedkv.client.pool.ops import (
    Allocate,
    Append,
    Commit,
    CopyOnWrite,
    Fork,
    Free,
    Operation,
    Step,
)
from pagedkv.client.pool.recovery import (
    LOST,
    Outcome,
    SequenceLengths,
    Unknown,
    allocate_outcome,
    free_outcome,
    recover,
    step_outcome,
)
from pagedkv.client.pool.types import PoolStats, SequenceBlocks, StepResult
from pagedkv.proto import kvpool_pb2 as pb

if TYPE_CHECKING:
    from pagedkv.client.pool.client import PoolClient

log = logging.getLogger(__name__)

# How long `close` waits for a runner's hold on the session to end (kvpool.proto's "Runner
# holds": a forward of the session may still write its blocks), and how often it asks again.
CLOSE_BUSY_WAIT_S = 30.0
CLOSE_BUSY_POLL_S = (0.02, 0.2)

Request = TypeVar("Request")
T = TypeVar("T")


class Session:
    """A lease on the daemon and the sequences under it. Get one from `open_session` (or, for
    a session opened elsewhere, from `PoolClient.attach`)."""

    def __init__(self, client: "PoolClient", session_id: str, block_size: int, *,
                 lease_ttl_ms: int = 0, pool_id: str = "", max_blocks: int = 0,
                 model: str = "") -> None:
        self._client = client
        self._stub = client._stub
        # The credential naming this session on every call.
        self.session_id = session_id
        # The pool's tokens per block.
        self.block_size = block_size
        # The lease the daemon granted, the daemon run, and the quota granted (block-table
        # entries); 0 and "" for a session attached (opened by another process).
        self.lease_ttl_ms = lease_ttl_ms
        self.pool_id = pool_id
        self.max_blocks = max_blocks
        # The model whose K/V the session holds, as the daemon named it ("" when attached).
        self.model = model
        # Why the background KeepAlive stopped (the session expired), else None.
        self.lease_error: PagedKVError | None = None
        # Each sequence's length per the last answer about it: what a lost step is judged by.
        self._lengths = SequenceLengths()
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
                await self._client._call(self._stub.KeepAlive, self._session_request(
                    pb.KeepAliveRequest), timeout=min(period, self._client.timeout))
            except (SessionExpired, NotFound) as exc:
                self.lease_error = exc
                log.warning("pagedkv session lease lost: %s", exc.message)
                return
            except PagedKVError as exc:  # a slow or restarting daemon: try again next period
                log.warning("pagedkv KeepAlive failed: %s", exc)

    async def keep_alive(self, *, hold_ms: int = 0, end_hold: bool = False) -> int:
        """Renew the lease now (any call does); returns the lease in ms. Runners only: hold the
        session for `hold_ms` more, or end their hold (`end_hold`; kvpool.proto's "Runner
        holds")."""
        reply = await self._client._call(self._stub.KeepAlive, lambda: pb.KeepAliveRequest(
            session_id=self.session_id, hold_ms=hold_ms, end_hold=end_hold))
        return reply.lease_ttl_ms

    async def close(self) -> int:
        """Free every sequence and end the session; returns how many sequences were freed.

        Idempotent; a session the daemon already expired has nothing left to free (0). While a
        runner holds the session (a step sent to it may still be computing) the daemon refuses
        the close (SessionBusy): it is asked again until the hold ends, for CLOSE_BUSY_WAIT_S
        at most (release the sequences through the runner first and there is no wait). A close
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
            freed = await self._close_when_free()
        except (SessionExpired, NotFound):
            freed = 0
        self._closed = True
        self._client.forget(self)
        return freed

    async def _close_when_free(self) -> int:
        """CloseSession, asked again while a runner holds the session (SessionBusy)."""
        deadline = asyncio.get_running_loop().time() + CLOSE_BUSY_WAIT_S
        poll, most = CLOSE_BUSY_POLL_S
        while True:
            try:
                reply = await self._client._call(self._stub.CloseSession,
                                                self._session_request(pb.CloseSessionRequest))
                return reply.freed_sequences
            except SessionBusy:
                if asyncio.get_running_loop().time() + poll > deadline:
                    raise
            await asyncio.sleep(poll)
            poll = min(2 * poll, most)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    # -------------------------------------------------------------- sequences

    async def allocate(self, seq_id: int, num_tokens: int | None = None,
                       token_ids: Sequence[int] = ()) -> SequenceBlocks:
        """A new sequence; num_tokens defaults to len(token_ids). Recovered if its answer is
        lost: found with these tokens, the answer is rebuilt from its table."""
        op = Allocate(seq_id, num_tokens, token_ids)

        async def read_back() -> Outcome[SequenceBlocks]:
            return allocate_outcome(await self._table_or_none(seq_id), op.token_count,
                                    self.block_size)

        return self._track(await self._recovering(
            lambda: self._sequence(self._stub.Allocate, lambda: op.request(self.session_id)),
            read_back))

    async def append(self, seq_id: int, num_tokens: int | None = None,
                     token_ids: Sequence[int] = ()) -> SequenceBlocks:
        """Grow a sequence; num_tokens defaults to len(token_ids), else 1."""
        op = Append(seq_id, num_tokens, token_ids)
        return self._track(await self._sequence(self._stub.Append,
                                                lambda: op.request(self.session_id)))

    async def fork(self, parent_seq_id: int, child_seq_id: int) -> SequenceBlocks:
        op = Fork(parent_seq_id, child_seq_id)
        return self._track(await self._sequence(self._stub.Fork,
                                                lambda: op.request(self.session_id)))

    async def copy_on_write(self, seq_id: int, logical_block: int) -> SequenceBlocks:
        op = CopyOnWrite(seq_id, logical_block)
        return await self._sequence(self._stub.CopyOnWrite, lambda: op.request(self.session_id))

    async def free(self, seq_id: int) -> int:
        """Drop a sequence; returns how many blocks went back to the pool (0 when the answer
        was lost and the read-back found the free applied)."""

        async def send() -> int:
            reply = await self._client._call(self._stub.Free,
                                             lambda: Free(seq_id).request(self.session_id))
            return reply.released_blocks

        async def read_back() -> Outcome[int]:
            return free_outcome(await self._table_or_none(seq_id))

        released = await self._recovering(send, read_back)
        self._lengths.forget(seq_id)
        return released

    async def commit(self, seq_ids: Sequence[int], num_tokens: Sequence[int] = ()) -> int:
        """Certify the sequences' K/V written (all their tokens, or the first num_tokens[i]);
        returns how many blocks became shareable."""
        op = Commit(seq_ids, num_tokens)
        reply = await self._client._call(self._stub.Commit, lambda: op.request(self.session_id))
        return reply.committed_blocks

    async def batch(self, ops: Sequence[Operation], *, hold_ms: int = 0,
                    end_hold: bool = False) -> list[SequenceBlocks]:
        """Several ops in order, all-or-nothing; one result per op (empty table for a free or
        a commit). Runners only: once applied, hold the session for `hold_ms`, or end their hold
        (`end_hold`; kvpool.proto's "Runner holds")."""
        reply = await self._client._call(self._stub.Batch, lambda: pb.BatchRequest(
            session_id=self.session_id, ops=[op.batch_op() for op in ops], hold_ms=hold_ms,
            end_hold=end_hold))
        self._client.free_blocks = reply.free_blocks
        results = [SequenceBlocks.from_proto(result) for result in reply.results]
        for op, result in zip(ops, results, strict=True):
            if isinstance(op, Free):
                self._lengths.forget(op.seq_id)
            elif not isinstance(op, Commit):
                self._track(result)
        return results

    async def step(self, seq_ids: Sequence[int], token_ids: Sequence[int] | None = None,
                   num_tokens: int = 1, *, commit: bool = False, hold_ms: int = 0,
                   reserve_tokens: int = 0) -> StepResult:
        """Append num_tokens tokens to every sequence in one round trip, all-or-nothing.

        token_ids, if given, holds len(seq_ids) * num_tokens ids, sequence-major. With
        `commit`, the caller certifies that the K/V of every token the sequences already hold
        is written: their pending blocks become shareable first. `hold_ms`, `reserve_tokens`:
        see `Step`.
        Recovered if its answer is lost and this session's answers told every sequence's
        length (see `recovery.py`).
        """
        op = Step(seq_ids, token_ids or (), num_tokens, commit, hold_ms, reserve_tokens)
        read_back = self.step_read_back(op)
        return self.stepped(op, await self._recovering(lambda: self._send_step(op), read_back))

    def step_read_back(self, op: Step) -> Callable[[], Awaitable[Outcome[StepResult]]]:
        """How to tell what `op` did if its answer is lost, from the lengths known before it is
        sent (`PoolClient.step_many` reads back each entry of a lost call with it)."""
        before = self._lengths.of(op.seq_ids)

        async def read_back() -> Outcome[StepResult]:
            if before is None:
                return Unknown("the session has no record of some sequences' lengths")
            tables = await self._read_tables(op.seq_ids)
            return step_outcome(tables, before, op.num_tokens, self.block_size,
                                op.reserve_tokens)

        return read_back

    async def recover_step(self, op: Step, lost: PagedKVError,
                           read_back: Callable[[], Awaitable[Outcome[StepResult]]]
                           ) -> StepResult:
        """`op`'s result after its answer was `lost` (an entry of a lost StepMany)."""
        return self.stepped(op, await recover(self._client.retry, lost,
                                              lambda: self._send_step(op), read_back))

    def stepped(self, op: Step, result: StepResult) -> StepResult:
        """`result` of `op`, recorded: the sequences' lengths a later lost step is judged by."""
        self._lengths.set_many(op.seq_ids, result.num_tokens)
        return result

    async def _send_step(self, op: Step) -> StepResult:
        reply = await self._client._call(self._stub.Step, lambda: op.request(self.session_id))
        self._client.free_blocks = reply.free_blocks
        return StepResult.from_proto(reply)

    async def block_tables(self, seq_ids: Sequence[int], token_ids: bool = False, *,
                           hold_ms: int = 0) -> list[SequenceBlocks]:
        """Each sequence's table, num_tokens and committed tokens (num_cached_tokens), and with
        `token_ids` every token id the daemon holds for it (empty if it does not know them).
        Runners only: `hold_ms` holds the session once the tables are read."""
        return [self._track(table)
                for table in await self._read_tables(seq_ids, token_ids, hold_ms)]

    async def stats(self) -> PoolStats:
        """The pool's capacity plus this session's figures (`.session`)."""
        reply = await self._client._call(self._stub.GetStats,
                                        self._session_request(pb.GetStatsRequest))
        return PoolStats.from_proto(reply)

    # ---------------------------------------------------------------- helpers

    async def _recovering(self, send: Callable[[], Awaitable[T]],
                          read_back: Callable[[], Awaitable[Outcome[T]]]) -> T:
        """`send()`; if its answer is lost, read back until the outcome is known: applied
        (its rebuilt answer), or not (send again), within the client's RetryPolicy."""
        try:
            return await send()
        except LOST as exc:
            return await recover(self._client.retry, exc, send, read_back)

    async def _read_tables(self, seq_ids: Sequence[int], token_ids: bool = False,
                           hold_ms: int = 0) -> list[SequenceBlocks]:
        reply = await self._client._call(self._stub.GetBlockTables, lambda: (
            pb.GetBlockTablesRequest(session_id=self.session_id, seq_ids=seq_ids,
                                     include_token_ids=token_ids, hold_ms=hold_ms)))
        return [SequenceBlocks.from_proto(table) for table in reply.tables]

    async def _table_or_none(self, seq_id: int) -> SequenceBlocks | None:
        """The sequence read back, or None if the session has no such sequence."""
        try:
            return (await self._read_tables([seq_id]))[0]
        except SequenceNotFound:
            return None

    def _track(self, blocks: SequenceBlocks) -> SequenceBlocks:
        self._lengths.set(blocks.seq_id, blocks.num_tokens)
        return blocks

    async def _sequence(
        self, method: "grpc.aio.UnaryUnaryMultiCallable[Request, pb.SequenceBlocks]",
        make_request: Callable[[], Request],
    ) -> SequenceBlocks:
        return SequenceBlocks.from_proto(await self._client._call(method, make_request))

    def _session_request(self, kind: Callable[..., Request]) -> Callable[[], Request]:
        return lambda: kind(session_id=self.session_id)
