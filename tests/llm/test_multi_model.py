"""Two models of different geometries on one daemon (issue 21), real processes: the presets
tiny-llama (2 layers, 2 KV heads of 32) and tiny (2 layers, 2 KV heads of 64), each with its
runner, on one pool of pages that fit both formats. Bursts alternate between the models, each
burst needing most of the pool, so pages move between the formats; every request generates
exactly transformers' greedy tokens for its own model's weights.
"""

import asyncio
from collections.abc import Iterator

import pytest
from transformers import PreTrainedModel

from pagedkv.client import SamplingParams
from pagedkv.client.engine.engine import Engine
from pagedkv.client.pool.client import PoolClient
from pagedkv.model_runner.models import ModelSource, load_model
from pagedkv.process.launch import Launched
from pagedkv.vocab.geometry import PRESETS, dtype_bytes

from pagedkvd_process import pagedkv_runner, pagedkvd
from served_model import hf_greedy

MODELS = ("tiny-llama", "tiny")
BLOCK_SIZE = 16
# tiny's fp32 block is 32 KiB, tiny-llama's 16 KiB: a page of 32 KiB holds 1 and 2 of them.
PAGE_BYTES = 32 * 1024
NUM_PAGES = 12
PROMPT, NEW = 24, 24  # 48 tokens: 3 blocks a sequence


def block_bytes(model: str) -> int:
    return PRESETS[model].geometry().bytes_per_block(BLOCK_SIZE, dtype_bytes("float32"))


@pytest.fixture(scope="module")
def daemon() -> Iterator[Launched]:
    with pagedkvd("--model-config", MODELS[0], "--kv-memory", str(NUM_PAGES * PAGE_BYTES),
                  "--page-size", str(PAGE_BYTES), "--block-size", str(BLOCK_SIZE)) as started:
        yield started


@pytest.fixture(scope="module")
def runners(daemon: Launched) -> Iterator[dict[str, Launched]]:
    with pagedkv_runner(daemon, "--random-init", MODELS[0], "--model-name", MODELS[0]) as a, \
            pagedkv_runner(daemon, "--random-init", MODELS[1], "--model-name", MODELS[1]) as b:
        yield {MODELS[0]: a, MODELS[1]: b}


@pytest.fixture(scope="module")
def references() -> dict[str, PreTrainedModel]:
    return {name: load_model(ModelSource(random_init=name, seed=0)) for name in MODELS}


def burst(model: str, round_index: int) -> list[list[int]]:
    """Prompts whose sequences take about 3/4 of the pool at full length."""
    pages = NUM_PAGES * 3 // 4
    count = pages * PAGE_BYTES // (3 * block_bytes(model))
    return [[(round_index * 97 + i * 13 + j) % 120 + 1 for j in range(PROMPT)]
            for i in range(count)]


async def test_alternating_bursts_of_two_geometries_give_transformers_tokens(
        daemon: Launched, runners: dict[str, Launched],
        references: dict[str, PreTrainedModel]) -> None:
    engines = {name: await Engine.connect(daemon.unix_target, runner.unix_target)
               for name, runner in runners.items()}
    params = SamplingParams(temperature=0, max_tokens=NEW)
    control = await PoolClient.connect(daemon.runners_target)
    try:
        moved = []
        for round_index, name in enumerate(MODELS * 2):
            prompts = burst(name, round_index)
            outputs = await asyncio.gather(*(engines[name].generate(p, params)
                                             for p in prompts))
            for prompt, output in zip(prompts, outputs, strict=True):
                assert list(output.outputs[0].token_ids) == hf_greedy(
                    references[name], prompt, NEW), (name, prompt)
            info = await control.pool_info()
            moved.append({m.name: m.format_pages for m in info.models})
        # Each burst took most pages for its own format: the pages moved back and forth.
        for round_index, name in enumerate(MODELS * 2):
            assert moved[round_index][name] > NUM_PAGES // 2, moved
    finally:
        await control.close()
        for engine in engines.values():
            await engine.close()
