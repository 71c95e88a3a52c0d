"""The runtime folder and the socket names every process and the launcher share (vocab/paths.py)."""

from pathlib import Path

import pytest

from pagedkv.llm.services import MAX_FOLDER_CHARS
from pagedkv.model_runner.models import ModelSource
from pagedkv.model_runner.process.server import RunnerConfig
from pagedkv.process.launch import start_runner
from pagedkv.vocab.paths import (
    DAEMON_RUNNER_SOCKET_NAME,
    DAEMON_SOCKET_NAME,
    MAX_UNIX_PATH_BYTES,
    RUNNER_SOCKET_NAME,
    default_daemon_listen,
    default_daemon_runner_socket,
    default_runner_listen,
    runtime_dir,
    socket_target,
)

from pagedkvd_process import short_tmp_dir


def test_systemd_runtime_directory_is_the_first_entry() -> None:
    env = {"RUNTIME_DIRECTORY": "/run/pagedkv:/run/other"}
    assert runtime_dir(env) == Path("/run/pagedkv")
    assert default_daemon_listen(env) == "unix:///run/pagedkv/pagedkvd.sock"
    assert default_daemon_runner_socket(env) == "unix:///run/pagedkv/pagedkvd-runners.sock"
    assert default_runner_listen(env) == "unix:///run/pagedkv/pagedkv-runner.sock"


def test_without_systemd_the_sockets_go_to_run_under_the_current_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    for env in ({}, {"RUNTIME_DIRECTORY": ""}):
        assert runtime_dir(env) == tmp_path / "run"
        assert default_runner_listen(env) == f"unix://{tmp_path}/run/pagedkv-runner.sock"


def test_a_relative_runtime_directory_is_made_absolute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert default_daemon_listen({"RUNTIME_DIRECTORY": "rt"}) == \
        f"unix://{tmp_path}/rt/pagedkvd.sock"


def test_socket_target() -> None:
    assert socket_target(Path("/tmp/d/x.sock")) == "unix:///tmp/d/x.sock"


def test_the_runner_defaults_to_the_shared_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/pagedkv")
    config = RunnerConfig(model=ModelSource(random_init="tiny"))
    assert (config.daemon, config.listen) == ("unix:///run/pagedkv/pagedkvd-runners.sock",
                                              "unix:///run/pagedkv/pagedkv-runner.sock")


def test_the_launcher_names_the_runner_socket_as_the_runner_does() -> None:
    """start_runner's default socket is the runner's own name, in the folder it is given."""
    with short_tmp_dir() as folder, \
            start_runner("unix:///nonexistent", folder, "--random-init", "tiny") as runner:
        assert runner.unix_target == f"unix://{folder}/pagedkv-runner.sock"
        runner.stop()


def test_every_socket_fits_in_the_llms_longest_private_folder() -> None:
    folder = Path("/" + "f" * (MAX_FOLDER_CHARS - 1))
    lengths = [len(str(folder / name)) for name in
               (DAEMON_SOCKET_NAME, DAEMON_RUNNER_SOCKET_NAME, RUNNER_SOCKET_NAME)]
    assert (MAX_FOLDER_CHARS, max(lengths)) == (85, MAX_UNIX_PATH_BYTES)
