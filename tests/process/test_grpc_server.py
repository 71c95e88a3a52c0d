"""The one gRPC server bring-up (process/grpc_server.py) that pagedkvd and the runner share.

Both servers are built the production way (the daemon's `grpc_server`, the runner's
`_grpc_server`) and must treat message sizes alike: a request up to MAX_MESSAGE_BYTES reaches
the service, above gRPC's 4 MiB default; one over it is refused by gRPC (RESOURCE_EXHAUSTED, no
pagedkv cause). Both bundled channels (PoolClient, RunnerClient) receive answers up to the same
limit, and an answer over it is never sent. The runner's socket is claimed as the daemon's.
"""

import contextlib
import os
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pagedkv.client import MessageTooLarge, PoolClient, RunnerClient, SeqStep, StepOutputs
from pagedkv.model_runner.models import ModelSource
from pagedkv.model_runner.process.server import RunnerConfig, _grpc_server
from pagedkv.process.grpc_server import StartupError
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.proto import kvpool_pb2_grpc, runner_pb2_grpc
from pagedkv.proto import runner_pb2 as rpb
from pagedkv.proto.limits import GRPC_DEFAULT_RECEIVE_BYTES, MAX_MESSAGE_BYTES
from pagedkv.proto.metadata import ERROR_KEY

from daemon_harness import running_daemon
from pagedkvd_process import short_tmp_dir

# A string whose message is between gRPC's default receive limit and MAX_MESSAGE_BYTES, and
# one whose message is over MAX_MESSAGE_BYTES.
BETWEEN = "x" * (GRPC_DEFAULT_RECEIVE_BYTES + 2**20)
OVER = "x" * (MAX_MESSAGE_BYTES + 1)
assert GRPC_DEFAULT_RECEIVE_BYTES < len(BETWEEN) + 16 < MAX_MESSAGE_BYTES


class EchoState:
    """What the Runner server reads of a RunnerState: its info names `model`; a step records
    the session id it got."""

    def __init__(self, model: str = "echo") -> None:
        self.model = model
        # The session id of every step that reached the engine.
        self.sessions: list[str] = []
        # No figures (RunnerState.metrics).
        self.metrics = None

    async def step(self, session_id: str, requests: Sequence[SeqStep],
                   release: Sequence[int]) -> StepOutputs:
        self.sessions.append(session_id)
        return StepOutputs([], free_blocks=0)

    async def follow(self, *_: object) -> None:
        """No decode run starts (RunnerState.follow): pushes would go through `step`."""

    def runner_info(self) -> rpb.RunnerInfo:
        return rpb.RunnerInfo(model=self.model)


@dataclass(frozen=True, slots=True)
class Served:
    """A server under test: its unix target, and a call that carries a string to its service
    (True when the service got it; gRPC's own refusal is raised)."""

    # unix://path of the server.
    target: str
    # Sends one request holding the string on the channel.
    reaches_service: Callable[[grpc.aio.Channel, str], Awaitable[bool]]


@contextlib.contextmanager
def runner_config(model: str = "echo") -> Iterator[tuple[RunnerConfig, EchoState]]:
    with short_tmp_dir() as folder:
        yield (RunnerConfig(model=ModelSource(random_init="tiny"),
                            listen=f"unix://{folder / 'run' / 'runner.sock'}"), EchoState(model))


@contextlib.asynccontextmanager
async def daemon_server() -> AsyncIterator[Served]:
    async def get_stats(channel: grpc.aio.Channel, text: str) -> bool:
        try:
            await kvpool_pb2_grpc.KVPoolStub(channel).GetStats(pb.GetStatsRequest(session_id=text))
        except grpc.aio.AioRpcError as error:
            if ERROR_KEY not in dict(error.trailing_metadata() or ()):
                raise
            return True  # the service's own answer (no such session)
        raise AssertionError("a session id of a few MiB was found")

    async with running_daemon() as daemon:
        yield Served(daemon.unix_target, get_stats)


@contextlib.asynccontextmanager
async def runner_server() -> AsyncIterator[Served]:
    with runner_config() as (config, state):
        async def step(channel: grpc.aio.Channel, text: str) -> bool:
            await runner_pb2_grpc.RunnerStub(channel).Step(rpb.RunnerStepRequest(session_id=text))
            return state.sessions == [text]

        async with _grpc_server(config, state):
            yield Served(config.listen, step)


@pytest.mark.parametrize("build", [daemon_server, runner_server], ids=["daemon", "runner"])
async def test_both_servers_take_requests_up_to_the_one_limit_and_refuse_larger(
        build: Callable[[], contextlib.AbstractAsyncContextManager[Served]]) -> None:
    # A stock channel sends any size: the server alone decides.
    async with build() as served, grpc.aio.insecure_channel(served.target) as channel:
        assert await served.reaches_service(channel, BETWEEN)  # over gRPC's 4 MiB default
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await served.reaches_service(channel, OVER)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert ERROR_KEY not in dict(refused.value.trailing_metadata() or ())  # gRPC's own


async def test_the_pool_client_receives_answers_up_to_the_limit_and_none_larger() -> None:
    # The pool id travels in GetPoolInfo's answer: its size sets the answer's.
    async with running_daemon(pool_id=BETWEEN) as daemon, \
            await PoolClient.connect(daemon.unix_target) as client:
        assert (await client.pool_info()).pool_id == BETWEEN
    async with running_daemon(pool_id=OVER) as daemon, \
            await PoolClient.connect(daemon.unix_target) as client:
        with pytest.raises(MessageTooLarge):
            await client.pool_info()


async def test_the_runner_client_receives_answers_up_to_the_limit_and_none_larger() -> None:
    # The model name travels in RunnerInfo: its size sets the answer's.
    with runner_config(BETWEEN) as (config, state):
        async with _grpc_server(config, state), \
                await RunnerClient.connect(config.listen) as runner:
            assert (await runner.info()).model == BETWEEN
            state.model = OVER
            with pytest.raises(MessageTooLarge):
                await runner.info()


async def test_the_runner_socket_gets_explicit_modes_and_a_live_one_is_refused() -> None:
    with runner_config() as (config, state):
        path = Path(config.listen.removeprefix("unix://"))
        previous = os.umask(0)  # as if started with UMask=0000
        try:
            async with _grpc_server(config, state):
                modes = {p: stat.S_IMODE(p.stat().st_mode) for p in (path, path.parent)}
                with pytest.raises(StartupError, match="another process is serving it"):
                    async with _grpc_server(config, EchoState()):
                        pass
                assert path.is_socket()  # the live runner's socket is left alone
        finally:
            os.umask(previous)
        assert modes == {path: 0o660, path.parent: 0o750}
        assert not path.exists()  # removed on exit
