"""A call with more than one `authorization` header is refused (UNAUTHENTICATED): which of
several counts must not depend on their order (once, the last one won)."""

import grpc
import pytest

from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc

from daemon_harness import TOKEN, running_daemon

RIGHT = ("authorization", f"Bearer {TOKEN}")
WRONG = ("authorization", "Bearer not-the-token")


async def test_two_authorization_headers_are_refused_in_either_order() -> None:
    async with running_daemon(tcp=True) as daemon, \
            grpc.aio.insecure_channel(str(daemon.tcp_target)) as channel:
        stub = kvpool_pb2_grpc.KVPoolStub(channel)
        assert (await stub.GetPoolInfo(pb.GetPoolInfoRequest(), metadata=(RIGHT,))).pool_id
        for metadata in ((WRONG, RIGHT), (RIGHT, WRONG), (RIGHT, RIGHT)):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.OpenSession(pb.OpenSessionRequest(), metadata=metadata)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert daemon.service.num_sessions == 0  # no refused call ran
