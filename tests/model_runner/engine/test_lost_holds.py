"""A hold asked by a call whose answer was lost is ended by the runner (SessionSequences.may_hold).

The daemon may apply a call that the runner never hears back from (its deadline passed, the
client's step was cancelled). If that call asked for a hold, the hold is the runner's to end:
left to lapse, it would make the daemon kill the runner the moment the client needs its blocks
(the fence: kvpool.proto, "Runner holds"), so any client could stop a runner every other client
shares by timing out a step and closing its session. Here the runner's Batch is applied by the
in-process daemon and its answer then lost (DeadlineExceeded); the step fails, and the session
is left unheld.
"""

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv.client import DeadlineExceeded, PoolClient, SamplingParams
from pagedkv.client.pool.session import Session
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.kernels.attention_backend import get_backend
from pagedkv.model_runner.runner import ModelRunner

from daemon_harness import Daemon, running_daemon
from engine_driver import new

# The in-process daemon's tiny geometry: 2 layers, 2 K/V heads of 64.
CONFIG = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     head_dim=64, max_position_embeddings=64, initializer_range=0.2,
                     eos_token_id=None, bos_token_id=None, pad_token_id=None)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=32, block_size=4, with_memory=True) as running:
        yield running


@pytest.fixture
async def engine(daemon: Daemon) -> AsyncIterator[StepEngine]:
    async with await PoolClient.connect(daemon.runners_target) as runner_client:
        torch.manual_seed(0)
        runner = ModelRunner.attach(LlamaForCausalLM(CONFIG).eval(),
                                    await runner_client.pool_info(), get_backend("torch"))
        started = StepEngine(runner_client, runner)
        await started.start()
        yield started
        await started.stop()


def answers_lost(call: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """`call`, applied by the daemon, its answer then lost as a passed deadline would lose it."""
    async def applied_then_lost(*args: Any, **kwargs: Any) -> Any:
        await call(*args, **kwargs)
        raise DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    return applied_then_lost


async def test_a_hold_whose_answer_was_lost_is_ended_by_the_runner(
        daemon: Daemon, engine: StepEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    async with await PoolClient.connect(daemon.unix_target) as client:
        session = await client.open_session("impatient", keep_alive=False)
        monkeypatch.setattr(Session, "batch", answers_lost(Session.batch))
        with pytest.raises(DeadlineExceeded):
            await engine.step(session.session_id, [new(1, [1, 2, 3, 4, 5], GREEDY)])
        held = daemon.service.sessions.peek(session.session_id)
        assert held is not None and daemon.pool.stats().num_sequences == 1  # it was applied
        assert held.holds == {}  # ... and its hold ended: the client frees at once
        monkeypatch.undo()
        assert await session.free(1) > 0
