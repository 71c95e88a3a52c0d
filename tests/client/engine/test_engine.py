"""The client engine (continuous batching, parallel sampling, beam search, preemption) driving a
real `pagedkv runner` process next to a real `pagedkvd`, against transformers on the same model.

Two pools from one tiny Llama config: a roomy one (256 blocks) and a small one (12 blocks of 16
tokens) where eight requests cannot all run at once, so admission waits and running requests
are preempted and recomputed.
"""

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from pagedkv.client import PoolClient, SamplingParams
from pagedkv.client.engine.engine import Engine
from pagedkv.client.engine.outputs import StepRecord
from pagedkv.client.engine.scheduler import SchedulerConfig

from client_engine_model import PROMPTS
from pagedkvd_process import Pagedkvd, pagedkv_runner, pagedkvd
from served_model import hf_greedy

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
# The module fixtures config_path, reference and roomy are conftest.py's.


@pytest.fixture(scope="module")
def small(config_path: Path) -> Iterator[tuple[Pagedkvd, Pagedkvd]]:
    with pagedkvd("--model-config", str(config_path), "--num-blocks", "12") as daemon, \
            pagedkv_runner(daemon, "--random-init", str(config_path)) as runner:
        yield daemon, runner


@pytest.fixture(scope="module")
def contiguous(config_path: Path) -> Iterator[tuple[Pagedkvd, Pagedkvd]]:
    """The baseline: 12 blocks as max-length reservations of 64 tokens (4 blocks each)."""
    with pagedkvd("--model-config", str(config_path), "--num-blocks", "12", "--allocator",
                  "contiguous", "--max-model-len", "64") as daemon, \
            pagedkv_runner(daemon, "--random-init", str(config_path)) as runner:
        yield daemon, runner


@pytest.fixture
async def engine(roomy: tuple[Pagedkvd, Pagedkvd]) -> AsyncIterator[Engine]:
    daemon, runner = roomy
    async with await Engine.connect(daemon.unix_target, runner.unix_target) as connected:
        yield connected


async def test_concurrent_greedy_requests_equal_transformers(
        engine: Engine, reference: PreTrainedModel) -> None:
    """Eight requests submitted together are batched (several sequences per step) and each
    generates transformers' greedy tokens; counts and finish reasons are reported."""
    records: list[StepRecord] = []
    engine.observers.append(records.append)
    outputs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        (only,) = output.outputs
        assert list(only.token_ids) == hf_greedy(reference, prompt, 12)
        assert only.finish_reason == "length"
        assert (output.num_prompt_tokens, output.num_generated_tokens) == (len(prompt), 12)
        assert output.finished
    assert max(r.num_seqs for r in records) == len(PROMPTS)
    stats = (await engine.session.stats()).session
    assert stats is not None and stats.num_sequences == 0  # finished sequences were freed


async def test_stop_tokens_and_max_tokens(engine: Engine, reference: PreTrainedModel) -> None:
    prompt = PROMPTS[2]
    expected = hf_greedy(reference, prompt, 12)
    stop = expected[4]
    first = expected.index(stop)
    output = await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=12,
                                                          stop_token_ids=[stop]))
    assert list(output.outputs[0].token_ids) == expected[:first + 1]
    assert output.outputs[0].finish_reason == "stop"
    short = await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=3))
    assert list(short.outputs[0].token_ids) == expected[:3]


async def test_a_long_prompt_is_chunked_and_a_repeated_prefix_is_cached(
        roomy: tuple[Pagedkvd, Pagedkvd], reference: PreTrainedModel) -> None:
    daemon, runner = roomy
    prompt = [(5 * j + 2) % 128 for j in range(100)]
    records: list[StepRecord] = []
    config = SchedulerConfig(max_num_batched_tokens=32)
    async with await Engine.connect(daemon.unix_target, runner.unix_target,
                                    config=config) as small_steps:
        small_steps.observers.append(records.append)
        first = await small_steps.generate(prompt, SamplingParams(temperature=0, max_tokens=4))
        again = await small_steps.generate(prompt, SamplingParams(temperature=0, max_tokens=4))
    assert [r.num_tokens for r in records[:4]] == [100, 0, 0, 0]  # allocated once, then computed
    assert sum(1 for r in records if r.num_sampled == 0) >= 3  # 100 tokens in chunks of 32
    assert list(first.outputs[0].token_ids) == hf_greedy(reference, prompt, 4)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 96)


async def test_a_caller_that_goes_away_aborts_its_request_and_frees_its_blocks(
        engine: Engine, reference: PreTrainedModel) -> None:
    """A stream left after two outputs, and a generate cancelled once it has two tokens, are
    aborted: their sequences are freed while another request goes on to its exact tokens, and
    the engine samples far fewer than the 2 x 200 tokens they asked for (the runner, following
    the session, stops at the engine's next message)."""
    records: list[StepRecord] = []
    engine.observers.append(records.append)
    params = SamplingParams(temperature=0, max_tokens=200)
    survivor = asyncio.create_task(engine.generate(PROMPTS[2], GREEDY))
    seen = 0
    async for partial in engine.stream(PROMPTS[4], params):
        seen += 1
        if seen == 2:
            assert not partial.finished
            break
    gone = asyncio.create_task(engine.generate(PROMPTS[5], params, request_id="gone"))
    while not any(r.request_id == "gone" and r.seqs[0].num_generated >= 2
                  for r in engine.scheduler.running):
        await asyncio.sleep(0.002)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    output = await survivor
    assert list(output.outputs[0].token_ids) == hf_greedy(reference, PROMPTS[2], 12)
    async with asyncio.timeout(10):
        while True:
            stats = (await engine.session.stats()).session
            assert stats is not None
            if stats.num_sequences == 0 and not engine.scheduler.has_work:
                break
            await asyncio.sleep(0.05)
    assert sum(r.num_sampled for r in records) < 200


async def test_seeded_sampling_is_reproducible(engine: Engine) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10)
    one, two = await asyncio.gather(engine.generate(PROMPTS[1], params),
                                    engine.generate(PROMPTS[1], params))
    three = await engine.generate(PROMPTS[1], SamplingParams(temperature=1.0, top_p=0.9,
                                                             seed=99, max_tokens=10))
    assert one.outputs[0].token_ids == two.outputs[0].token_ids
    assert one.outputs[0].token_ids != three.outputs[0].token_ids


async def test_parallel_samples_share_the_prompt_blocks(engine: Engine) -> None:
    """n = 4 from one prefill of a 40-token prompt: while the samples run, the session holds
    fewer physical blocks than its block tables name (the prompt's blocks are shared); the
    seeded samples differ from each other and are reproducible."""
    params = SamplingParams(temperature=1.0, n=4, seed=5, max_tokens=8, logprobs=0)
    shared = []
    async for partial in engine.stream(PROMPTS[4], params):
        if len(partial.outputs) == 4 and not partial.finished:
            stats = (await engine.session.stats()).session
            assert stats is not None
            shared.append((stats.blocks_held, stats.block_table_entries))
    final = partial
    assert len(final.outputs) == 4
    assert len({o.token_ids for o in final.outputs}) > 1
    assert all(len(o.token_ids) == 8 and o.logprobs is not None for o in final.outputs)
    # A figure read after the last step released the samples (before the engine's last
    # partial) names no entry; every one read while they ran shares the prompt's blocks.
    running = [(held, entries) for held, entries in shared if entries]
    assert running and all(held < entries for held, entries in running)
    again = await engine.generate(PROMPTS[4], params)
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in final.outputs]
    assert final.num_generated_tokens == 32


async def test_best_of_returns_the_n_most_likely_samples(engine: Engine) -> None:
    output = await engine.generate(PROMPTS[3], SamplingParams(temperature=1.0, n=2, best_of=5,
                                                              seed=3, max_tokens=6))
    scores = [o.cumulative_logprob for o in output.outputs]
    assert len(scores) == 2 and scores == sorted(scores, reverse=True)
    every = await engine.generate(PROMPTS[3], SamplingParams(temperature=1.0, n=5, seed=3,
                                                             max_tokens=6))
    assert sorted(o.cumulative_logprob for o in every.outputs)[-2:][::-1] == scores


@pytest.mark.parametrize(("width", "length_penalty", "early_stopping", "stop_at"), [
    (2, 1.0, False, None), (4, 1.0, True, 3), (3, 2.0, "never", 2), (4, 0.5, False, 5)])
async def test_beam_search_equals_transformers(
        engine: Engine, reference: PreTrainedModel, width: int, length_penalty: float,
        early_stopping: bool | str, stop_at: int | None) -> None:
    prompt = PROMPTS[1]
    eos = None if stop_at is None else hf_greedy(reference, prompt, 8)[stop_at]
    expected = reference.generate(
        torch.tensor([prompt]), num_beams=width, do_sample=False, max_new_tokens=10,
        length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=eos,
        num_return_sequences=width, pad_token_id=0, return_dict_in_generate=True,
        output_scores=True)
    params = SamplingParams(temperature=0, beam_width=width, n=width, max_tokens=10,
                            length_penalty=length_penalty, early_stopping=early_stopping,  # type: ignore[arg-type]
                            stop_token_ids=() if eos is None else (eos,))
    output = await engine.generate(prompt, params)
    got = [list(o.token_ids) for o in output.outputs]
    want = [[t for t in row[len(prompt):].tolist()] for row in expected.sequences]
    # transformers pads finished beams with pad_token_id after the EOS.
    want = [row[:row.index(eos) + 1] if eos is not None and eos in row else row for row in want]
    assert got == want
    torch.testing.assert_close(torch.tensor([o.score for o in output.outputs]),
                               expected.sequences_scores, atol=1e-4, rtol=0)
    stats = (await engine.session.stats()).session
    assert stats is not None and stats.num_sequences == 0


async def test_a_small_pool_admits_by_free_blocks_and_preempts_without_changing_output(
        small: tuple[Pagedkvd, Pagedkvd], reference: PreTrainedModel) -> None:
    """12 blocks of 16 tokens for eight requests growing to 25-60 tokens (2-4 blocks each, 25
    in all): not all fit at once, so some wait and running ones are preempted as they grow;
    every output still equals transformers' greedy tokens, and nothing is left held."""
    daemon, runner = small
    params = SamplingParams(temperature=0, max_tokens=20)
    records: list[StepRecord] = []
    async with await Engine.connect(daemon.unix_target, runner.unix_target,
                                    config=SchedulerConfig(watermark=0.0)) as engine:
        engine.observers.append(records.append)
        outputs = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            assert list(output.outputs[0].token_ids) == hf_greedy(reference, prompt, 20)
        assert engine.scheduler.num_preemptions > 0
        assert sum(o.num_preemptions for o in outputs) == engine.scheduler.num_preemptions
        assert max(r.running_seqs for r in records) < len(PROMPTS)
        assert min(r.waiting for r in records[:3]) > 0
        stats = await engine.session.stats()
        assert stats.session is not None and stats.session.num_sequences == 0



# ---------------------------------------------------------------- client processes

ENGINE_CLIENT = """
import asyncio, json, sys
from pagedkv.client import PoolClient, SamplingParams
from pagedkv.client.engine.engine import Engine
daemon, runner, prompts, lease = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
async def main():
    async with await Engine.connect(daemon, runner, lease_ttl_ms=lease) as engine:
        print("ready", flush=True)
        sys.stdin.readline()  # start together
        params = SamplingParams(temperature=0, max_tokens=int(sys.argv[5]))
        outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        print(json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
asyncio.run(main())
"""


def start_engine_client(daemon: Pagedkvd, runner: Pagedkvd, prompts: list[list[int]],
                        max_tokens: int, lease_ms: int = 10_000) -> subprocess.Popen[str]:
    client = subprocess.Popen(
        [sys.executable, "-c", ENGINE_CLIENT, daemon.unix_target, runner.unix_target,
         json.dumps(prompts), str(lease_ms), str(max_tokens)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert client.stdout is not None and client.stdout.readline() == "ready\n"
    return client


def go(*clients: subprocess.Popen[str]) -> None:
    for client in clients:
        assert client.stdin is not None
        client.stdin.write("go\n")
        client.stdin.flush()


def test_two_client_processes_share_the_daemon_and_the_runner(
        roomy: tuple[Pagedkvd, Pagedkvd], reference: PreTrainedModel) -> None:
    daemon, runner = roomy
    clients = [start_engine_client(daemon, runner, PROMPTS[:4], 10),
               start_engine_client(daemon, runner, PROMPTS[4:], 10)]
    go(*clients)
    results = [json.loads(client.communicate(timeout=120)[0]) for client in clients]
    assert all(client.returncode == 0 for client in clients)
    assert results == [[hf_greedy(reference, p, 10) for p in PROMPTS[:4]],
                       [hf_greedy(reference, p, 10) for p in PROMPTS[4:]]]


async def test_a_killed_client_loses_only_its_requests_and_its_blocks_come_back(
        roomy: tuple[Pagedkvd, Pagedkvd], reference: PreTrainedModel) -> None:
    """Two clients generate; one is SIGKILLed mid-generation (its session lease is 1 s). The
    other finishes with its exact tokens, and within the lease every block the killed one held
    is free again."""
    daemon, runner = roomy
    async with await PoolClient.connect(daemon.unix_target) as pool:
        free_before = (await pool.stats()).free_blocks
        doomed = start_engine_client(daemon, runner, PROMPTS, 400, lease_ms=1000)
        survivor = start_engine_client(daemon, runner, PROMPTS[:3], 30)
        go(doomed, survivor)
        while (await pool.stats()).free_blocks > free_before - len(PROMPTS):
            await asyncio.sleep(0.05)  # the doomed client's sequences are in the pool
        doomed.kill()
        doomed.wait()
        out, _ = await asyncio.to_thread(survivor.communicate, timeout=120)
        assert survivor.returncode == 0
        assert json.loads(out) == [hf_greedy(reference, p, 30) for p in PROMPTS[:3]]
        deadline = asyncio.get_running_loop().time() + 5
        while (await pool.stats()).free_blocks != free_before:
            assert asyncio.get_running_loop().time() < deadline, "the killed client's blocks"
            await asyncio.sleep(0.1)


async def test_on_a_contiguous_daemon_admission_counts_whole_reservations(
        contiguous: tuple[Pagedkvd, Pagedkvd], reference: PreTrainedModel) -> None:
    """The same eight requests on the contiguous baseline: three 4-block reservations fit in 12
    blocks, so at most three sequences run at once; nothing is preempted or refused (the
    engine admits by the reservation the daemon reports), and the tokens are the same."""
    daemon, runner = contiguous
    params = SamplingParams(temperature=0, max_tokens=20)
    records: list[StepRecord] = []
    async with await Engine.connect(daemon.unix_target, runner.unix_target,
                                    config=SchedulerConfig(watermark=0.0)) as engine:
        assert engine.scheduler.reservation_blocks == 4
        engine.observers.append(records.append)
        outputs = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))
        for prompt, output in zip(PROMPTS, outputs, strict=True):
            assert list(output.outputs[0].token_ids) == hf_greedy(reference, prompt, 20)
        assert max(r.running_seqs for r in records) == 3
        assert engine.scheduler.num_preemptions == 0
