"""The daemon's settings: built-in defaults, then a TOML file, then command-line flags.

Every setting has one name: the dataclass field, the TOML key and the flag (`num_blocks` is
`num_blocks = 512` in TOML and `--num-blocks 512` on the command line). The pool is sized by
exactly one of `num_blocks`, `kv_memory` or `kv_fraction`; a layer that names one of them
replaces the choice of the layers below it. All checks run when the config is built, so a bad
setting stops the daemon before it allocates anything, with a message naming the setting.
"""

import argparse
import functools
import grp
import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

from pagedkv.daemon.core import ALLOCATORS, AllocatorKind
from pagedkv.daemon.edge.addresses import ListenAddress, parse_host_port, parse_listen
from pagedkv.daemon.edge.peer_gate import check_gate_paths
from pagedkv.daemon.edge.tls import ServerTls, load_server_tls
from pagedkv.daemon.process.tenant_config import (
    TenantSpec,
    build_tenants,
    check_specs,
    parse_tenants,
)
from pagedkv.daemon.service.limits import LIMITS, Limits
from pagedkv.daemon.service.tenants import DEFAULT_TENANT, UNMAPPED_UIDS, Tenants
from pagedkv.process.log_setup import LOG_FORMATS, LOG_LEVELS, LogFormat
from pagedkv.vocab.geometry import canonical_dtype
from pagedkv.vocab.paths import DAEMON_RUNNER_SOCKET_NAME, default_daemon_listen, runtime_dir
from pagedkv.vocab.units import parse_bytes

# Pool size when nothing is said: 512 blocks of the tiny CPU geometry take 16 MiB.
DEFAULT_NUM_BLOCKS = 512
# Settings that size the pool; at most one per layer, exactly one in the end.
SIZING_KEYS = ("num_blocks", "kv_memory", "kv_fraction")
# Longest lease a session may ask for (longer requests are clamped to it).
MAX_LEASE_TTL_MS = 600_000
# Mode of the daemon's public unix sockets: the owner and its group (the clients) may connect.
DEFAULT_SOCKET_MODE = 0o660
# Mode of the runner socket and of the pool file: the daemon's user, and runner_group if set.
RUNNERS_ONLY_MODE = 0o600
RUNNER_GROUP_MODE = 0o660
# Permission bits for "every local user": refused on the socket and on the pool file.
WORLD_BITS = 0o007
# The limits' defaults (daemon/service/limits.py), for the fields below.
_LIMIT_DEFAULTS = Limits()

T = TypeVar("T")


class ConfigError(ValueError):
    """A setting is missing, malformed or inconsistent; the message names it."""


def default_listen(env: Mapping[str, str]) -> tuple[str, ...]:
    """One unix socket: in systemd's RuntimeDirectory when run as a unit, else in ./run."""
    return (default_daemon_listen(env),)


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Everything `pagedkvd` needs to start, checked on construction."""

    # gRPC listeners: "unix:///path" or "host:port". TCP listeners require auth_token_file,
    # and TLS (tls_cert_file, tls_key_file) or insecure_tcp.
    listen: tuple[str, ...] = field(default_factory=lambda: default_listen(os.environ))
    # File holding the bearer token TCP clients must send; unix sockets rely on file modes.
    auth_token_file: Path | None = None
    # Token slots per block; a power of two because the Triton kernels tile by it.
    block_size: int = 16
    # Pool size in blocks; or derived from kv_memory (bytes) or kv_fraction (of the device).
    num_blocks: int | None = DEFAULT_NUM_BLOCKS
    kv_memory: int | None = None
    kv_fraction: float | None = None
    # Where the pool lives: "cpu" (POSIX shared memory) or "cuda"/"cuda:N" (CUDA IPC).
    device: str = "cpu"
    # KV dtype; None means the model's default dtype.
    dtype: str | None = None
    # Model whose KV geometry shapes the pool: a built-in name or a local config.json path.
    model_config: str = "tiny"
    # host:port of the HTTP server for /metrics, /healthz and /readyz; None: no HTTP server.
    metrics_listen: str | None = None
    # Log output: "json" (journald), "console" (a person), "auto" (console on a terminal).
    log_format: LogFormat = "auto"
    # Lowest level logged: debug, info, warning, error, critical.
    log_level: str = "info"
    # Lease a session gets when it asks for none; a session silent for longer is reclaimed.
    lease_ttl_ms: int = 10_000
    # Reuse the blocks of identical prompt prefixes across sequences.
    enable_prefix_caching: bool = True
    # How blocks are handed out: "paged" (as sequences grow; shared by forks and the prefix
    # cache) or "contiguous" (the baseline paging replaced, for comparison: each sequence
    # reserves max_model_len slots as one run of blocks, first fit; nothing shared or cached).
    allocator: AllocatorKind = "paged"
    # The tokens every sequence reserves, and the most it may hold: required with
    # allocator = "contiguous", refused with "paged" (which reserves nothing).
    max_model_len: int | None = None
    # Zero every block released without committed content (pending ones included), every
    # cached block evicted for a new owner, and what a private-salt session left cached when it
    # ends; committed blocks kept in the prefix cache keep their K/V while they are cached.
    zero_freed_blocks: bool = False
    # Folder of the CPU pool's shared-memory file: a tmpfs (or hugetlbfs) mount. The file is
    # mode 0o600 (the daemon's user), or 0o660 with runner_group as its group.
    shm_dir: Path = Path("/dev/shm")

    # ---- Access: who may connect and as which tenant (modes, TLS, tenants). ----
    # Permission bits of the public unix sockets, whatever the umask: 0o660 lets the daemon's
    # group connect (a unix caller needs no token, so this mode is the access control).
    socket_mode: int = DEFAULT_SOCKET_MODE
    # The socket runners call through (they alone get the pool memory, may name any session
    # and commit under any salt); None: pagedkvd-runners.sock beside the first unix listener,
    # else in $RUNTIME_DIRECTORY or ./run. Mode 0o600 (the daemon's user), 0o660 with
    # runner_group.
    runner_socket: Path | None = None
    # Group (name or gid) of the runner socket and the pool file, whose members may act as
    # runners and map every tenant's K/V; None: only the daemon's user.
    runner_group: str | None = None
    # PEM certificate chain and private key TCP listeners serve TLS with (both or neither).
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    # PEM CA bundle: TCP clients must present a certificate it signed (mutual TLS).
    tls_client_ca_file: Path | None = None
    # Serve TCP without TLS (the token in clear): refused unless set; a warning at start.
    insecure_tcp: bool = False
    # Tenants ([tenants.NAME] tables): token file, limits and cache salts of each; the
    # auth_token_file above is the "default" tenant's token.
    tenants: tuple[TenantSpec, ...] = ()
    # The tenant of unix-socket callers when no tenant lists uids, and of unmapped uids with
    # unmapped_uids = "unix_tenant".
    unix_tenant: str = DEFAULT_TENANT
    # When tenants list uids: a unix caller whose uid none lists is "refuse"d
    # (PERMISSION_DENIED) or is "unix_tenant".
    unmapped_uids: str = "refuse"
    # ---- Limits on what clients may ask: one field per cap of daemon/service/limits.py, same name,
    # same TOML key, flag --max-...; each within its range (LIMITS). ops/OPERATIONS.md, "Limits".
    # Live sessions at once.
    max_sessions: int = _LIMIT_DEFAULTS.max_sessions
    # Live sequences in one session.
    max_seqs_per_session: int = _LIMIT_DEFAULTS.max_seqs_per_session
    # Block-table entries one session may hold (the quota of a session asking for none or more).
    max_blocks_per_session: int = _LIMIT_DEFAULTS.max_blocks_per_session
    # Ops in one Batch; Step entries in one StepMany; seq ids in one Step, Commit or
    # GetBlockTables; tokens one op adds.
    max_batch_ops: int = _LIMIT_DEFAULTS.max_batch_ops
    max_steps_per_call: int = _LIMIT_DEFAULTS.max_steps_per_call
    max_seq_ids: int = _LIMIT_DEFAULTS.max_seq_ids
    max_tokens: int = _LIMIT_DEFAULTS.max_tokens
    # Bytes of an OpenSession client_name and cache_salt, and of any request's session_id.
    max_client_name_bytes: int = _LIMIT_DEFAULTS.max_client_name_bytes
    max_cache_salt_bytes: int = _LIMIT_DEFAULTS.max_cache_salt_bytes
    max_session_id_bytes: int = _LIMIT_DEFAULTS.max_session_id_bytes
    # Milliseconds one runner call may hold a session (kvpool.proto's "Runner holds").
    max_hold_ms: int = _LIMIT_DEFAULTS.max_hold_ms
    # Encoded bytes of one answer (by default under gRPC's default 4 MiB receive limit; at most
    # the 8 MiB message size the bundled client accepts).
    max_answer_bytes: int = _LIMIT_DEFAULTS.max_answer_bytes
    # Items one call names or adds (ops, seq ids, blocks of new tokens).
    max_call_work: int = _LIMIT_DEFAULTS.max_call_work
    # Wire bytes of the large requests parsed and not yet answered; one more waits, unparsed.
    max_queued_request_bytes: int = _LIMIT_DEFAULTS.max_queued_request_bytes
    # Calls each gRPC server serves at once (one more: RESOURCE_EXHAUSTED from gRPC); a silent
    # connection's keepalive ping and its answer's timeout; a connection without calls closed.
    max_concurrent_rpcs: int = _LIMIT_DEFAULTS.max_concurrent_rpcs
    keepalive_time_ms: int = _LIMIT_DEFAULTS.keepalive_time_ms
    keepalive_timeout_ms: int = _LIMIT_DEFAULTS.keepalive_timeout_ms
    max_connection_idle_ms: int = _LIMIT_DEFAULTS.max_connection_idle_ms
    # Unix-socket connections open at once through the peer-credential gate (tenants' uids).
    max_unix_connections: int = _LIMIT_DEFAULTS.max_unix_connections
    # Of those, connections one uid may hold at once; and how long one may pass no byte.
    max_unix_connections_per_uid: int = _LIMIT_DEFAULTS.max_unix_connections_per_uid
    max_unix_connection_idle_ms: int = _LIMIT_DEFAULTS.max_unix_connection_idle_ms

    def limits(self) -> Limits:
        """The caps above, as the service takes them."""
        return Limits(**{name: getattr(self, name) for name in LIMITS})
    # ---- end of limits

    def __post_init__(self) -> None:
        self._check_access()
        self._check_pool()
        self._check_service()
        self._check_modes()
        self._check_tls()
        _check(lambda _: self.limits(), None, "limits")

    def _check_access(self) -> None:
        """Listeners parse, and TCP ones come with a usable token; the tenants are usable; the
        runner socket is none of the listeners and its group exists."""
        listeners = self.listeners()
        runner = self.runner_listener()
        if any(lst.unix_path == runner.unix_path for lst in listeners):
            raise ConfigError(f"runner_socket: {runner.unix_path} is also a listen address; "
                              "runners need a socket of their own")
        self.runner_gid()
        tenants = self.build_tenants()
        if any(lst.is_tcp for lst in listeners) and not tenants.any_token:
            raise ConfigError("listen: a TCP listener needs auth_token_file (--auth-token-file) "
                              "or a tenant with a token_file: without one anyone who can reach "
                              "the port could free your blocks")
        if tenants.maps_uids:
            for listener in listeners:
                if listener.unix_path is not None:
                    _check(check_gate_paths, listener.unix_path, "listen")

    def runner_listener(self) -> ListenAddress:
        """The runner socket (see the field)."""
        if self.runner_socket is not None:
            return _check(parse_listen, f"unix://{self.runner_socket.absolute()}",
                          "runner_socket")
        folder = next((lst.unix_path.parent for lst in self.listeners()
                       if lst.unix_path is not None), None)
        path = (folder or runtime_dir(os.environ)) / DAEMON_RUNNER_SOCKET_NAME
        return _check(parse_listen, f"unix://{path}", "runner_socket")

    def runner_gid(self) -> int | None:
        """The gid of runner_group; None without one."""
        if self.runner_group is None:
            return None
        if self.runner_group.isdigit():
            return int(self.runner_group)
        try:
            return grp.getgrnam(self.runner_group).gr_gid
        except KeyError:
            raise ConfigError(f"runner_group: no group named {self.runner_group!r}") from None

    @property
    def runners_mode(self) -> int:
        """Mode of the runner socket and the pool file."""
        return RUNNERS_ONLY_MODE if self.runner_group is None else RUNNER_GROUP_MODE

    def tenant_specs(self) -> tuple[TenantSpec, ...]:
        """The configured tenants, with auth_token_file as the "default" tenant's token."""
        if self.auth_token_file is None:
            return self.tenants
        if any(spec.name == DEFAULT_TENANT for spec in self.tenants):
            raise ConfigError("auth_token_file is the default tenant's token: give it there or "
                              "as [tenants.default] token_file, not both")
        return (*self.tenants, TenantSpec(DEFAULT_TENANT, token_file=self.auth_token_file))

    def _token_key(self, spec: TenantSpec) -> str:
        """The setting that names a tenant's token file, for error messages."""
        if spec.name == DEFAULT_TENANT and spec.token_file == self.auth_token_file:
            return "auth_token_file"
        return f"tenants.{spec.name}.token_file"

    def build_tenants(self) -> Tenants:
        """The run-time tenants, their tokens read from their files."""
        specs = self.tenant_specs()
        try:
            check_specs(specs, self.unix_tenant, self.unmapped_uids)
            tokens = {spec.name: read_auth_token(spec.token_file, self._token_key(spec))
                      for spec in specs if spec.token_file is not None}
            return build_tenants(specs, self.unix_tenant, self.unmapped_uids, tokens)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    def _check_pool(self) -> None:
        """Block size, exactly one pool size, device, dtype and the shm file's place."""
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        chosen = [key for key in SIZING_KEYS if getattr(self, key) is not None]
        if len(chosen) != 1:
            raise ConfigError(f"size the pool with exactly one of {', '.join(SIZING_KEYS)}; "
                              f"got {', '.join(chosen) or 'none'}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ConfigError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_memory is not None and self.kv_memory <= 0:
            raise ConfigError(f"kv_memory must be positive, got {self.kv_memory}")
        if self.kv_fraction is not None and not 0 < self.kv_fraction <= 1:
            raise ConfigError(f"kv_fraction must be in (0, 1], got {self.kv_fraction}")
        device, _, index = self.device.partition(":")
        if device not in ("cpu", "cuda") or (index and (device != "cuda" or not index.isdigit())):
            raise ConfigError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype is not None:
            _check(canonical_dtype, self.dtype, "dtype")
        if not self.shm_dir.is_dir():
            raise ConfigError(f"shm_dir: {self.shm_dir} is not a folder")
        self._check_allocator()

    def _check_allocator(self) -> None:
        """A known allocator; max_model_len exactly when contiguous, and fitting the pool when
        its size is known here (else `check_reservation` runs once it is)."""
        if self.allocator not in ALLOCATORS:
            raise ConfigError(f"allocator must be one of {', '.join(ALLOCATORS)}, "
                              f"got {self.allocator!r}")
        if self.allocator == "paged":
            if self.max_model_len is not None:
                raise ConfigError("max_model_len is what each sequence reserves with allocator "
                                  "= \"contiguous\"; paged sequences reserve nothing: remove "
                                  "it, or set allocator = \"contiguous\"")
            return
        if self.max_model_len is None:
            raise ConfigError("allocator = \"contiguous\" needs max_model_len "
                              "(--max-model-len): the tokens every sequence reserves")
        if self.max_model_len <= 0:
            raise ConfigError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.num_blocks is not None:
            self.check_reservation(self.num_blocks)

    def check_reservation(self, num_blocks: int) -> None:
        """A contiguous reservation of max_model_len slots fits in a pool of `num_blocks`."""
        if self.max_model_len is not None and self.max_model_len > num_blocks * self.block_size:
            raise ConfigError(f"max_model_len {self.max_model_len} does not fit in the pool: "
                              f"{num_blocks} blocks x {self.block_size} slots = "
                              f"{num_blocks * self.block_size} slots")

    def _check_service(self) -> None:
        """Metrics address, logging and leases."""
        if self.metrics_listen is not None:
            _check(parse_host_port, self.metrics_listen, "metrics_listen")
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be one of {', '.join(LOG_FORMATS)}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        if not 0 < self.lease_ttl_ms <= MAX_LEASE_TTL_MS:
            raise ConfigError(f"lease_ttl_ms must be in 1..{MAX_LEASE_TTL_MS}, "
                              f"got {self.lease_ttl_ms}")

    def _check_modes(self) -> None:
        """The public sockets: owner rw, and nothing for every other user."""
        mode = self.socket_mode
        if mode & ~0o777 or mode & 0o600 != 0o600:
            raise ConfigError(f"socket_mode must be permission bits including owner rw (0o600), "
                              f"got {oct(mode)}")
        if mode & WORLD_BITS:
            raise ConfigError(f"socket_mode {oct(mode)} gives every local user access (calls "
                              "with no token); use 0o660 and a group")

    def _check_tls(self) -> None:
        """TLS files come as a pair and are usable; TCP listeners use TLS or say they do not."""
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("tls_cert_file and tls_key_file go together: give both or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ConfigError("tls_client_ca_file (mutual TLS) needs tls_cert_file and "
                              "tls_key_file")
        self.server_tls()
        tcp = any(lst.is_tcp for lst in self.listeners())
        if tcp and self.tls_cert_file is None and not self.insecure_tcp:
            raise ConfigError("listen: a TCP listener needs TLS (tls_cert_file and tls_key_file) "
                              "or insecure_tcp = true (--insecure-tcp): without TLS the bearer "
                              "token crosses the network in clear")

    def server_tls(self) -> ServerTls | None:
        """The TLS material of TCP listeners, read from the files; None without TLS."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        try:
            return load_server_tls(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc

    def listeners(self) -> list[ListenAddress]:
        """The parsed listen addresses."""
        if not self.listen:
            raise ConfigError("listen: at least one address is needed")
        return [_check(parse_listen, text, "listen") for text in self.listen]


def read_auth_token(path: Path, key: str = "auth_token_file") -> str:
    """The token in `path` (surrounding whitespace dropped); ConfigError naming the setting
    `key` if unusable."""
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror}") from exc
    if not token:
        raise ConfigError(f"{key}: {path} is empty")
    if path.stat().st_mode & 0o004:
        raise ConfigError(f"{key}: {path} is readable by every user; chmod o-r it")
    return token


def _check(convert: Callable[[Any], T], value: Any, key: str) -> T:
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


def _toml_bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def _toml_float(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)


def _octal(text: str) -> int:
    return int(text, 8)


def _toml_listen(value: Any) -> tuple[str, ...]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise TypeError(f"expected an address or a list of addresses, got {value!r}")
    return tuple(values)


def _toml_bytes(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"expected bytes as an integer or a string like \"8GiB\", got {value!r}")
    return parse_bytes(value)


# TOML key -> converter from the TOML value to the field's type (ValueError/TypeError if wrong).
_TOML_KEYS: dict[str, Callable[[Any], Any]] = {
    "listen": _toml_listen,
    "auth_token_file": lambda v: Path(_toml_str(v)),
    "block_size": _toml_int,
    "num_blocks": _toml_int,
    "kv_memory": _toml_bytes,
    "kv_fraction": _toml_float,
    "device": _toml_str,
    "dtype": _toml_str,
    "model_config": _toml_str,
    "metrics_listen": _toml_str,
    "log_format": _toml_str,
    "log_level": _toml_str,
    "lease_ttl_ms": _toml_int,
    "enable_prefix_caching": _toml_bool,
    "allocator": _toml_str,
    "max_model_len": _toml_int,
    "zero_freed_blocks": _toml_bool,
    "shm_dir": lambda v: Path(_toml_str(v)),
    "socket_mode": _toml_int,
    "runner_socket": lambda v: Path(_toml_str(v)),
    "runner_group": _toml_str,
    "tls_cert_file": lambda v: Path(_toml_str(v)),
    "tls_key_file": lambda v: Path(_toml_str(v)),
    "tls_client_ca_file": lambda v: Path(_toml_str(v)),
    "insecure_tcp": _toml_bool,
    "tenants": parse_tenants,
    "unix_tenant": _toml_str,
    "unmapped_uids": _toml_str,
    **dict.fromkeys(LIMITS, _toml_int),
}
assert set(_TOML_KEYS) == {f.name for f in fields(DaemonConfig)}, "a setting has no TOML key"


def load_toml(path: Path) -> dict[str, Any]:
    """The settings in a TOML file, converted to the fields' types."""
    try:
        with path.open("rb") as file:
            raw = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"config: cannot read {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config: {path} is not valid TOML: {exc}") from exc
    if "shm_mode" in raw:
        raise ConfigError(f"config: shm_mode in {path} is gone: the pool file is mode 0o600, or "
                          "0o660 for runner_group alone (set runner_group to share it with "
                          "runners of another user)")
    unknown = sorted(set(raw) - set(_TOML_KEYS))
    if unknown:
        raise ConfigError(f"config: unknown key(s) {', '.join(unknown)} in {path}; "
                          f"known: {', '.join(_TOML_KEYS)}")
    return {key: _check(_TOML_KEYS[key], value, f"{key} in {path}") for key, value in raw.items()}


def merge_layers(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers override earlier ones; a layer that sizes the pool replaces the sizing."""
    merged: dict[str, Any] = {}
    for layer in layers:
        sizing = [key for key in SIZING_KEYS if key in layer]
        if len(sizing) > 1:
            raise ConfigError(f"{' and '.join(sizing)} both given; size the pool with one")
        if sizing:
            merged.update(dict.fromkeys(SIZING_KEYS))
        merged.update(layer)
    return merged


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `pagedkvd` / `pagedkv serve`; each overrides the TOML key of the same name."""
    add = parser.add_argument
    add("--config", type=Path, help="TOML file with any of the settings below")
    flags = parser.add_argument_group("settings (override the TOML file)")
    # SUPPRESS: a flag not given leaves no attribute, so it cannot override the TOML file.
    opt = functools.partial(flags.add_argument, default=argparse.SUPPRESS)
    opt("--listen", action="append", help="unix:///path or host:port (TCP needs "
        "--auth-token-file); repeat for more listeners; default: a unix socket in "
        "$RUNTIME_DIRECTORY or ./run")
    opt("--auth-token-file", type=Path, help="file holding the bearer token TCP clients send")
    opt("--block-size", type=int, help="token slots per block (power of two; default 16)")
    opt("--num-blocks", type=int, help=f"pool size in blocks (default {DEFAULT_NUM_BLOCKS})")
    opt("--kv-memory", type=parse_bytes, help="pool size in bytes, e.g. 8GiB")
    opt("--kv-fraction", type=float, help="pool size as a fraction of the device's memory")
    opt("--device", help="cpu (shared memory; default) or cuda[:N]")
    opt("--dtype", help="KV dtype: float16, bfloat16, float32 (default: the model's)")
    opt("--model-config", help="built-in model name or local config.json (default: tiny)")
    opt("--metrics-listen", help="host:port for /metrics, /healthz, /readyz over HTTP")
    opt("--log-format", choices=LOG_FORMATS, help="json, console or auto (default)")
    opt("--log-level", choices=LOG_LEVELS, help="default: info")
    opt("--lease-ttl-ms", type=int, help="default session lease in milliseconds")
    opt("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
        help="never share blocks between identical prompt prefixes")
    opt("--allocator", choices=ALLOCATORS, help="paged (default): blocks taken as sequences "
        "grow, shared by forks and the prefix cache; contiguous: the baseline paging replaced, "
        "for comparison: each sequence reserves --max-model-len slots as one run of blocks "
        "(first fit), forks copy, nothing is cached, and free_blocks counts only blocks whole "
        "reservations can take")
    opt("--max-model-len", type=int, help="tokens each sequence reserves, and the most it may "
        "hold (required with --allocator contiguous; must fit in the pool)")
    opt("--zero-freed-blocks", action="store_true", help="zero blocks as they are released")
    opt("--shm-dir", type=Path, help="folder of the CPU pool file (default /dev/shm)")
    opt("--socket-mode", type=_octal, help="octal mode of the public unix sockets (default 660)")
    opt("--runner-socket", type=Path, help="path of the socket runners call through (default: "
        f"{DAEMON_RUNNER_SOCKET_NAME} beside the first unix listener)")
    opt("--runner-group", help="group of the runner socket and the pool file (default: none, "
        "only the daemon's user may be a runner)")
    opt("--tls-cert-file", type=Path, help="PEM certificate chain TCP listeners serve TLS with")
    opt("--tls-key-file", type=Path, help="PEM private key of --tls-cert-file")
    opt("--tls-client-ca-file", type=Path, help="PEM CA that TCP clients' certificates must "
        "chain to (mutual TLS)")
    opt("--insecure-tcp", action="store_true", help="allow TCP listeners without TLS (the "
        "token is sent in clear; a warning is logged)")
    opt("--unix-tenant", help="tenant of unix-socket callers (default: default); tenants are "
        "[tenants.NAME] tables of the --config file")
    opt("--unmapped-uids", choices=UNMAPPED_UIDS, help="when tenants list uids, a unix caller "
        "whose uid none lists is refused (default) or is --unix-tenant")
    limits = parser.add_argument_group("limits on what clients may ask (override the TOML file)")
    for name, spec in LIMITS.items():
        limits.add_argument(f"--{name.replace('_', '-')}", type=int, default=argparse.SUPPRESS,
                            help=f"{spec.help} (default {getattr(_LIMIT_DEFAULTS, name)}; "
                                 f"{spec.minimum}..{spec.maximum})")


def config_from_args(
    args: argparse.Namespace, env: Mapping[str, str] | None = None
) -> DaemonConfig:
    """Defaults <- the --config TOML file <- the flags given."""
    names = {f.name for f in fields(DaemonConfig)}
    flags = {key: value for key, value in vars(args).items() if key in names}
    if "listen" in flags:
        flags["listen"] = tuple(flags["listen"])
    toml = load_toml(args.config) if getattr(args, "config", None) is not None else {}
    defaults = {"listen": default_listen(os.environ if env is None else env)}
    return DaemonConfig(**merge_layers(defaults, toml, flags))
