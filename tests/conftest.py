"""Suite-wide setup."""

import io
import logging
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

# One compute thread per process, set before torch loads (here and, inherited, in every daemon
# and runner a test starts): `make test` runs a worker per core, so torch's default of a thread
# per core made each worker's small ops fight the other's (a sweep of 144 tiny attention cases
# took 14 s with two threads on two busy cores, 2.4 s with one). Tests check behaviour, not speed.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every step engine (here and in every runner a test starts) checks its sessions' sequence states
# (SeqState's invariants) each time a step lets go of a session's lock.
os.environ.setdefault("PAGEDKV_CHECK_SEQUENCES", "1")

import pytest

# Decide TRITON_INTERPRET before any test module imports triton (transformers imports it too):
# without CUDA, Triton kernels run only under the interpreter.
import pagedkv.model_runner.kernels.triton_env  # noqa: F401
from pagedkv.client import PoolClient, Session
from pagedkv.process.log_setup import configure

from hand_clock import HandClock

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast


@pytest.fixture
def clock() -> HandClock:
    """The daemon's clock, moved by the test (pass it as the service's `clock`)."""
    return HandClock()


@pytest.fixture
def log_lines(restore_root_logger: None) -> io.StringIO:
    """The log as JSON lines (daemons' gates and servers' guards log from their own threads;
    read them with log_capture.events)."""
    stream = io.StringIO()
    configure("info", "json", stream)
    return stream


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    """A bearer token file the daemon accepts (mode 0o600)."""
    path = tmp_path / "token"
    path.write_text("s3cret\n")
    path.chmod(0o600)
    return path


@pytest.fixture
def restore_root_logger() -> Iterator[None]:
    """log_setup.configure() replaces the root logger's handlers; put pytest's back after."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    root.handlers, root.level = handlers, level


@pytest.fixture
async def client(daemon: object) -> AsyncIterator[PoolClient]:
    """A client of the module's `daemon` fixture (anything with a `unix_target`); a module
    that needs another client defines its own."""
    async with await PoolClient.connect(daemon.unix_target) as connected:  # type: ignore[attr-defined]
        yield connected


@pytest.fixture
async def runner_client(daemon: object) -> AsyncIterator[PoolClient]:
    """A client of the `daemon` fixture's runner socket (`runners_target`): what a runner
    uses (the pool memory's handle, any session it is given)."""
    async with await PoolClient.connect(daemon.runners_target) as connected:  # type: ignore[attr-defined]
        yield connected


@pytest.fixture
async def session(client: PoolClient, request: pytest.FixtureRequest) -> AsyncIterator[Session]:
    """A session of `client`, named after the test module, closed after the test."""
    async with await client.open_session(request.module.__name__) as opened:
        yield opened


# A model folder with a tokenizer, for the tests that run a model end to end; a module that needs
# another model (the chat one) defines its own `model_dir`. chat_model is imported in the
# fixtures: it loads transformers, which most test modules never need.
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama and a trained tokenizer whose end-of-sequence token the model reaches
    (chat_model.make_model_dir)."""
    from chat_model import make_model_dir

    folder = tmp_path_factory.mktemp("model")
    make_model_dir(folder)
    return folder


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> "PreTrainedModel":
    """transformers' model of `model_dir`: the tokens the engine must equal."""
    from chat_model import reference_model

    return reference_model(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> "PreTrainedTokenizerFast":
    """`model_dir`'s tokenizer, loaded as users' load."""
    from chat_model import fast_tokenizer

    return fast_tokenizer(model_dir)
