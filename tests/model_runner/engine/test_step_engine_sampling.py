"""Seeded sampling through the StepEngine: the tokens depend on the request, never on the batch.

A seeded row draws its randomness from (seed, tokens generated so far) (`sampling.step_seed`),
so the same request (temperature 0.8, top_k 20, seed 7) must sample the same tokens alone, beside
seeded, unseeded and greedy neighbours, at another position in the batch, while its prefill is
chunked beside decoding neighbours, in a forward merged with other clients' steps, and in a second
run on a fresh engine; another seed must sample other tokens. The model is a random Llama whose
KV geometry is the in-process daemon's (2 layers, 2 KV heads of 64, float32).
"""

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv.client import PoolClient, SamplingParams, SeqStep
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.kernels.attention_backend import get_backend
from pagedkv.model_runner.runner import SequenceChunk

from daemon_harness import Daemon, running_daemon
from engine_driver import Decoded, RecordingRunner, decode, new, recorder

NEW_TOKENS = 8
VOCAB = 128
CONFIG = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128,
                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                     max_position_embeddings=256, initializer_range=0.2, eos_token_id=None,
                     bos_token_id=None, pad_token_id=None)
SEEDED = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=NEW_TOKENS)
OTHER_SEED = SamplingParams(temperature=0.8, top_k=20, seed=8, max_tokens=NEW_TOKENS)
UNSEEDED = SamplingParams(temperature=1.0, max_tokens=NEW_TOKENS)
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
# Longest a test waits for the engine's forward thread to reach a point.
WAIT_S = 30.0


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """The in-process daemon's event loop shares this process with the forward thread: one
    intra-op thread leaves it a core, as pagedkvd does (two made these tests 3x slower on a
    loaded 2-core host)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG).eval()


@pytest.fixture(scope="module")
def prompts() -> dict[str, tuple[int, ...]]:
    """The seeded request's prompt ("seeded") and its neighbours'."""
    generator = torch.Generator().manual_seed(1)
    lengths = {"seeded": 17, "short": 5, "long": 33, "mid": 9}
    return {name: tuple(torch.randint(0, VOCAB, (n,), generator=generator).tolist())
            for name, n in lengths.items()}


@pytest.fixture
async def daemon() -> AsyncIterator[Daemon]:
    async with running_daemon(num_blocks=64, block_size=16, with_memory=True) as running:
        yield running


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[PoolClient]:
    """The engine's client and its clients' in one: the runner socket, as a runner's."""
    async with await PoolClient.connect(daemon.runners_target) as connected:
        yield connected


async def started_engine(client: PoolClient, model: LlamaForCausalLM,
                         runner_class: type[RecordingRunner] = RecordingRunner) -> StepEngine:
    runner = runner_class.attach(model, await client.pool_info(), get_backend("torch"))
    engine = StepEngine(client, runner)
    await engine.start()
    return engine


async def run(engine: StepEngine, client: PoolClient,
              first: Sequence[SeqStep]) -> dict[int, Decoded]:
    """Decode `first` to NEW_TOKENS each, in a session of its own (no cached prefix)."""
    async with await client.open_session("engine-sampling") as session:
        return await decode(engine, session.session_id, first, NEW_TOKENS)


async def test_a_seeded_request_samples_alike_in_any_batch(
    client: PoolClient, model: LlamaForCausalLM, prompts: dict[str, tuple[int, ...]],
) -> None:
    engine = await started_engine(client, model)
    try:
        alone = await run(engine, client, [new(1, prompts["seeded"], SEEDED)])
        mixed = await run(engine, client, [
            new(1, prompts["short"], UNSEEDED), new(2, prompts["seeded"], SEEDED),
            new(3, prompts["long"], OTHER_SEED), new(4, prompts["mid"], GREEDY)])
        reordered = await run(engine, client, [
            new(7, prompts["long"], OTHER_SEED), new(8, prompts["mid"], GREEDY),
            new(9, prompts["short"], UNSEEDED), new(10, prompts["seeded"], SEEDED)])
        # 7 tokens per step: the 17-token prompt samples on its third step, its neighbour
        # decodes from the first, so every step's batch differs.
        chunked = await run(engine, client, [
            new(1, prompts["short"], UNSEEDED, max_compute_tokens=7),
            new(2, prompts["seeded"], SEEDED, max_compute_tokens=7)])
        greedy = await run(engine, client, [new(1, prompts["seeded"], GREEDY)])
    finally:
        await engine.stop()
    tokens = alone[1].tokens
    assert len(tokens) == NEW_TOKENS
    assert mixed[2].tokens == tokens
    assert reordered[10].tokens == tokens
    assert [r.sampled for r in chunked[2].results[:3]] == [False, False, True]
    assert chunked[2].tokens == tokens
    assert tokens != greedy[1].tokens  # it did sample


class GatedRunner(RecordingRunner):
    """A runner whose first forward waits for `gate`: steps arriving meanwhile are prepared and
    queue up, so the next forward merges them."""

    # Set by the first forward once it has started; it then waits for `gate`.
    entered = threading.Event()
    gate = threading.Event()

    def step(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        if not self.chunks:
            self.entered.set()
            self.gate.wait(timeout=WAIT_S)
        return super().step(chunks)


async def test_a_seeded_request_samples_alike_in_a_forward_merged_across_clients(
    client: PoolClient, model: LlamaForCausalLM, prompts: dict[str, tuple[int, ...]],
) -> None:
    """Three clients' sessions; the first's prefill holds the forward thread while the other
    two steps are prepared, so the second forward carries both: the seeded sequence's rows then
    sit among another client's sequences, and it still samples its tokens."""
    engine = await started_engine(client, model)
    try:
        alone = await run(engine, client, [new(1, prompts["seeded"], SEEDED)])
    finally:
        await engine.stop()
    gated = await started_engine(client, model, GatedRunner)
    GatedRunner.entered.clear()
    GatedRunner.gate.clear()
    try:
        blocker = asyncio.create_task(run(gated, client, [new(1, prompts["mid"], GREEDY)]))
        assert await asyncio.to_thread(GatedRunner.entered.wait, WAIT_S)
        merged = [asyncio.create_task(run(gated, client, first)) for first in (
            [new(1, prompts["short"], UNSEEDED), new(2, prompts["long"], OTHER_SEED)],
            [new(1, prompts["seeded"], SEEDED)])]
        async with asyncio.timeout(WAIT_S):
            while len(gated.forwards._ready) < 2:  # both prepared, queued behind the gated forward
                await asyncio.sleep(0.01)
        GatedRunner.gate.set()
        await blocker
        others, seeded = await asyncio.gather(*merged)
    finally:
        GatedRunner.gate.set()
        await gated.stop()
    # The second forward carries both waiting clients' prefills (3 chunks), and maybe the first
    # client's next decode token (the forward gathers the clients of the last one).
    first, second = recorder(gated).chunks[:2]
    assert len(first) == 1
    assert len([chunk for chunk in second if len(chunk.token_ids) > 1]) == 3
    assert seeded[1].tokens == alone[1].tokens
    assert len(others[1].tokens) == len(others[2].tokens) == NEW_TOKENS


async def test_seeded_sampling_repeats_across_runs_and_differs_across_seeds(
    client: PoolClient, model: LlamaForCausalLM, prompts: dict[str, tuple[int, ...]],
) -> None:
    """Two engines, each with its own Sampler (its own unseeded generator): the seeded requests
    sample the same tokens in both; seeds 7, 8 and 9 sample three different sequences."""
    seeds = (7, 8, 9)
    runs = []
    for _ in range(2):
        engine = await started_engine(client, model)
        try:
            runs.append(await run(engine, client, [
                new(seed, prompts["seeded"], SamplingParams(temperature=0.8, top_k=20, seed=seed,
                                                            max_tokens=NEW_TOKENS))
                for seed in seeds] + [new(0, prompts["short"], UNSEEDED)]))
        finally:
            await engine.stop()
    first, second = ([r[seed].tokens for seed in seeds] for r in runs)
    assert first == second
    assert len({tuple(tokens) for tokens in first}) == len(seeds)
