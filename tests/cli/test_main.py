"""The command lines: `pagedkvd` and `pagedkv daemon|plan|...` dispatch, and bad settings exit 2."""

from pathlib import Path

import pytest

from pagedkv.cli.main import main
from pagedkv.daemon.process.cli import EXIT_BAD_CONFIG, serve_main


def test_pagedkvd_refuses_a_tcp_listener_without_a_token(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert serve_main(["--listen", "127.0.0.1:7001"]) == EXIT_BAD_CONFIG
    assert capsys.readouterr().err.startswith("pagedkvd: error: listen: a TCP listener needs")


def test_pagedkv_daemon_names_itself_in_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["daemon", "--num-blocks", "0"]) == EXIT_BAD_CONFIG
    assert "pagedkv daemon: error: num_blocks must be positive" in capsys.readouterr().err


def test_a_reservation_larger_than_the_sized_pool_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    # 1 MiB of the tiny geometry (32 KiB a block of 16) is 32 blocks: 512 slots.
    argv = ["--kv-memory", "1MiB", "--allocator", "contiguous", "--max-model-len", "513",
            "--shm-dir", str(tmp_path), "--listen", f"unix://{tmp_path}/s.sock"]
    assert serve_main(argv) == EXIT_BAD_CONFIG
    assert "max_model_len 513 does not fit in the pool: 32 blocks" in capsys.readouterr().err


def test_pagedkv_plan_prints_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3.1-8b", "--device-memory", "24GB"]) == 0
    assert "bytes_per_token: 131072 B" in capsys.readouterr().out


def test_a_subcommand_is_required() -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


@pytest.mark.parametrize("command", ["runner", "generate", "serve"])
def test_runner_generate_and_serve_get_the_rest_of_the_line(
    command: str, capsys: pytest.CaptureFixture[str],
) -> None:
    # Their own parsers answer, not the `pagedkv` one (which knows no such flag either).
    with pytest.raises(SystemExit) as info:
        main([command, "--no-such-flag"])
    assert info.value.code == 2
    assert f"usage: pagedkv {command} " in capsys.readouterr().err


def test_pagedkv_serve_is_the_http_server(capsys: pytest.CaptureFixture[str]) -> None:
    # Not the daemon any more (that is `pagedkv daemon`): the server's own command line.
    with pytest.raises(SystemExit) as info:
        main(["serve", "--help"])
    assert info.value.code == 0
    assert "usage: pagedkv serve" in (out := capsys.readouterr().out)
    assert "OpenAI's HTTP API" in out
