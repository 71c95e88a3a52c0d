"""Fixtures of the step-engine tests that run over the families' daemon (support/families.py):
one pagedkvd per module, its pool laid out from the Llama config, the prompts, and a
per-family engine. A module that defines a fixture of the same name uses its own."""

from collections.abc import AsyncIterator, Iterator

import pytest
import torch

from pagedkv.client import PoolClient
from pagedkv.model_runner.engine.step_engine import StepEngine
from pagedkv.model_runner.kernels.attention_backend import get_backend

from engine_driver import RecordingRunner
from families import BLOCK_SIZE, FAMILIES, NUM_BLOCKS, PROMPT_LENS, VOCAB, paged_model
from pagedkvd_process import Pagedkvd, pagedkvd


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pagedkvd]:
    """One pagedkvd for every family: their pools are laid out alike."""
    config_dir = tmp_path_factory.mktemp("model")
    FAMILIES["llama"][1].save_pretrained(config_dir)
    with pagedkvd("--model-config", str(config_dir / "config.json"), "--dtype", "float32",
                  "--block-size", str(BLOCK_SIZE), "--num-blocks", str(NUM_BLOCKS)) as running:
        yield running
        assert running.stop() == 0


@pytest.fixture(scope="module")
def prompts() -> list[tuple[int, ...]]:
    generator = torch.Generator().manual_seed(1)
    return [tuple(torch.randint(0, VOCAB, (n,), generator=generator).tolist())
            for n in PROMPT_LENS]


@pytest.fixture
async def engine(runner_client: PoolClient, family: str) -> AsyncIterator[StepEngine]:
    """An engine over the family's paged model (`family` comes from the test's parameters), on
    the daemon's runner socket as a runner is."""
    runner = RecordingRunner.attach(paged_model(family), await runner_client.pool_info(),
                                    get_backend("torch"))
    started = StepEngine(runner_client, runner)
    await started.start()
    yield started
    await started.stop()
