"""`pagedkv serve`'s command line, without starting anything: the systemd unit's flags parse,
API keys are read as documented, bad flags exit 2 before any process starts."""

import shlex
from pathlib import Path

import pytest

from pagedkv.server.cli import api_keys, main, parser

OPS = Path(__file__).resolve().parents[2] / "ops"


def test_the_unit_runs_flags_the_server_takes() -> None:
    text = (OPS / "pagedkv-server.service").read_text().replace("\\\n", " ")
    exec_start = next(line.partition("=")[2] for line in text.splitlines()
                      if line.startswith("ExecStart="))
    words = shlex.split(exec_start)
    assert words[1:2] == ["serve"]
    args = parser().parse_args(words[2:])
    # The unit uses the daemon and runner of the other two units.
    assert args.daemon == "unix:///run/pagedkv/pagedkvd.sock"
    assert args.runner == "unix:///run/pagedkv-runner/pagedkv-runner.sock"
    unit_lines = text.splitlines()
    assert "RestartPreventExitStatus=2" in unit_lines and "Type=notify" in unit_lines


def test_api_keys_come_from_flags_and_a_file(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# the team's keys\nsk-one\n\n  sk-two  \n")
    args = parser().parse_args(["--model", "tiny", "--api-key", "sk-flag",
                                "--api-key-file", str(keys)])
    assert [key.secret for key in api_keys(args)] == ["sk-flag", "sk-one", "sk-two"]
    keys.write_text("# none\n")
    with pytest.raises(ValueError, match="holds no key"):
        api_keys(args)


def test_the_environments_key_is_added_to_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    args = parser().parse_args(["tiny", "--api-key", "sk-flag"])
    monkeypatch.setenv("PAGEDKV_API_KEY", "sk-env")
    assert [key.secret for key in api_keys(args)] == ["sk-flag", "sk-env"]
    monkeypatch.setenv("PAGEDKV_API_KEY", "")  # set but empty: no key, as vLLM's
    assert [key.secret for key in api_keys(args)] == ["sk-flag"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "/no/such/folder"], "no model at"),
    (["--model", "tiny", "--max-choices", "0"], "--max-choices"),
    (["--model", "tiny", "--runner", "unix:///x"], "give daemon too"),
    (["--model", "tiny", "--api-key-file", "/no/such/keys"], "No such file"),
    (["--model", "tiny", "--host-tier-memory", "lots"], "host_tier_memory: not a byte size"),
    (["--model", "tiny", "--daemon", "unix:///x", "--runner", "unix:///y",
      "--host-tier-memory", "1GiB"], "host_tier_memory sets the daemon and runner LLM starts"),
    (["tiny", "--daemon", "unix:///x", "--runner", "unix:///y", "--no-enable-prefix-caching"],
     "enable_prefix_caching sets the daemon and runner LLM starts"),
    (["tiny", "--max-model-len", "5000"], "max_model_len 5000 exceeds the 4096 positions"),
    (["tiny", "--chat-template", "{{ messages }}"], "--chat-template needs a tokenizer, but the "
                                                    "preset 'tiny'"),
    (["tiny", "--served-model-name", "a", "--served-model-name", "a"],
     "--served-model-name 'a' is given twice"),
    (["a", "--model", "b"], "the model is given twice"),
])
def test_bad_flags_exit_2_before_anything_starts(argv: list[str], message: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err
