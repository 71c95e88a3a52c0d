"""Fixtures of the runner-process tests (test_servicer.py's, which test_follow.py and
test_penalties.py share): per module, the tests' tiny Llama's config.json, transformers' model
of it, a real `pagedkvd` of 128 blocks, and a real `pagedkv runner` random-initializing the same
config, with its metrics port. A module that defines a fixture of the same name uses its own."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import PreTrainedModel

from pagedkvd_process import Pagedkvd, free_tcp_port, pagedkv_runner, pagedkvd
from served_model import TINY, reference_model, write_config


@pytest.fixture(scope="module")
def config_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_config(TINY, tmp_path_factory)


@pytest.fixture(scope="module")
def reference(config_path: Path) -> PreTrainedModel:
    return reference_model(config_path)


@pytest.fixture(scope="module")
def daemon(config_path: Path) -> Iterator[Pagedkvd]:
    with pagedkvd("--model-config", str(config_path), "--num-blocks", "128") as running:
        yield running


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_tcp_port()


@pytest.fixture(scope="module")
def runner(daemon: Pagedkvd, config_path: Path, metrics_port: int) -> Iterator[Pagedkvd]:
    with pagedkv_runner(daemon, "--random-init", str(config_path), "--metrics-listen",
                        f"127.0.0.1:{metrics_port}") as running:
        yield running
