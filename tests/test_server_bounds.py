"""The daemon's server bounds (issue 17 #10-#12), against the production gRPC server.

#10: the default answer bound fits gRPC's default receive limit, so a stock channel (no
options) receives the largest answer the daemon allows by default.
"""

import grpc

from pagedkv.daemon.answer_size import SEQUENCE_FIXED
from pagedkv.daemon.limits import Limits
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc
from pagedkv.proto.limits import GRPC_DEFAULT_RECEIVE_BYTES
from pagedkv.proto.metadata import ERROR_KEY

from daemon_harness import running_daemon


async def test_a_stock_channel_receives_the_largest_default_answer() -> None:
    # One token a block on 2^21 blocks: past id 16,383 every block id and slot is a 3-byte
    # varint, as the bound assumes, so the answer's real size is close to its bound. Only the
    # answer bound (its default) limits the Allocate: tokens and quota are raised out of its way.
    limits = Limits(max_tokens=1 << 22, max_blocks_per_session=1 << 22)
    async with running_daemon(num_blocks=1 << 21, block_size=1, limits=limits) as daemon, \
            grpc.aio.insecure_channel(daemon.unix_target) as channel:  # gRPC's defaults
        stub = kvpool_pb2_grpc.KVPoolStub(channel)
        budget = daemon.service.answer_budget()  # the default max_answer_bytes
        largest = (budget.limit - SEQUENCE_FIXED) // (budget.block_bytes + budget.slot_bytes)
        sid = (await stub.OpenSession(pb.OpenSessionRequest(client_name="t"))).session_id
        answer = await stub.Allocate(pb.AllocateRequest(session_id=sid, seq_id=1,
                                                        num_tokens=largest))
        assert len(answer.slot_mapping) == len(answer.block_ids) == largest
        assert 0.95 * GRPC_DEFAULT_RECEIVE_BYTES < answer.ByteSize() <= GRPC_DEFAULT_RECEIVE_BYTES
        # One token more (in a session of its own, whose quota has room) is refused by the
        # daemon, before anything changes: never applied and then lost to the client.
        used = daemon.pool.stats().used_blocks
        other = (await stub.OpenSession(pb.OpenSessionRequest(client_name="u"))).session_id
        try:
            await stub.Allocate(pb.AllocateRequest(session_id=other, seq_id=2,
                                                   num_tokens=largest + 1))
        except grpc.aio.AioRpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(error.trailing_metadata() or ()).get(ERROR_KEY) == "AnswerTooLarge"
            assert "max_answer_bytes" in (error.details() or "")
        else:
            raise AssertionError("an answer over max_answer_bytes was sent")
        assert daemon.pool.stats().used_blocks == used
