"""The daemon's settings, each named once: how the TOML file and the command line write it.

`SETTINGS` maps every `DaemonConfig` field to a `Setting`: its kind (how a TOML value and a
flag's argument are read), its --help line and, where argparse should refuse other values, its
choices. The TOML key is the field's name and the flag is `--` and the name with dashes
(`num_blocks = 512`, `--num-blocks 512`); settings_sources.py derives the TOML reader and the
flags from this table alone. The caps on what clients may ask join it from their own table
(`LIMITS`, daemon/service/limits.py: each an integer within its range), as the fields of
`DaemonConfig` repeat `Limits`' fields.

What each setting means is said once, on its `DaemonConfig` field (config.py); an error names
the setting (`ConfigError`, "num_blocks must be positive").
"""

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar, get_args

from pagedkv.daemon.core import PREFIX_HASHES
from pagedkv.daemon.process.model_config import parse_models
from pagedkv.daemon.process.tenant_config import parse_tenants
from pagedkv.daemon.service.limits import LIMITS
from pagedkv.daemon.service.tenants import UNMAPPED_UIDS
from pagedkv.process.log_setup import LOG_FORMATS, LOG_LEVELS
from pagedkv.vocab.geometry import KV_CACHE_DTYPES
from pagedkv.vocab.paths import DAEMON_RUNNER_SOCKET_NAME
from pagedkv.vocab.units import parse_bytes

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is missing, malformed or inconsistent; the message names it."""


def check_setting(convert: Callable[[Any], T], value: Any, key: str) -> T:
    """convert(value), with a ValueError or TypeError turned into a ConfigError naming `key`."""
    try:
        return convert(value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{key}: {exc}") from exc


def _toml_int(value: Any) -> int:
    # bool is an int in Python, but `num_blocks = true` is a mistake.
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"expected an integer, got {value!r}")
    return value


def _toml_str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _toml_path(value: Any) -> Path:
    return Path(_toml_str(value))


def _toml_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def _toml_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _toml_listen(value: Any) -> tuple[str, ...]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise TypeError(f"expected an address or a list of addresses, got {value!r}")
    return tuple(values)


def _toml_bytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"expected bytes as an integer or a string like \"8GiB\", got {value!r}")
    return parse_bytes(value)


def _octal(text: str) -> int:
    return int(text, 8)


class Kind(NamedTuple):
    """How values of one kind are written: as a TOML value, and as a flag."""

    # The TOML value -> the field's type; TypeError or ValueError when it is not of this kind.
    toml: Callable[[Any], Any]
    # argparse's keywords for the flag: the `type` that reads its argument, or its `action`.
    flag: Mapping[str, Any]


INTEGER = Kind(_toml_int, {"type": int})
NUMBER = Kind(_toml_float, {"type": float})
TEXT = Kind(_toml_str, {})
PATH = Kind(_toml_path, {"type": Path})
# An integer or "8GiB" in TOML; "8GiB" or 8589934592 as a flag.
BYTES = Kind(_toml_bytes, {"type": parse_bytes})
# Permission bits: 0o660 in TOML, 660 as a flag.
MODE = Kind(_toml_int, {"type": _octal})
# true/false in TOML; the flag alone turns it on.
SWITCH = Kind(_toml_bool, {"action": "store_true"})
# true/false in TOML; the flag (named --no-...) turns a setting that is on by default off.
OFF_SWITCH = Kind(_toml_bool, {"action": "store_false"})
# One address or a list in TOML; a flag repeated for more (the flags replace the TOML list).
ADDRESSES = Kind(_toml_listen, {"action": "append"})
# [tenants.NAME] tables: TOML only.
TENANT_TABLES = Kind(parse_tenants, {})
# [models.NAME] tables: TOML only.
MODEL_TABLES = Kind(parse_models, {})


class Setting(NamedTuple):
    """One setting: its kind and what --help says of its flag."""

    # How its values are written.
    kind: Kind
    # The flag's --help line, "{default}" replaced by the field's default; None: no flag (a
    # TOML table).
    help: str | None
    # The only values the flag takes (argparse refuses others); None: any.
    choices: tuple[str, ...] | None = None
    # The flag when it is not --NAME (an OFF_SWITCH's --no-...).
    flag: str | None = None


def flag_name(name: str, setting: Setting) -> str:
    """The command-line flag of the setting `name`."""
    return setting.flag or f"--{name.replace('_', '-')}"


# How blocks are handed out (the `allocator` setting): paged, or the contiguous baseline it is
# measured against (demo/contiguous).
AllocatorKind = Literal["paged", "contiguous"]
ALLOCATORS: tuple[AllocatorKind, ...] = get_args(AllocatorKind)
# What the daemon's state does across a restart (the `restore` setting, restart.py).
RestoreMode = Literal["never", "auto"]
RESTORE_MODES: tuple[RestoreMode, ...] = get_args(RestoreMode)


# Every DaemonConfig field (config.py asserts it), in the order --help lists them.
SETTINGS: dict[str, Setting] = {
    "listen": Setting(ADDRESSES, "unix:///path or host:port (TCP needs --auth-token-file); "
                      "repeat for more listeners; default: a unix socket in $RUNTIME_DIRECTORY "
                      "or ./run"),
    "auth_token_file": Setting(PATH, "file holding the bearer token TCP clients send"),
    "block_size": Setting(INTEGER, "token slots per block (power of two; default {default})"),
    "num_blocks": Setting(INTEGER, "pool size in blocks (default {default})"),
    "kv_memory": Setting(BYTES, "pool size in bytes, e.g. 8GiB"),
    "kv_fraction": Setting(NUMBER, "pool size as a fraction of the device's memory"),
    "device": Setting(TEXT, "cpu (shared memory; default) or cuda[:N]"),
    "dtype": Setting(TEXT, "KV dtype: float16, bfloat16, float32 (default: the model's)"),
    "kv_cache_dtype": Setting(TEXT, "auto (the dtype's; default) or fp8 (e4m3, scale 1.0: "
                              "half an fp16 block; vLLM's --kv-cache-dtype)", KV_CACHE_DTYPES),
    "model_config": Setting(TEXT, "built-in model name or local config.json (default: "
                            "{default})"),
    "page_size": Setting(BYTES, "bytes of one page of the pool, e.g. 2MiB: every registered "
                         "model's bytes per block must divide it (default: the model_config's "
                         "bytes per block)"),
    "max_models": Setting(INTEGER, "models runners may register at most (default {default})"),
    "models": Setting(MODEL_TABLES, None),
    "metrics_listen": Setting(TEXT, "host:port for /metrics, /healthz, /readyz over HTTP"),
    "metrics_token_file": Setting(PATH, "file holding the bearer token /metrics asks for"),
    "log_format": Setting(TEXT, "json, console or auto (default)", LOG_FORMATS),
    "log_level": Setting(TEXT, "default: {default}", LOG_LEVELS),
    "lease_ttl_ms": Setting(INTEGER, "default session lease in milliseconds"),
    "enable_prefix_caching": Setting(OFF_SWITCH, "never share blocks between identical prompt "
                                     "prefixes", flag="--no-prefix-caching"),
    "prefix_hash": Setting(TEXT, "hash of the prefix cache's block keys: sha256 (default) or "
                           "xxh3_128 (faster; refused with several tenants unless "
                           "--allow-fast-hash-with-tenants)", PREFIX_HASHES),
    "allow_fast_hash_with_tenants": Setting(SWITCH, "allow prefix_hash xxh3_128 though several "
                                            "tenants share the daemon (they trust each other)"),
    "allocator": Setting(TEXT, "paged (default): blocks taken as sequences grow, shared by forks "
                         "and the prefix cache; contiguous: the baseline paging replaced, for "
                         "comparison: each sequence reserves --max-model-len slots as one run "
                         "of blocks (first fit), forks copy, nothing is cached, and free_blocks "
                         "counts only blocks whole reservations can take; refused with "
                         "page_size, [models.NAME], host_tier_memory and restore = auto",
                         ALLOCATORS),
    "max_model_len": Setting(INTEGER, "tokens each sequence reserves, and the most it may hold "
                             "(required with --allocator contiguous; must fit in the pool)"),
    "zero_freed_blocks": Setting(SWITCH, "zero blocks as they are released"),
    "shm_dir": Setting(PATH, "folder of the CPU pool file (default {default})"),
    "restore": Setting(TEXT, "never (default): start cold after a restart; auto: write the "
                       "sessions and tables at SIGTERM and restore them at the next start on "
                       "the same pool memory", RESTORE_MODES),
    "state_dir": Setting(PATH, "folder of the restart snapshot (default: $STATE_DIRECTORY, "
                         "else ./state)"),
    "crash_log": Setting(OFF_SWITCH, "with --restore auto: keep no crash log (a daemon killed "
                         "by SIGKILL then starts cold)", flag="--no-crash-log"),
    "crash_log_bytes": Setting(BYTES, "bound of the crash log in shm_dir, e.g. 64MiB (default "
                               "{default}): past it a checkpoint starts it again"),
    "host_tier_memory": Setting(BYTES, "host memory for copies of evicted prefix blocks, e.g. "
                                "32GiB (default 0: no host tier)"),
    "kv_events_endpoint": Setting(TEXT, "ZMQ PUB endpoint of KV events in vLLM's format, e.g. "
                                  "tcp://*:5557 (bound; a host name is connected to); default: "
                                  "no events"),
    "kv_events_replay_endpoint": Setting(TEXT, "ZMQ ROUTER endpoint answering replay and "
                                         "snapshot requests, e.g. tcp://*:5558"),
    "kv_events_buffer": Setting(INTEGER, "KV-event batches kept for replay (default {default})"),
    "kv_events_queue": Setting(INTEGER, "KV-event batches waiting to be sent before new ones "
                               "are dropped (default {default})"),
    "kv_events_topic": Setting(TEXT, "topic prefix of KV events: a model's topic is the prefix "
                               "and its name (llm-d: kv@POD@)"),
    "kv_events_all_salts": Setting(SWITCH, "publish blocks of every cache salt, not only of "
                                   "the tenants' public_salts"),
    "socket_mode": Setting(MODE, "octal mode of the public unix sockets (default 660)"),
    "runner_socket": Setting(PATH, "path of the socket runners call through (default: "
                             f"{DAEMON_RUNNER_SOCKET_NAME} beside the first unix listener)"),
    "runner_group": Setting(TEXT, "group of the runner socket and the pool file (default: "
                            "none, only the daemon's user may be a runner)"),
    "tls_cert_file": Setting(PATH, "PEM certificate chain TCP listeners serve TLS with"),
    "tls_key_file": Setting(PATH, "PEM private key of --tls-cert-file"),
    "tls_client_ca_file": Setting(PATH, "PEM CA that TCP clients' certificates must chain to "
                                  "(mutual TLS)"),
    "insecure_tcp": Setting(SWITCH, "allow TCP listeners without TLS (the token is sent in "
                            "clear; a warning is logged)"),
    "tenants": Setting(TENANT_TABLES, None),
    "unix_tenant": Setting(TEXT, "tenant of unix-socket callers (default: {default}); tenants "
                           "are [tenants.NAME] tables of the --config file"),
    "unmapped_uids": Setting(TEXT, "when tenants list uids, a unix caller whose uid none lists "
                             "is refused (default) or is --unix-tenant", UNMAPPED_UIDS),
    **{name: Setting(INTEGER, f"{spec.help} (default {{default}}; "
                              f"{spec.minimum}..{spec.maximum})")
       for name, spec in LIMITS.items()},
}
