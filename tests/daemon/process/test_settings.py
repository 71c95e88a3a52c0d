"""DaemonConfig: defaults <- TOML <- flags, and a clear error for every bad setting."""

import os
import re
from dataclasses import fields
from pathlib import Path

import pytest

from pagedkv.daemon.edge.addresses import parse_listen
from pagedkv.daemon.process.cli import EXIT_BAD_CONFIG
from pagedkv.daemon.process.config import DEFAULT_NUM_BLOCKS, DaemonConfig, default_listen
from pagedkv.daemon.process.settings import ConfigError
from pagedkv.daemon.process.settings_sources import load_toml
from pagedkv.process.grpc_server import SHUTDOWN_GRACE_S
from pagedkv.vocab.geometry import resolve_geometry

from daemon_config import parse


def test_no_flags_gives_the_small_cpu_pool_on_a_local_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    config = parse([])
    assert config.listen == (f"unix://{tmp_path}/run/pagedkvd.sock",)
    assert (config.num_blocks, config.kv_memory, config.kv_fraction) == (DEFAULT_NUM_BLOCKS, None,
                                                                         None)
    assert (config.device, config.model_config, config.block_size) == ("cpu", "tiny", 16)
    assert config.enable_prefix_caching and config.metrics_listen is None


def test_systemd_runtime_directory_holds_the_default_socket() -> None:
    assert default_listen({"RUNTIME_DIRECTORY": "/run/pagedkv:/run/other"}) == (
        "unix:///run/pagedkv/pagedkvd.sock",
    )


def test_toml_then_flags_override(tmp_path: Path, token_file: Path) -> None:
    toml = tmp_path / "pagedkv.toml"
    toml.write_text(
        f'listen = ["unix:///tmp/a.sock", "127.0.0.1:7001"]\n'
        f'auth_token_file = "{token_file}"\n'
        'block_size = 32\nkv_memory = "64MiB"\nlog_level = "debug"\n'
        "enable_prefix_caching = false\nlease_ttl_ms = 5000\nrunner_group = \"65534\"\n"
    )
    config = parse(["--config", str(toml), "--block-size", "8", "--listen", "unix:///tmp/b.sock"])
    assert config.block_size == 8  # flag wins
    assert config.listen == ("unix:///tmp/b.sock",)  # a repeated flag replaces the whole list
    assert config.kv_memory == 64 * 2**20 and config.num_blocks is None  # TOML sizing replaced
    assert config.log_level == "debug" and config.lease_ttl_ms == 5000
    assert not config.enable_prefix_caching
    assert config.auth_token_file == token_file
    assert config.runner_gid() == 65534 and config.runners_mode == 0o660
    assert not config.zero_freed_blocks


def test_the_retired_shm_mode_says_what_replaced_it(tmp_path: Path) -> None:
    toml = tmp_path / "pagedkv.toml"
    toml.write_text("shm_mode = 0o660\n")  # it gave the public socket's group every K/V
    with pytest.raises(ConfigError, match=r"shm_mode .* is gone: .*set runner_group"):
        parse(["--config", str(toml)])


def test_a_runner_group_that_is_the_public_sockets_group_is_refused(tmp_path: Path) -> None:
    public = tmp_path / "d.sock"
    own = str(os.getegid())  # the group of a socket made in a folder without set-group-ID
    with pytest.raises(ConfigError, match=r"runner_group \(gid \d+\) is the group of the public "
                                          r"socket .*d\.sock, which socket_mode 0o660 opens"):
        parse(["--listen", f"unix://{public}", "--runner-group", own])
    # Its group shut out of the public socket, or another group for runners: accepted.
    parse(["--listen", f"unix://{public}", "--runner-group", own, "--socket-mode", "600"])
    parse(["--listen", f"unix://{public}", "--runner-group", str(os.getegid() + 1)])


def test_a_set_group_id_folder_gives_the_public_socket_its_group(tmp_path: Path) -> None:
    other = 65534 if os.geteuid() == 0 else next(
        (gid for gid in os.getgroups() if gid != os.getegid()), None)
    if other is None:
        pytest.skip("needs root or a second group to give the folder")
    folder = tmp_path / "run"
    folder.mkdir()
    os.chown(folder, -1, other)
    os.chmod(folder, 0o2770)  # sockets made below it (new folders too) get its group
    with pytest.raises(ConfigError, match=f"runner_group \\(gid {other}\\)"):
        parse(["--listen", f"unix://{folder}/new/d.sock", "--runner-group", str(other)])


def test_octal_socket_mode_and_zeroing_flags() -> None:
    config = parse(["--zero-freed-blocks", "--socket-mode", "600"])
    assert config.zero_freed_blocks and config.socket_mode == 0o600
    assert config.runners_mode == 0o600  # no runner_group: the daemon's user alone


def test_a_sizing_flag_replaces_the_toml_sizing(tmp_path: Path) -> None:
    toml = tmp_path / "pagedkv.toml"
    toml.write_text("kv_fraction = 0.5\n")
    config = parse(["--config", str(toml), "--num-blocks", "64"])
    assert (config.num_blocks, config.kv_memory, config.kv_fraction) == (64, None, None)


def test_flags_not_given_leave_the_toml_values(tmp_path: Path) -> None:
    toml = tmp_path / "pagedkv.toml"
    toml.write_text('enable_prefix_caching = false\ndevice = "cuda:1"\ndtype = "bf16"\n')
    config = parse(["--config", str(toml), "--log-format", "json"])
    assert not config.enable_prefix_caching and config.device == "cuda:1"
    assert config.dtype == "bf16" and config.log_format == "json"


def test_the_allocator_and_its_reservation_from_flags_and_toml(tmp_path: Path) -> None:
    default = parse([])
    assert (default.allocator, default.max_model_len) == ("paged", None)
    config = parse(["--allocator", "contiguous", "--max-model-len", "2048"])
    assert (config.allocator, config.max_model_len) == ("contiguous", 2048)
    toml = tmp_path / "pagedkv.toml"
    toml.write_text('allocator = "contiguous"\nmax_model_len = 512\n')
    config = parse(["--config", str(toml), "--max-model-len", "8192"])
    assert (config.allocator, config.max_model_len) == ("contiguous", 8192)  # flag wins


# A valid contiguous daemon, to which each refused setting is added.
CONTIGUOUS = ["--allocator", "contiguous", "--max-model-len", "64"]


@pytest.mark.parametrize(
    ("toml", "argv", "message"),
    [
        ("", ["--allocator", "contiguous"], "contiguous\" needs max_model_len"),
        ("", ["--max-model-len", "2048"], "paged sequences reserve nothing"),
        ("", ["--allocator", "contiguous", "--max-model-len", "0"],
         "max_model_len must be positive"),
        # The default pool: 512 blocks of 16 slots.
        ("", ["--allocator", "contiguous", "--max-model-len", "8193"],
         "max_model_len 8193 does not fit in the pool: 512 blocks x 16 slots = 8192 slots"),
        ('allocator = "buddy"\n', [], "allocator must be one of paged, contiguous, got 'buddy'"),
        ('allocator = "contiguous"\nmax_model_len = "long"\n', [],
         "max_model_len in .*expected an integer"),
        # What the contiguous baseline cannot do (demo/contiguous's CANNOT), each named.
        ("", [*CONTIGUOUS, "--page-size", "64KiB"], "cannot honour page_size"),
        ('[models.half]\nmin_memory = "64KiB"\n', CONTIGUOUS, "cannot honour models"),
        ("", [*CONTIGUOUS, "--host-tier-memory", "1MiB"], "cannot honour host_tier_memory"),
        ("", [*CONTIGUOUS, "--restore", "auto"], "cannot honour restore"),
        ("", [*CONTIGUOUS, "--restore", "auto", "--host-tier-memory", "1MiB"],
         "cannot honour host_tier_memory .*; restore .*: remove them"),
    ],
)
def test_bad_allocator_settings_are_refused(tmp_path: Path, toml: str, argv: list[str],
                                            message: str) -> None:
    path = tmp_path / "pagedkv.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        parse(["--config", str(path), *argv])


def test_an_unknown_allocator_flag_is_refused_by_the_parser(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(["--allocator", "buddy"])
    assert info.value.code == EXIT_BAD_CONFIG
    assert "invalid choice: 'buddy'" in capsys.readouterr().err


def test_a_reservation_is_checked_against_a_pool_sized_later() -> None:
    # kv_memory and kv_fraction give the block count only at start (server.py checks then).
    config = DaemonConfig(num_blocks=None, kv_memory=2**20, allocator="contiguous",
                          max_model_len=4096)
    config.check_reservation(256)
    with pytest.raises(ConfigError, match="max_model_len 4096 does not fit in the pool"):
        config.check_reservation(255)


def test_tcp_listener_without_token_file_is_refused() -> None:
    with pytest.raises(ConfigError, match="TCP listener needs auth_token_file"):
        parse(["--listen", "127.0.0.1:7001"])


def test_tcp_listener_with_token_file_is_accepted(token_file: Path) -> None:
    config = parse(["--listen", "[::1]:7001", "--auth-token-file", str(token_file),
                    "--insecure-tcp"])
    assert config.insecure_tcp
    (listener,) = config.listeners()
    assert listener.is_tcp and listener.target == "[::1]:7001"


@pytest.mark.parametrize(
    ("content", "mode", "message"),
    [(None, 0o600, "cannot read"), ("", 0o600, "is empty"), ("tok", 0o644, "every user")],
)
def test_unusable_token_files_are_refused(
    tmp_path: Path, content: str | None, mode: int, message: str
) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
        path.chmod(mode)
    with pytest.raises(ConfigError, match=message):
        parse(["--auth-token-file", str(path)])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--block-size", "12"], "power of two"),
        (["--num-blocks", "0"], "num_blocks must be positive"),
        (["--kv-fraction", "1.5"], r"kv_fraction must be in \(0, 1\]"),
        (["--device", "tpu"], "device must be cpu, cuda or cuda:N"),
        (["--device", "cpu:0"], "device must be"),
        (["--dtype", "int4"], "dtype: unknown dtype 'int4'"),
        (["--metrics-listen", "localhost"], "metrics_listen: 'localhost' is not host:port"),
        (["--lease-ttl-ms", "-1"], "lease_ttl_ms must be in 1..600000"),
        (["--lease-ttl-ms", "600001"], "lease_ttl_ms must be in"),
        (["--socket-mode", "440"], "socket_mode must be permission bits including owner rw"),
        (["--socket-mode", "1777"], "socket_mode must be"),
        (["--socket-mode", "777"], "socket_mode 0o777 gives every local user access"),
        (["--runner-group", "no-such-group-here"], "runner_group: no group named"),
        (["--listen", "unix:///tmp/r.sock", "--runner-socket", "/tmp/r.sock"],
         "runner_socket: /tmp/r.sock is also a listen address"),
        (["--shm-dir", "/nonexistent-dir"], "shm_dir: /nonexistent-dir is not a folder"),
        (["--listen", "unix://relative"], "unix:///absolute/path"),
        (["--listen", "unix:///" + "x" * 120], "socket path must be"),
    ],
)
def test_bad_flags_are_refused_with_the_setting_named(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(argv)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ("num_blocks = 1\nkv_memory = 5\n", "num_blocks and kv_memory both given"),
        ("block_size = true\n", "block_size in .*expected an integer"),
        ('kv_memory = "lots"\n', "not a byte size"),
        ("surprise = 1\n", "unknown key.*surprise"),
        ("listen = [1]\n", "expected an address"),
        ("num_blocks = \n", "not valid TOML"),
    ],
)
def test_bad_toml_is_refused(tmp_path: Path, toml: str, message: str) -> None:
    path = tmp_path / "pagedkv.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=message):
        parse(["--config", str(path)])


def test_no_sizing_at_all_is_refused() -> None:
    with pytest.raises(ConfigError, match="exactly one of num_blocks, kv_memory, kv_fraction"):
        DaemonConfig(num_blocks=None)


def test_parse_listen_forms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_listen("unix:rel.sock").unix_path == tmp_path / "rel.sock"
    assert parse_listen("unix:///abs/x.sock").target == "unix:///abs/x.sock"
    assert parse_listen("localhost:80").target == "localhost:80"
    with pytest.raises(ValueError, match="host:port"):
        parse_listen("localhost:99999")


OPS = Path(__file__).parents[3] / "ops"


def test_the_shipped_toml_sets_valid_values_and_documents_every_key() -> None:
    text = (OPS / "pagedkv.toml").read_text()
    config = DaemonConfig(**load_toml(OPS / "pagedkv.toml"))
    assert config.listen == ("unix:///run/pagedkv/pagedkvd.sock",)
    for setting in fields(DaemonConfig):
        # Tables ([tenants.NAME], [models.NAME]) are written as tables.
        tables = ("tenants", "models")
        written = f"[{setting.name}." if setting.name in tables else f"{setting.name} = "
        assert written in text, f"{setting.name} is not in ops/pagedkv.toml"


def test_the_shipped_toml_lays_the_pool_out_for_the_readmes_runner() -> None:
    """The README starts `pagedkvd --config ops/pagedkv.toml` beside `pagedkv runner
    --random-init tiny-llama`: the pool's geometry must be that runner's, or it is refused."""
    readme = (OPS.parent / "README.md").read_text()
    preset = re.search(r"pagedkv runner --random-init (\S+)", readme)
    assert preset is not None and "--config ops/pagedkv.toml" in readme
    config = DaemonConfig(**load_toml(OPS / "pagedkv.toml"))
    assert config.model_config is not None
    assert resolve_geometry(config.model_config) == resolve_geometry(preset.group(1))


def test_the_unit_matches_the_daemon() -> None:
    unit: dict[str, list[str]] = {}
    for line in (OPS / "pagedkvd.service").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            unit.setdefault(key, []).append(value)
    assert unit["Type"] == ["notify"] and unit["NotifyAccess"] == ["main"]
    assert unit["ExecStart"][0].endswith("pagedkvd --config /etc/pagedkv/pagedkv.toml")
    # The TOML's socket is in the unit's RuntimeDirectory, and the drain fits in the stop timeout.
    assert unit["RuntimeDirectory"] == ["pagedkv"]
    assert float(unit["TimeoutStopSec"][0].removesuffix("s")) > SHUTDOWN_GRACE_S + 5
    assert unit["RestartPreventExitStatus"] == [str(EXIT_BAD_CONFIG)]
    assert "char-nvidia* rw" in unit["DeviceAllow"]


def test_the_runner_unit_follows_the_daemon_and_its_exit_codes() -> None:
    text = (OPS / "pagedkv-runner.service").read_text()
    unit: dict[str, list[str]] = {}
    for line in text.replace("\\\n", " ").splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            unit.setdefault(key, []).append(value)
    assert unit["Type"] == ["notify"] and unit["After"] == ["pagedkvd.service"]
    assert "pagedkv runner --model" in unit["ExecStart"][0]
    # The runner calls through the daemon's runner socket, the one ops/pagedkv.toml names.
    assert "--daemon unix:///run/pagedkv/pagedkvd-runners.sock" in unit["ExecStart"][0]
    config = DaemonConfig(**load_toml(OPS / "pagedkv.toml"))
    assert str(config.runner_listener().unix_path) == "/run/pagedkv/pagedkvd-runners.sock"
    assert unit["RestartPreventExitStatus"] == [str(EXIT_BAD_CONFIG)]


@pytest.mark.parametrize(("listen", "open_beyond"), [
    ("127.0.0.1:9464", False), ("[::1]:9464", False), ("localhost:9464", False),
    ("0.0.0.0:9464", True), ("10.1.2.3:9464", True), ("metrics.example:9464", True)])
def test_metrics_beyond_loopback_without_a_token_are_flagged(listen: str,
                                                             open_beyond: bool) -> None:
    assert parse(["--metrics-listen", listen]).metrics_open_beyond_loopback() == open_beyond


def test_a_metrics_token_file_is_read_at_start(tmp_path: Path) -> None:
    token = tmp_path / "metrics.token"
    token.write_text("")
    token.chmod(0o600)
    with pytest.raises(ConfigError, match=r"metrics_token_file: .* is empty"):
        parse(["--metrics-listen", "0.0.0.0:9464", "--metrics-token-file", str(token)])
    token.write_text("t\n")
    config = parse(["--metrics-listen", "0.0.0.0:9464", "--metrics-token-file", str(token)])
    assert config.metrics_token() == "t" and not config.metrics_open_beyond_loopback()
    with pytest.raises(ConfigError, match="metrics_token_file is the token of metrics_listen"):
        parse(["--metrics-token-file", str(token)])
