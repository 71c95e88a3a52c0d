"""The model runner end to end: a random-initialized Llama decoding through a real pagedkvd.

The daemon runs as a separate process with a pool laid out for this model (its config.json),
the runner maps the pool file and computes through its step engine (`engine_driver.greedy`:
the loop `pagedkv runner` serves); greedy tokens must equal transformers' own `generate` (SDPA
attention, its own cache) token for token.
"""

import copy
import dataclasses
import urllib.request
from collections.abc import AsyncIterator, Iterator, Sequence

import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import LlamaConfig, LlamaForCausalLM

from pagedkv.client import PoolClient, Session
from pagedkv.model_runner.engine.steps import StepNotComputed
from pagedkv.model_runner.kernels.attention_backend import BackendName, get_backend
from pagedkv.model_runner.kernels.paged_attention import CONTEXT_KWARG
from pagedkv.model_runner.runner import ModelRunner, PackedBuffer, SequenceChunk

from engine_driver import greedy
from kernel_utils import skip_unless_triton_runs_on
from pagedkvd_process import Pagedkvd, free_tcp_port, pagedkvd

BLOCK_SIZE = 16
NUM_BLOCKS = 64
NEW_TOKENS = 12
# Prompt lengths: inside one block, just past one, past two (prefill and decode cross blocks).
PROMPT_LENS = (5, 17, 33)
CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                     initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                     pad_token_id=None)


@pytest.fixture(scope="module")
def reference_model() -> LlamaForCausalLM:
    """The model with transformers' own attention: what the runner must agree with."""
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG).eval()


@pytest.fixture(scope="module")
def model(reference_model: LlamaForCausalLM) -> LlamaForCausalLM:
    """The same weights, for the runner to switch to paged attention."""
    return copy.deepcopy(reference_model)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, CONFIG.vocab_size, (n,), generator=generator).tolist()
            for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def metrics_port() -> int:
    """The daemon's /metrics port: pool-wide figures (pending blocks) are the operator's."""
    return free_tcp_port()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, metrics_port: int) -> Iterator[Pagedkvd]:
    """One pagedkvd for the module, its pool shaped by the model's config.json."""
    config_dir = tmp_path_factory.mktemp("model")
    CONFIG.save_pretrained(config_dir)
    with pagedkvd("--model-config", str(config_dir / "config.json"), "--dtype", "float32",
                  "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS),
                  "--metrics-listen", f"127.0.0.1:{metrics_port}") as running:
        yield running
        assert running.stop() == 0


@pytest.fixture
async def client(daemon: Pagedkvd) -> AsyncIterator[PoolClient]:
    """The test process is the runner here: it calls through the daemon's runner socket."""
    async with await PoolClient.connect(daemon.runners_target) as connected:
        yield connected


def pending_blocks(metrics_port: int) -> float:
    """The pool's pending blocks, as Prometheus scrapes them."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics") as response:
        text = response.read().decode()
    return next(sample.value for family in text_string_to_metric_families(text)
                for sample in family.samples if sample.name == "pagedkv:pending_blocks")



async def attach(client: PoolClient, model: LlamaForCausalLM, backend: BackendName) -> ModelRunner:
    return ModelRunner.attach(model, await client.pool_info(), get_backend(backend))


def expected_tokens(reference_model: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    output = reference_model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False)
    return list(output[0, len(prompt):].tolist())


async def test_greedy_generation_matches_transformers(
    client: PoolClient, session: Session, model: LlamaForCausalLM,
    reference_model: LlamaForCausalLM, prompts: list[list[int]],
) -> None:
    runner = await attach(client, model, "torch")
    results = await greedy(client, runner, session.session_id, prompts, NEW_TOKENS)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.results[0].num_cached == 0
        assert result.tokens == expected_tokens(reference_model, prompt, NEW_TOKENS)
    stats = await session.stats()
    assert stats.session is not None
    assert stats.session.num_sequences == 0  # each released on its last step


class RecordingRunner(ModelRunner):
    """A runner that remembers the chunks of every step it ran."""

    steps: list[list[SequenceChunk]]

    def step(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        self.steps.append(list(chunks))
        return super().step(chunks)


async def test_prefix_cached_prompts_generate_the_same_tokens(
    client: PoolClient, session: Session, model: LlamaForCausalLM,
    reference_model: LlamaForCausalLM, prompts: list[list[int]],
) -> None:
    runner = RecordingRunner.attach(model, await client.pool_info(), get_backend("torch"))
    runner.steps = []
    long_prompt = prompts[2]  # 33 tokens: 2 full blocks enter the cache
    first = await greedy(client, runner, session.session_id, [long_prompt], NEW_TOKENS)
    # Again, and its 32-token prefix: every token cached, the last one recomputed without a write.
    runner.steps = []
    again = await greedy(client, runner, session.session_id, [long_prompt, long_prompt[:32]],
                         NEW_TOKENS, first_seq_id=10)
    assert [r.results[0].num_cached for r in again] == [32, 32]
    suffix, last = runner.steps[0]  # the prefill computed one token of each
    assert (suffix.start, list(suffix.token_ids)) == (32, long_prompt[32:])
    assert suffix.slot_mapping[0] >= 0
    assert (last.start, list(last.token_ids), list(last.slot_mapping)) == (
        31, long_prompt[31:32], [-1])
    assert again[0].tokens == first[0].tokens
    assert again[0].tokens == expected_tokens(reference_model, long_prompt, NEW_TOKENS)
    assert again[1].tokens == expected_tokens(reference_model, long_prompt[:32], NEW_TOKENS)


async def test_identical_prompts_in_one_batch_each_compute_their_own_copy(
    client: PoolClient, session: Session, model: LlamaForCausalLM,
    reference_model: LlamaForCausalLM, prompts: list[list[int]],
) -> None:
    """The second allocation finds the first's blocks pending (no K/V yet), so it computes its
    own copy; once generation committed them, the same prompt is served from the cache."""
    runner = await attach(client, model, "torch")
    prompt = prompts[2][:32]
    results = await greedy(client, runner, session.session_id, [prompt, prompt], NEW_TOKENS)
    assert [r.results[0].num_cached for r in results] == [0, 0]
    expected = expected_tokens(reference_model, prompt, NEW_TOKENS)
    assert [r.tokens for r in results] == [expected, expected]
    again = await greedy(client, runner, session.session_id, [prompt], NEW_TOKENS,
                         first_seq_id=5)
    assert again[0].results[0].num_cached == 32 and again[0].tokens == expected


async def test_a_failed_prefill_is_never_served_from_the_cache(
    client: PoolClient, session: Session, model: LlamaForCausalLM,
    reference_model: LlamaForCausalLM, prompts: list[list[int]], metrics_port: int,
) -> None:
    """The issue's reproduction: a request whose prefill never ran (its slots hold garbage),
    freed, then the same 32-token prefix + one token in the same session. Its blocks were only
    pending, so nothing is served from the cache and the tokens are a fresh session's."""
    runner = await attach(client, model, "torch")
    prompt = [*prompts[2][:32], prompts[0][0]]
    failed = await session.allocate(100, token_ids=prompt)
    runner.pool[failed.block_ids] = 1e3  # a crashed, half-run prefill
    assert pending_blocks(metrics_port) == 2
    await session.free(100)
    again = await greedy(client, runner, session.session_id, [prompt], NEW_TOKENS,
                         first_seq_id=101)
    async with await client.open_session("fresh") as fresh:
        expected = await greedy(client, runner, fresh.session_id, [prompt], NEW_TOKENS)
    assert again[0].results[0].num_cached == 0
    assert again[0].tokens == expected[0].tokens
    assert again[0].tokens == expected_tokens(reference_model, prompt, NEW_TOKENS)


class FailingRunner(ModelRunner):
    """A runner whose forward fails (out of memory, a bad kernel): nothing it was asked to
    compute may become shareable."""

    def step(self, chunks: Sequence[SequenceChunk]) -> torch.Tensor:
        raise RuntimeError("forward failed")


async def test_a_prefill_that_fails_in_the_forward_commits_nothing(
    client: PoolClient, session: Session, model: LlamaForCausalLM, prompts: list[list[int]],
    metrics_port: int,
) -> None:
    info = await client.pool_info()
    failing = FailingRunner.attach(model, info, get_backend("torch"))
    prompt = prompts[2][:32]
    with pytest.raises(StepNotComputed, match="forward failed"):
        await greedy(client, failing, session.session_id, [prompt], NEW_TOKENS)
    assert pending_blocks(metrics_port) == 2  # allocated, never certified
    await session.free(0)  # what StepNotComputed leaves to the client
    runner = await attach(client, model, "torch")
    again = await greedy(client, runner, session.session_id, [prompt], NEW_TOKENS,
                         first_seq_id=1)
    assert again[0].results[0].num_cached == 0
    assert pending_blocks(metrics_port) == 0


async def test_triton_backend_matches_torch(
    client: PoolClient, session: Session, model: LlamaForCausalLM, prompts: list[list[int]],
) -> None:
    """The Triton kernels (interpreted on CPU) give the torch kernels' logits, prefill and
    decode. Both runners compute the same chunks into the same slots."""
    skip_unless_triton_runs_on("cpu")
    info = await client.pool_info()
    runners = [ModelRunner.attach(model, info, get_backend("torch")),
               ModelRunner.attach(model, info, get_backend("triton"))]
    prompt = prompts[0]
    blocks = await session.allocate(1, token_ids=prompt)
    chunk = SequenceChunk(prompt, 0, blocks.slot_mapping, blocks.block_ids)
    for _ in range(3):  # the prefill, then two decode steps
        torch_logits, triton_logits = (runner.step([chunk]) for runner in runners)
        torch.testing.assert_close(triton_logits, torch_logits, rtol=1e-5, atol=1e-5)
        token = int(torch_logits.argmax())
        step = await session.step([1], [token])
        chunk = SequenceChunk([token], chunk.start + len(chunk.token_ids), step.slot_mapping,
                              chunk.block_table)


async def test_a_stale_slot_is_refused_before_anything_is_written(
    client: PoolClient, session: Session, model: LlamaForCausalLM, prompts: list[list[int]],
) -> None:
    runner = await attach(client, model, "torch")
    blocks = await session.allocate(1, token_ids=prompts[1])
    chunk = SequenceChunk(prompts[1], 0, blocks.slot_mapping, blocks.block_ids)
    before = runner.pool.clone()
    wrong_slot = [*blocks.slot_mapping[:-1], blocks.slot_mapping[-1] + 1]
    with pytest.raises(ValueError, match="slot"):
        runner.step([dataclasses.replace(chunk, slot_mapping=wrong_slot)])
    with pytest.raises(ValueError, match="shorter than its sequence"):
        runner.step([dataclasses.replace(chunk, block_table=blocks.block_ids[:1])])
    with pytest.raises(ValueError, match="16 tokens has 17 slots"):  # one token short...
        runner.step([dataclasses.replace(chunk, token_ids=prompts[1][:-1]),
                     dataclasses.replace(chunk, token_ids=[*prompts[1], 0])])  # ...one over
    with pytest.raises(ValueError, match="token ids"):
        runner.step([dataclasses.replace(chunk, token_ids=[CONFIG.vocab_size] * len(prompts[1]))])
    assert torch.equal(runner.pool, before)
    assert runner.step([chunk]).shape == (1, CONFIG.vocab_size)


async def test_runner_refuses_a_pool_of_another_shape(
    client: PoolClient, model: LlamaForCausalLM,
) -> None:
    pool = (await attach(client, model, "torch")).pool
    with pytest.raises(ValueError, match="layers"):
        ModelRunner(model, pool[:, :1], BLOCK_SIZE, get_backend("torch"))
    with pytest.raises(ValueError, match="float64"):
        ModelRunner(model, pool.double(), BLOCK_SIZE, get_backend("torch"))


def test_paged_attention_refuses_calls_it_cannot_compute(model: LlamaForCausalLM) -> None:
    pool = torch.zeros(1, 2, 2, BLOCK_SIZE, 2, 16)
    runner = ModelRunner(model, pool, BLOCK_SIZE, get_backend("torch"))
    with pytest.raises(ValueError, match=CONTEXT_KWARG):
        model(torch.tensor([[1, 2, 3]]), use_cache=False)
    inputs = runner.prepare([SequenceChunk([1, 2, 3], 0, [0, 1, 2], [0])])
    with pytest.raises(ValueError, match="sliding_window"):
        model(inputs.input_ids, position_ids=inputs.position_ids, use_cache=False,
              sliding_window=2, **{CONTEXT_KWARG: inputs.context})
    assert not pool.any()  # refused before the first store


def test_prepare_keeps_a_decode_step_in_order_and_packs_decodes_first_otherwise(
    model: LlamaForCausalLM,
) -> None:
    pool = torch.zeros(4, 2, 2, BLOCK_SIZE, 2, 16)
    runner = ModelRunner(model, pool, BLOCK_SIZE, get_backend("torch"))
    decodes = [SequenceChunk([7], 20, [2 * BLOCK_SIZE + 4], [1, 2]),
               SequenceChunk([8], 3, [3], [0])]
    inputs = runner.prepare(decodes)
    # In chunk order, every row's logits kept (no gather).
    assert inputs.last_token_index == 0 and inputs.input_ids.tolist() == [[7, 8]]
    assert inputs.position_ids.tolist() == [[20, 3]]
    assert inputs.context.block_tables.tolist() == [[1, 2], [0, 0]]  # padded with block 0
    assert inputs.context.num_decodes == 2 and inputs.context.max_decode_len == 21
    mixed = [SequenceChunk([5, 6, 7], 0, [48, 49, 50], [3]), decodes[1]]
    inputs = runner.prepare(mixed)
    # The decode packs first; each chunk's logits row is its last token, in chunk order.
    assert inputs.input_ids.tolist() == [[8, 5, 6, 7]]
    assert inputs.position_ids.tolist() == [[3, 0, 1, 2]]
    assert isinstance(inputs.last_token_index, torch.Tensor)
    assert inputs.last_token_index.tolist() == [3, 0]
    assert inputs.context.query_start_loc.tolist() == [0, 1, 4]
    assert inputs.context.num_decodes == 1 and inputs.context.max_q_len == 3


def test_a_packed_buffer_crosses_to_a_device_as_views_of_one_copy() -> None:
    buffer = PackedBuffer((("ids", np.int64, (1, 3)), ("tables", np.int32, (2, 5))))
    on_meta = buffer.to(torch.device("meta"))  # a device that is not the CPU, with no memory
    assert {name: (t.shape, t.dtype) for name, t in on_meta.items()} == {
        "ids": ((1, 3), torch.int64), "tables": ((2, 5), torch.int32)}
    # One storage of the buffer's bytes, each field rounded up to 16 bytes: the ids' 24 take 32,
    # so the tables start at int32 element 8, and their 40 take 48.
    assert on_meta["tables"].untyped_storage().nbytes() == buffer.bytes.nbytes == 32 + 48
    assert on_meta["tables"].storage_offset() == 8
