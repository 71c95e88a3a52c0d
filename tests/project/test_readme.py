"""The README's Python examples run as written, against a daemon and a runner started as the
README starts them (`pagedkvd --model-config tiny-llama`, `pagedkv runner --random-init
tiny-llama`, both with their default unix sockets under ./run)."""

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.process.launch import READY_STATE, free_tcp_port, start_process

from pagedkvd_process import Pagedkvd, pagedkv_runner, pagedkvd, short_tmp_dir

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    """Where the README's commands run: its ./run holds both sockets."""
    with short_tmp_dir() as folder:
        (folder / "run").mkdir()
        yield folder


@pytest.fixture(scope="module")
def services(workdir: Path) -> Iterator[tuple[Pagedkvd, Pagedkvd]]:
    run = workdir / "run"
    with pagedkvd("--model-config", "tiny-llama", workdir=run,
                  listen_path=run / "pagedkvd.sock") as daemon, \
            pagedkv_runner(daemon, "--random-init", "tiny-llama",
                           listen=f"unix://{run / 'pagedkv-runner.sock'}") as runner:
        yield daemon, runner


def test_the_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.fixture(scope="module")
def server_url(services: tuple[Pagedkvd, Pagedkvd], workdir: Path) -> Iterator[str]:
    """`pagedkv serve` on the README's daemon and runner, as its sh block starts it (on a free
    port; the Python example reads PAGEDKV_URL)."""
    run, port = workdir / "run", free_tcp_port()
    server = start_process("server", [
        sys.executable, "-m", "pagedkv.cli", "serve", "--model", "tiny-llama", "--port",
        str(port), "--daemon", f"unix://{run / 'pagedkvd.sock'}", "--runner",
        f"unix://{run / 'pagedkv-runner.sock'}", "--log-format", "json"], workdir,
        f"http://127.0.0.1:{port}")
    with server:
        server.wait_for_notification(READY_STATE)
        yield f"http://127.0.0.1:{port}/v1"
        assert server.stop() == 0, server.stderr()


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_example_runs_as_written(services: tuple[Pagedkvd, Pagedkvd], workdir: Path,
                                          server_url: str, index: int) -> None:
    done = subprocess.run([sys.executable, "-c", BLOCKS[index]], cwd=workdir,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PAGEDKV_URL": server_url})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the example printed nothing"
