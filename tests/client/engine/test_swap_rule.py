"""Swap or recompute (issue 22): the engine's rule for a new sequence's prefix that the daemon's
host tier holds, and its path to the daemon.

- The pure rule (client/engine/swap_rule.py) per mode, at its boundary, before the prefill rate is
  measured and without a tier; the moving average of the prefill rate.
- SchedulerConfig.swap is checked when made.
- The engine, over a scripted runner (no daemon, no model), puts the rule's skip_host_tier on the
  SequenceStep of a request re-admitted after preemption.
- The runner carries SequenceStep.skip_host_tier of a new sequence without a parent into the
  AllocateRequest it sends the daemon (an in-process daemon, its servicer observed), and ignores
  it on any other sequence.
"""

import asyncio
import types
from collections.abc import AsyncIterator, Sequence

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv.client import (
    PoolClient,
    SamplingParams,
    SeqStep,
    StepOutputs,
)
from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.scheduler import SchedulerConfig
from pagedkv.client.engine.swap_rule import (
    MIN_MEASURED_TOKENS,
    HostTier,
    PrefillRate,
    skip_host_tier,
)
from pagedkv.daemon.edge import servicer
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.kernels.attention_backend import get_backend
from pagedkv.model_runner.process.step_messages import seq_request
from pagedkv.model_runner.runner import ModelRunner
from pagedkv.proto import kvpool_pb2 as pb

from daemon_harness import Daemon, running_daemon
from engine_driver import decode
from scripted_engine import ScriptedRunner, free_pool

BS = 16
# A block of 1,000 bytes copied in at 1,000 bytes/s: copy_s = 1 s per block.
TIER = HostTier(num_blocks=100, bytes_per_block=1000, copy_bytes_per_s=1000)
# 16 tokens a block at 16 tokens/s: recompute_s = 1 s per block, the tie.
TIE_RATE = 16.0


# ------------------------------------------------------------------ the pure rule


def test_auto_restores_while_copying_is_cheaper_and_recomputes_from_the_tie() -> None:
    assert skip_host_tier("auto", TIER, BS, TIE_RATE / 2) is False   # recompute_s = 2 s > 1 s
    assert skip_host_tier("auto", TIER, BS, TIE_RATE) is True        # copy_s == recompute_s
    assert skip_host_tier("auto", TIER, BS, TIE_RATE * 2) is True    # recompute_s = 0.5 s


def test_auto_restores_before_the_prefill_rate_is_measured() -> None:
    assert skip_host_tier("auto", TIER, BS, None) is False
    unknown_copy_rate = HostTier(num_blocks=100, bytes_per_block=1000, copy_bytes_per_s=0)
    assert skip_host_tier("auto", unknown_copy_rate, BS, TIE_RATE * 2) is False


def test_always_restores_and_never_recomputes_whatever_the_rates() -> None:
    for rate in (None, TIE_RATE / 2, TIE_RATE, TIE_RATE * 2):
        assert skip_host_tier("always", TIER, BS, rate) is False
        assert skip_host_tier("never", TIER, BS, rate) is True


def test_without_a_tier_nothing_is_skipped() -> None:
    for mode in ("auto", "always", "never"):
        assert skip_host_tier(mode, HostTier(), BS, TIE_RATE * 2) is False


def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="swap must be one of auto, always, never, got 'x'"):
        skip_host_tier("x", TIER, BS, None)


def test_the_prefill_rate_averages_steps_that_computed_more_than_the_threshold() -> None:
    rate = PrefillRate()
    rate.observe(MIN_MEASURED_TOKENS, 0.001)  # a decode-sized step: not a prefill's rate
    assert rate.tokens_per_s is None
    rate.observe(1000, 1.0)
    assert rate.tokens_per_s == 1000.0
    rate.observe(2000, 1.0)  # a fifth of the way to 2,000
    assert rate.tokens_per_s == pytest.approx(1200.0)


def test_scheduler_config_checks_swap() -> None:
    assert SchedulerConfig().swap == "auto"
    with pytest.raises(ValueError, match="swap must be one of auto, always, never, got 'no'"):
        SchedulerConfig(swap="no")


# ------------------------------------------------------------------ the engine


class RecordingRunner(ScriptedRunner):
    """support/scripted_engine.py's scripted runner whose steps 2 and 3 (decodes) fail as a pool
    full of another client's blocks would: the engine preempts the request and re-admits it.
    Records every SeqStep that went through, and takes a moment per step (the engine measures
    its prefill rate)."""

    def __init__(self) -> None:
        super().__init__(full={2, 3})
        self.sent: list[SeqStep] = []

    async def step(self, session: object, seqs: Sequence[SeqStep],
                   release: Sequence[int] = (), *, follow: bool = False) -> StepOutputs:
        outputs = await super().step(session, seqs, release, follow=follow)
        self.sent.extend(seqs)
        await asyncio.sleep(0.001)
        return outputs


async def generate(swap: str, tier: HostTier) -> tuple[Engine, list[SeqStep]]:
    """One request of 100 prompt tokens and 4 new ones, preempted once; the new sequences'
    steps sent (its first admission, then its re-admission)."""
    runner = RecordingRunner()
    session = types.SimpleNamespace(block_size=BS, stats=free_pool)
    pool = types.SimpleNamespace(close=runner.close)
    engine = Engine(pool, session, runner, vocab_size=100,  # type: ignore[arg-type]
                    eos_token_ids=(), num_blocks=8, free_blocks=8,
                    config=SchedulerConfig(swap=swap), host_tier=tier)
    output = await engine.generate(list(range(100)), SamplingParams(temperature=0, max_tokens=4))
    await engine.close()
    assert output.num_preemptions == 1
    new = [step for step in runner.sent if step.new_sequence]
    assert [step.num_prompt_tokens for step in new] == [0, 100]  # admitted, then re-admitted
    return engine, new


async def test_never_puts_skip_host_tier_on_the_readmitted_request() -> None:
    engine, (first, readmitted) = await generate("never", TIER)
    assert readmitted.skip_host_tier and first.skip_host_tier  # a prompt's prefix too
    assert (engine.scheduler.swap.num_restore, engine.scheduler.swap.num_recompute) == (0, 2)


async def test_always_does_not() -> None:
    engine, steps = await generate("always", TIER)
    assert [step.skip_host_tier for step in steps] == [False, False]
    assert (engine.scheduler.swap.num_restore, engine.scheduler.swap.num_recompute) == (2, 0)


async def test_auto_decides_by_the_prefill_rate_the_engine_measured() -> None:
    """The prompt's step computed 100 tokens (> 64) in far less than the 6 s a 1 s block copy
    makes the tie: recomputing the re-admitted request's 16-token blocks is cheaper. Before
    that step nothing was measured: the first admission restores."""
    engine, (first, readmitted) = await generate("auto", TIER)
    rate = engine.scheduler.swap.prefill.tokens_per_s
    assert rate is not None and rate > TIE_RATE
    assert (first.skip_host_tier, readmitted.skip_host_tier) == (False, True)


async def test_without_a_tier_never_sends_nothing() -> None:
    engine, steps = await generate("never", HostTier())
    assert [step.skip_host_tier for step in steps] == [False, False]
    assert (engine.scheduler.swap.num_restore, engine.scheduler.swap.num_recompute) == (0, 0)


# ------------------------------------------------------------------ the runner

GREEDY = SamplingParams(temperature=0.0, max_tokens=2)
CONFIG = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     head_dim=64, max_position_embeddings=64, initializer_range=0.2,
                     eos_token_id=None, bos_token_id=None, pad_token_id=None)


def test_the_runner_reads_skip_host_tier_of_a_new_sequence_without_a_parent_only() -> None:
    def parsed(step: SeqStep) -> bool:
        return seq_request(step.message()).skip_host_tier

    assert parsed(SeqStep(1, (5, 6), True, params=GREEDY, skip_host_tier=True))
    assert not parsed(SeqStep(1, (5, 6), True, params=GREEDY))
    assert not parsed(SeqStep(2, (), True, params=GREEDY, parent_seq_id=1, skip_host_tier=True))
    assert not parsed(SeqStep(1, (5,), skip_host_tier=True))


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=32, block_size=4, with_memory=True) as running:
        yield running
        running.service.check_invariants()


@pytest.fixture
async def engine(daemon: Daemon) -> AsyncIterator[tuple[PoolClient, StepEngine]]:
    async with await PoolClient.connect(daemon.runners_target) as client:
        torch.manual_seed(0)
        model = LlamaForCausalLM(CONFIG).eval()
        runner = ModelRunner.attach(model, await client.pool_info(), get_backend("torch"))
        started = StepEngine(client, runner)
        await started.start()
        yield client, started
        await started.stop()


async def test_the_runner_sends_skip_host_tier_in_the_daemon_allocation(
        engine: tuple[PoolClient, StepEngine], monkeypatch: pytest.MonkeyPatch) -> None:
    """Two new sequences in one step, one asking to skip the host tier: the daemon receives
    one AllocateRequest each, with skip_host_tier as each asked."""
    received: dict[int, bool] = {}
    allocate_op = servicer.allocate_op

    def observed(request: pb.AllocateRequest) -> object:
        received[request.seq_id] = request.skip_host_tier
        return allocate_op(request)

    monkeypatch.setattr(servicer, "allocate_op", observed)
    client, step_engine = engine
    session = await client.open_session("swap-test")
    prompt = [(7 * i + 3) % 128 for i in range(9)]
    await decode(step_engine, session.session_id, [
        SeqStep(1, tuple(prompt), True, params=GREEDY, skip_host_tier=True),
        SeqStep(2, tuple(prompt), True, params=GREEDY)], n=2)
    assert received == {1: True, 2: False}
