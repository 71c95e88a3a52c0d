"""A prefill's commit rides the session's next daemon call (issue 18): no call of its own.

The runner's step engine over an in-process daemon (production gRPC server, pool memory on
/dev/shm) and a random-initialized Llama of the daemon's tiny geometry. The daemon's own RPC
counters say how many calls each request cost; a second session under the same cache salt says
when the prefix became shareable: never before the forward that computed it, and at the latest
when the runner's hold on the first session ends. Pool: 32 blocks of 4 slots.
"""

import asyncio
import math
from collections.abc import AsyncIterator

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv.client import PoolClient, SamplingParams, SeqStep, Session
from pagedkv.model_runner.engine import holds
from pagedkv.model_runner.engine.sequences import SessionSequences
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.kernels.attention_backend import get_backend
from pagedkv.model_runner.runner import ModelRunner

from daemon_harness import Daemon, running_daemon
from engine_driver import decode, new

BLOCK_SIZE = 4
PROMPT = [(7 * i + 3) % 128 for i in range(9)]  # two full blocks and one token
NEW_TOKENS = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
# Positions 9 to 28: past the first reservation (reservations.py).
LONG_TOKENS = 20
LONG = SamplingParams(temperature=0.0, max_tokens=LONG_TOKENS)
CONFIG = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     head_dim=64, max_position_embeddings=64, initializer_range=0.2,
                     eos_token_id=None, bos_token_id=None, pad_token_id=None)
# Long enough that no renewal runs during the tests' tiny forwards (at most max_hold_ms).
HOLD_MS = 10_000


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=32, block_size=BLOCK_SIZE, with_memory=True) as running:
        yield running
        running.service.check_invariants()


@pytest.fixture
async def runner_client(daemon: Daemon) -> AsyncIterator[PoolClient]:
    async with await PoolClient.connect(daemon.runners_target) as connected:
        yield connected


@pytest.fixture
async def engine(runner_client: PoolClient) -> AsyncIterator[StepEngine]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG).eval()
    runner = ModelRunner.attach(model, await runner_client.pool_info(), get_backend("torch"))
    started = StepEngine(runner_client, runner, hold_ms=HOLD_MS)
    await started.start()
    yield started
    await started.stop()


@pytest.fixture
def no_idle_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner ends an idle session's hold only when the test says (engine.stop), so what
    the calls count does not depend on how fast the machine steps."""
    monkeypatch.setattr(holds, "IDLE_END_S", 3600.0)


def calls(daemon: Daemon) -> dict[str, float]:
    """Calls the daemon answered, by method, and the StepStream messages it answered (the
    runner's StepMany calls; none counted: left out)."""
    counts: dict[str, float] = {}
    for metric in daemon.registry.collect():
        for sample in metric.samples:
            if sample.name == "pagedkv:rpc_duration_seconds_count" and sample.value:
                counts[sample.labels["method"]] = sample.value
            if sample.name == "pagedkv:stream_message_duration_seconds_count" and sample.value:
                counts[f"{sample.labels['method']} message"] = sample.value
    return counts


async def cached(session: Session, seq_id: int) -> int:
    """Prompt tokens the prefix cache serves a new sequence of PROMPT (freed again)."""
    hit = (await session.allocate(seq_id, token_ids=PROMPT)).num_cached_tokens
    await session.free(seq_id)
    return hit


def decode_next(seq_id: int, token: int) -> SeqStep:
    return SeqStep(seq_id, (token,), False, 0, GREEDY)


@pytest.mark.usefixtures("no_idle_end")
async def test_a_request_costs_one_daemon_call_per_block_and_one_release(
        daemon: Daemon, runner_client: PoolClient, engine: StepEngine) -> None:
    """Prefill: one Batch (Allocate); the first decode step: one Step (a message on the
    runner's StepStream), which commits the prefill's blocks and reserves 2 blocks' worth of
    slots past its token (reservations.py): the table covers 9 + 1 + 8 = 18 slots, so 5 blocks,
    20 slots; the steps that append the tokens at positions 10 to 19 make no call; the one at
    20 makes the second Step (certifying the 10 tokens decoded into the reservation), those at
    21 to 27 none; the last step's release: one Batch (the uncertified tokens appended,
    committed, freed). Issue 18: one Step per token, 19 for these 20 tokens."""
    session = await runner_client.open_session("app", cache_salt="s")
    before = calls(daemon)
    decoded = await decode(engine, session.session_id, [new(1, PROMPT, LONG)], LONG_TOKENS)
    assert len(decoded[1].tokens) == LONG_TOKENS
    after = calls(daemon)
    made = {method: after[method] - before.get(method, 0) for method in after}
    assert {m: n for m, n in made.items() if n} == {"Batch": 2, "StepStream message": 2}
    assert await session.close() == 0  # released on its last step


@pytest.mark.usefixtures("no_idle_end")
async def test_a_prefix_is_shared_only_once_the_next_step_carried_its_commit(
        runner_client: PoolClient, engine: StepEngine) -> None:
    app = await runner_client.open_session("app", cache_salt="s")
    other = await runner_client.open_session("other", cache_salt="s")
    first = await engine.step(app.session_id, [new(1, PROMPT, GREEDY)])
    # The prefill is answered, its forward done: its blocks are still pending, not shared.
    assert await cached(other, 1) == 0
    await engine.step(app.session_id, [decode_next(1, first[0].token_id)])
    assert await cached(other, 2) == 8  # the decode Step committed both full blocks


@pytest.mark.usefixtures("no_idle_end")
async def test_a_prefill_commit_rides_the_next_batch_first(
        daemon: Daemon, runner_client: PoolClient, engine: StepEngine) -> None:
    """The next step allocates the same prompt again (and decodes the first): one Batch, whose
    Commit op comes first, so the new sequence is served the first one's two blocks in that
    same call."""
    app = await runner_client.open_session("app", cache_salt="s")
    first = await engine.step(app.session_id, [new(1, PROMPT, GREEDY)])
    before = calls(daemon)
    second = await engine.step(app.session_id, [decode_next(1, first[0].token_id),
                                                new(2, PROMPT, GREEDY)])
    assert second[1].num_cached == 8
    assert second[1].token_id == first[0].token_id  # the same prompt
    after = calls(daemon)
    assert {m: n - before.get(m, 0) for m, n in after.items() if n != before.get(m, 0)} == {
        "Batch": 1}


async def test_a_prefill_commit_with_no_next_step_rides_the_end_of_the_hold(
        daemon: Daemon, runner_client: PoolClient, engine: StepEngine) -> None:
    """No next step: once the session is idle (IDLE_END_S) the runner ends its hold with a
    Batch that carries the commit, in place of a KeepAlive: computed K/V is never lost."""
    app = await runner_client.open_session("app", cache_salt="s")
    other = await runner_client.open_session("other", cache_salt="s")
    before = calls(daemon)
    await engine.step(app.session_id, [new(1, PROMPT, GREEDY)])
    entry = engine.sessions.get(app.session_id)
    assert entry is not None
    await _hold_ended(entry.sequences)
    made = calls(daemon)
    assert made["Batch"] - before.get("Batch", 0) == 2  # the Allocate, the commit with the end
    assert made.get("KeepAlive", 0) == before.get("KeepAlive", 0)
    assert await cached(other, 1) == 8
    assert await app.close() == 1  # no hold left: closed at once


async def _hold_ended(known: SessionSequences) -> None:
    """Wait (no clock read) until the runner ended the session's hold."""
    while known.held_at > -math.inf:
        await asyncio.sleep(0.01)
