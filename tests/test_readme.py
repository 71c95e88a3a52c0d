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
from pagedkvd_process import Pagedkvd, pagedkv_runner, pagedkvd, short_tmp_dir

README = Path(__file__).resolve().parent.parent / "README.md"
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


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_a_readme_example_runs_as_written(services: tuple[Pagedkvd, Pagedkvd], workdir: Path,
                                          index: int) -> None:
    done = subprocess.run([sys.executable, "-c", BLOCKS[index]], cwd=workdir,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip(), "the example printed nothing"
