"""Fixtures of the client engine tests that serve support/client_engine_model.py's tiny Llama
(test_engine.py's, which test_follow.py shares): per module, its config.json, transformers' model
of it, and a roomy pool (256 blocks) of a real `pagedkvd` with a real `pagedkv runner`. A module
that defines a fixture of the same name uses its own."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from client_engine_model import CONFIG
from pagedkvd_process import Pagedkvd, pagedkv_runner, pagedkvd
from served_model import reference_model, write_config


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(CONFIG, tmp_path_factory)


@pytest.fixture(scope="module")
def reference(config_path: Path) -> PreTrainedModel:
    return reference_model(config_path, attention="eager")


@pytest.fixture(scope="module")
def roomy(config_path: Path) -> Iterator[tuple[Pagedkvd, Pagedkvd]]:
    with pagedkvd("--model-config", str(config_path), "--num-blocks", "256") as daemon, \
            pagedkv_runner(daemon, "--random-init", str(config_path)) as runner:
        yield daemon, runner
