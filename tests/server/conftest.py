"""A `pagedkv serve` for tool calls and structured outputs, shared by the tests that need it:
the tool model folder (support/tool_model.py), hermes as the auto tool parser."""

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from pagedkvd_process import short_tmp_dir, start_serve
from tool_model import TOOL_MODEL, make_tool_model_dir


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tool-model")
    make_tool_model_dir(folder)
    return folder


@pytest.fixture(scope="session")
def tool_server(tool_model_dir: Path) -> Iterator[int]:
    """The server's port: a 4 MiB pool, 8 sequences, tool_choice auto read as hermes."""
    with short_tmp_dir() as folder:
        process, port = start_serve(folder, "--model", str(tool_model_dir),
                                    "--served-model-name", TOOL_MODEL, "--kv-cache-memory",
                                    "4MiB", "--max-num-seqs", "8", "--enable-auto-tool-choice",
                                    "--tool-call-parser", "hermes")
        try:
            yield port
        finally:
            assert process.stop() == 0, process.stderr()


@pytest.fixture(scope="session")
def tool_client(tool_server: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{tool_server}/v1", api_key="unused",
                         max_retries=0)
