"""The gRPC servicer: thin translations between kvpool.proto messages and `PoolService`.

Nothing here decides anything: requests become operation records, the service acts, results
become messages. `grpc_errors` maps the service's exceptions to status codes (StepMany puts each
failed entry's status in its result instead, StepStream each refused message's in its answer).
Step, the decode hot path, moves packed arrays straight between protobuf and numpy with no
per-sequence objects.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from pagedkv.daemon.core import InvalidArgument, SeqUpdate
from pagedkv.daemon.edge.model_messages import check_runner, model_info, register_shape
from pagedkv.daemon.edge.status import failure_of, grpc_errors
from pagedkv.daemon.service.answer_size import (
    ENTRY_CAUSE_BYTES,
    AnswerBudget,
)
from pagedkv.daemon.service.holds import Hold
from pagedkv.daemon.service.operations import (
    Allocate,
    Append,
    Commit,
    CopyOnWrite,
    Fork,
    Free,
    Operation,
    seq_id_of,
)
from pagedkv.daemon.service.pool_service import PoolService
from pagedkv.daemon.service.sessions import SessionStats
from pagedkv.memory import POOL_LAYOUT
from pagedkv.process.stream_drain import DrainableStreams
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc
from pagedkv.vocab.causes import cut_message
from pagedkv.vocab.geometry import dtype_bytes

if TYPE_CHECKING:
    Context = grpc.aio.ServicerContext[Any, Any]


class KVPoolServicer(kvpool_pb2_grpc.KVPoolServicer):
    """Serves `pagedkv.v1.KVPool` from one PoolService."""

    def __init__(self, service: PoolService) -> None:
        self._service = service
        # The open StepStreams, ended when the daemon drains (`end_streams`).
        self._streams = DrainableStreams()

    @grpc_errors
    async def GetPoolInfo(self, request: pb.GetPoolInfoRequest, context: Context) -> pb.PoolInfo:
        return pool_info(self._service, with_memory=self._service.shows_memory())

    @grpc_errors
    async def OpenSession(self, request: pb.OpenSessionRequest,
                          context: Context) -> pb.OpenSessionResponse:
        session = self._service.open_session(request.client_name, request.lease_ttl_ms,
                                             request.max_blocks, request.cache_salt,
                                             request.model)
        return pb.OpenSessionResponse(session_id=session.session_id,
                                      lease_ttl_ms=session.lease_ttl_ms,
                                      pool_id=self._service.pool_id,
                                      block_size=self._service.pool.block_size,
                                      max_blocks=session.max_blocks, model=session.model)

    @grpc_errors
    async def KeepAlive(self, request: pb.KeepAliveRequest,
                        context: Context) -> pb.KeepAliveResponse:
        lease_ttl_ms = self._service.keep_alive(request.session_id,
                                                Hold(request.hold_ms, request.end_hold))
        return pb.KeepAliveResponse(lease_ttl_ms=lease_ttl_ms)

    @grpc_errors
    async def CloseSession(self, request: pb.CloseSessionRequest,
                           context: Context) -> pb.CloseSessionResponse:
        freed = await self._service.close_session(request.session_id)
        return pb.CloseSessionResponse(freed_sequences=freed)

    @grpc_errors
    async def Allocate(self, request: pb.AllocateRequest, context: Context) -> pb.SequenceBlocks:
        update = await self._service.allocate(request.session_id, allocate_op(request))
        return sequence_blocks(request.seq_id, update)

    @grpc_errors
    async def Append(self, request: pb.AppendRequest, context: Context) -> pb.SequenceBlocks:
        update = await self._service.append(request.session_id, append_op(request))
        return sequence_blocks(request.seq_id, update)

    @grpc_errors
    async def Fork(self, request: pb.ForkRequest, context: Context) -> pb.SequenceBlocks:
        update = await self._service.fork(request.session_id, fork_op(request))
        return sequence_blocks(request.child_seq_id, update)

    @grpc_errors
    async def CopyOnWrite(self, request: pb.CopyOnWriteRequest,
                          context: Context) -> pb.SequenceBlocks:
        update = await self._service.copy_on_write(request.session_id, copy_on_write_op(request))
        return sequence_blocks(request.seq_id, update)

    @grpc_errors
    async def Free(self, request: pb.FreeRequest, context: Context) -> pb.FreeResponse:
        released = await self._service.free(request.session_id, Free(request.seq_id))
        return pb.FreeResponse(released_blocks=released)

    @grpc_errors
    async def Commit(self, request: pb.CommitRequest, context: Context) -> pb.CommitResponse:
        committed = await self._service.commit(request.session_id, commit_op(request))
        return pb.CommitResponse(committed_blocks=committed)

    @grpc_errors
    async def Batch(self, request: pb.BatchRequest, context: Context) -> pb.BatchResponse:
        self._service.check_batch_ops(len(request.ops))  # before translating a single op
        ops = [batch_op(request.session_id, index, op) for index, op in enumerate(request.ops)]
        updates = await self._service.batch(request.session_id, ops,
                                            Hold(request.hold_ms, request.end_hold))
        return pb.BatchResponse(results=[sequence_blocks(seq_id_of(op), update)
                                         for op, update in zip(ops, updates, strict=True)],
                                free_blocks=self._service.free_blocks_for(request.session_id))

    @grpc_errors
    async def Step(self, request: pb.StepRequest, context: Context) -> pb.StepResponse:
        return await self._step(request)

    @grpc_errors
    async def StepMany(self, request: pb.StepManyRequest,
                       context: Context) -> pb.StepManyResponse:
        return await self._step_many(request)

    async def StepStream(self, requests: AsyncIterator[pb.StepStreamRequest],
                         context: Context) -> AsyncIterator[pb.StepStreamResponse]:
        """StepMany calls on one stream: each message handled as that call, one at a time, and
        answered in order; a message refused as a whole is answered with its status, and the
        stream goes on. A message the client's cancel interrupts is undone as a cancelled
        StepMany (its entry being applied undone, later ones never started). A draining daemon
        ends the stream (OK) once its message in progress is answered."""
        while (request := await self._streams.next_message(requests)) is not None:
            yield await self._stream_answer(request)

    def end_streams(self) -> None:
        """The daemon drains: every StepStream ends, at once if it waits for its next message,
        else once its message in progress is answered."""
        self._streams.end()

    async def _stream_answer(self, request: pb.StepStreamRequest) -> pb.StepStreamResponse:
        """One StepStream message's answer: its StepMany's, or the status refusing it whole."""
        try:
            many = await self._step_many(request.many, streamed=True)
        except Exception as exc:
            code, cause, message = failure_of(exc, "StepStream")
            return pb.StepStreamResponse(call_id=request.call_id, code=code.value[0],
                                         cause=cause,
                                         message=cut_message(message))
        return pb.StepStreamResponse(call_id=request.call_id, many=many)

    async def _step_many(self, request: pb.StepManyRequest, *,
                         streamed: bool = False) -> pb.StepManyResponse:
        """A StepMany call's answer (`streamed`: inside a StepStreamResponse, charged too)."""
        answer = self._service.step_many_budget(len(request.steps))  # or refused as a whole
        if streamed:
            answer.step_stream()
        results = [await self._step_entry(step, answer) for step in request.steps]
        first = request.steps[0].session_id if request.steps else ""
        return pb.StepManyResponse(results=results,
                                   free_blocks=self._service.free_blocks_for(first))

    async def _step_entry(self, request: pb.StepRequest,
                          answer: AnswerBudget) -> pb.StepManyResult:
        """One StepMany entry, which fails alone: its status in its result, not the call's."""
        try:
            return pb.StepManyResult(step=await self._step(request, answer))
        except Exception as exc:
            code, cause, message = failure_of(exc, "StepMany")
            assert len(cause) <= ENTRY_CAUSE_BYTES, cause
            return pb.StepManyResult(code=code.value[0], cause=cause,
                                     message=cut_message(message))

    async def _step(self, request: pb.StepRequest,
                    answer: AnswerBudget | None = None) -> pb.StepResponse:
        # list() of a packed field is one C loop; numpy reads the token ids field directly.
        result = await self._service.step(request.session_id, list(request.seq_ids),
                                          request.num_tokens or 1, request.token_ids,
                                          commit=request.commit, answer=answer,
                                          hold_ms=request.hold_ms,
                                          reserve_tokens=request.reserve_tokens)
        return pb.StepResponse(
            slot_mapping=result.slot_mapping.tolist(),
            changed_seq_index=result.changed_seq_index.tolist(),
            changed_logical_block=result.changed_logical_block.tolist(),
            changed_block_id=result.changed_block_id.tolist(),
            copy_src=[copy.src for copy in result.copies],
            copy_dst=[copy.dst for copy in result.copies],
            num_tokens=result.num_tokens.tolist(),
            free_blocks=self._service.free_blocks_for(request.session_id))

    @grpc_errors
    async def GetBlockTables(self, request: pb.GetBlockTablesRequest,
                             context: Context) -> pb.GetBlockTablesResponse:
        seq_ids = list(request.seq_ids)
        updates = await self._service.block_tables(request.session_id, seq_ids,
                                                   request.include_token_ids, request.hold_ms)
        return pb.GetBlockTablesResponse(tables=[sequence_blocks(seq_id, update) for
                                                 seq_id, update in zip(seq_ids, updates,
                                                                       strict=True)])

    @grpc_errors
    async def GetStats(self, request: pb.GetStatsRequest, context: Context) -> pb.PoolStats:
        # The pool's capacity to anyone, the caller's own session's figures, and nothing of
        # other sessions' activity (operators read that from /metrics).
        mine = [self._service.stats_of(request.session_id)] if request.session_id else []
        num_blocks, block_size, free_blocks = self._service.capacity()
        return pb.PoolStats(num_blocks=num_blocks, block_size=block_size,
                            free_blocks=free_blocks, sessions=[session_stats(s) for s in mine],
                            models=[model_info(figures, with_memory=False)
                                    for figures in self._service.model_figures()])

    @grpc_errors
    async def RegisterModel(self, request: pb.RegisterModelRequest,
                            context: Context) -> pb.ModelInfo:
        check_runner("RegisterModel")
        model = self._service.register_model(request.name, register_shape(request),
                                             request.runner_target)
        return self._model_info(model.name)

    @grpc_errors
    async def SetModelState(self, request: pb.SetModelStateRequest,
                            context: Context) -> pb.ModelInfo:
        check_runner("SetModelState")
        model = await self._service.set_model_state(request.name, request.asleep)
        return self._model_info(model.name)

    def _model_info(self, name: str) -> pb.ModelInfo:
        """One model's ModelInfo as a runner gets it (its memory view included)."""
        figures = next(f for f in self._service.model_figures() if f.model.name == name)
        return model_info(figures, with_memory=True)


def add_to_server(servicer: KVPoolServicer, server: grpc.aio.Server) -> None:
    """Register the servicer as `pagedkv.v1.KVPool` on an aio server."""
    kvpool_pb2_grpc.add_KVPoolServicer_to_server(servicer, server)


# ------------------------------------------------------------ proto -> domain

# Token ids stay in their packed protobuf field until the pool reads them, under the lock, into
# one int64 array: a list of Python ints would take 30-40 bytes a token while the call queues.
def allocate_op(request: pb.AllocateRequest) -> Allocate:
    return Allocate(request.seq_id, request.num_tokens, request.token_ids,
                    request.skip_host_tier, request.request_id)


def append_op(request: pb.AppendRequest) -> Append:
    return Append(request.seq_id, request.num_tokens, request.token_ids)


def fork_op(request: pb.ForkRequest) -> Fork:
    return Fork(request.parent_seq_id, request.child_seq_id)


def copy_on_write_op(request: pb.CopyOnWriteRequest) -> CopyOnWrite:
    return CopyOnWrite(request.seq_id, request.logical_block)


def commit_op(request: pb.CommitRequest) -> Commit:
    return Commit(list(request.seq_ids), list(request.num_tokens))


def batch_op(session_id: str, index: int, op: pb.BatchOp) -> Operation:
    """One Batch op; its own session_id, if set, must be the batch's."""
    kind = op.WhichOneof("op")
    if kind is None:
        raise InvalidArgument(f"op {index} sets no operation")
    inner = getattr(op, kind)
    if inner.session_id and inner.session_id != session_id:
        raise InvalidArgument(f"op {index} ({kind}) names another session than the batch")
    match kind:
        case "allocate":
            return allocate_op(op.allocate)
        case "append":
            return append_op(op.append)
        case "fork":
            return fork_op(op.fork)
        case "copy_on_write":
            return copy_on_write_op(op.copy_on_write)
        case "commit":
            return commit_op(op.commit)
        case _:
            return Free(op.free.seq_id)


# ------------------------------------------------------------ domain -> proto

def sequence_blocks(seq_id: int, update: SeqUpdate) -> pb.SequenceBlocks:
    return pb.SequenceBlocks(
        seq_id=seq_id, block_ids=update.block_table, num_tokens=update.num_tokens,
        num_cached_tokens=update.num_cached_tokens, slot_mapping=update.slot_mapping,
        copies=[pb.BlockCopy(src=c.src, dst=c.dst) for c in update.copies],
        token_ids=update.token_ids or ())


def session_stats(stats: SessionStats) -> pb.SessionStats:
    return pb.SessionStats(
        name=stats.name, num_sequences=stats.num_sequences,
        block_table_entries=stats.block_table_entries, blocks_held=stats.blocks_held,
        max_blocks=stats.max_blocks, prefix_cache_queries=stats.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits, lease_ttl_ms=stats.lease_ttl_ms,
        model=stats.model)


def pool_info(service: PoolService, *, with_memory: bool) -> pb.PoolInfo:
    """Geometry, and attach instructions `with_memory`; geometry fields stay 0 for a
    bookkeeping-only pool."""
    pool, geometry = service.pool, service.geometry
    info = pb.PoolInfo(pool_id=service.pool_id, num_blocks=pool.num_blocks,
                       block_size=pool.block_size, layout=POOL_LAYOUT,
                       reservation_blocks=pool.reservation_blocks,
                       page_bytes=service.models.page_bytes,
                       num_pages=service.formats.pages.num_pages,
                       models=[model_info(figures, with_memory=with_memory)
                               for figures in service.model_figures()],
                       host_tier_blocks=service.host_tier.num_slots if service.host_tier else 0,
                       host_copy_bytes_per_s=service.host_copy_rate,
                       previous_pool_id=service.previous_pool_id,
                       recovered_from_crash_log=service.recovered_from_crash_log)
    memory = service.memory.handle() if service.memory is not None else None
    if memory is not None and with_memory:
        info.memory.CopyFrom(memory.to_proto())
    if geometry is not None:
        info.dtype = memory.dtype if memory is not None else geometry.default_dtype
        info.model = geometry.name
        info.num_layers = geometry.num_layers
        info.num_kv_heads = geometry.num_kv_heads
        info.head_dim = geometry.head_dim
        info.bytes_per_block = geometry.bytes_per_block(pool.block_size, dtype_bytes(info.dtype))
    return info
