"""The daemon's settings, checked: `DaemonConfig` says what each one means (a comment per field)
and refuses a bad value or combination when it is built.

Settings come from built-in defaults, then a TOML file, then command-line flags
(settings_sources.py). Each is named once in `SETTINGS` (settings.py), from which the TOML key
and the flag of the same name are derived (`num_blocks = 512` in TOML, `--num-blocks 512` on
the command line). The pool is sized by exactly one of `num_blocks`, `kv_memory` or
`kv_fraction`. All checks run when the config is built, so a bad setting stops the daemon
before it allocates anything, with a message naming the setting (`ConfigError`).
"""

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

from pagedkv.daemon.core import PREFIX_HASHES, PrefixHash
from pagedkv.daemon.edge.addresses import ListenAddress, parse_host_port, parse_listen
from pagedkv.daemon.edge.peer_gate import check_gate_paths
from pagedkv.daemon.edge.tls import ServerTls
from pagedkv.daemon.process.access_settings import (
    check_runner_group,
    check_socket_mode,
    group_id,
    load_tenants,
    load_tls,
    read_auth_token,
)
from pagedkv.daemon.process.settings import (
    ALLOCATORS,
    RESTORE_MODES,
    SETTINGS,
    AllocatorKind,
    ConfigError,
    RestoreMode,
    check_setting,
)
from pagedkv.daemon.process.tenant_config import TenantSpec
from pagedkv.daemon.service.limits import LIMITS, Limits
from pagedkv.daemon.service.models import DEFAULT_MAX_MODELS, ModelPolicy
from pagedkv.daemon.service.tenants import DEFAULT_TENANT, Tenants
from pagedkv.demo.contiguous import CANNOT
from pagedkv.process.log_setup import LOG_FORMATS, LOG_LEVELS, LogFormat
from pagedkv.vocab.geometry import cache_dtype, model_dtype
from pagedkv.vocab.paths import DAEMON_RUNNER_SOCKET_NAME, default_daemon_listen, runtime_dir

# Pool size when nothing is said: 512 blocks of the tiny CPU geometry take 16 MiB.
DEFAULT_NUM_BLOCKS = 512
# Settings that size the pool; at most one per layer, exactly one in the end.
SIZING_KEYS = ("num_blocks", "kv_memory", "kv_fraction")
# Longest lease a session may ask for (longer requests are clamped to it).
MAX_LEASE_TTL_MS = 600_000
# Bounds of crash_log_bytes: one checkpoint must fit with room for records; it lives in tmpfs.
MIN_CRASH_LOG_BYTES, MAX_CRASH_LOG_BYTES = 1 << 20, 16 << 30
# Mode of the daemon's public unix sockets: the owner and its group (the clients) may connect.
DEFAULT_SOCKET_MODE = 0o660
# Mode of the runner socket and of the pool file: the daemon's user, and runner_group if set.
RUNNERS_ONLY_MODE = 0o600
RUNNER_GROUP_MODE = 0o660
# ZMQ transports a KV-events endpoint may use, and the most batches it may buffer or queue.
EVENT_TRANSPORTS = ("tcp://", "ipc://", "inproc://")
MAX_EVENT_BATCHES = 10_000_000
# The limits' defaults (daemon/service/limits.py), for the fields below.
_LIMIT_DEFAULTS = Limits()


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
    # The model's dtype; None means its config's.
    dtype: str | None = None
    # The pool's element (vLLM's --kv-cache-dtype): "auto" stores K/V in `dtype`, "fp8" (or
    # "fp8_e4m3") in fp8 e4m3 (vocab/geometry.py, FP8_DTYPE).
    kv_cache_dtype: str = "auto"
    # Model whose KV geometry shapes the pool: a built-in name or a local config.json path.
    model_config: str = "tiny"
    # Bytes of one page of the pool memory (kvpool.proto, "Models and pages"): a multiple of
    # every registered model's bytes per block; None: model_config's bytes per block (one
    # block a page: a one-model daemon as before models). The pool is its size in whole pages.
    page_size: int | None = None
    # Models runners may register at most (the daemon's own included); more: LimitExceeded.
    max_models: int = DEFAULT_MAX_MODELS
    # [models.NAME] tables: each model's min_memory (reserved) and max_memory (cap), bytes.
    models: tuple[tuple[str, ModelPolicy], ...] = ()
    # host:port of the HTTP server for /metrics, /healthz and /readyz; None: no HTTP server.
    metrics_listen: str | None = None
    # File holding the bearer token /metrics asks for (it names tenants); None: no token, and
    # a warning at start when metrics_listen is not a loopback address.
    metrics_token_file: Path | None = None
    # Log output: "json" (journald), "console" (a person), "auto" (console on a terminal).
    log_format: LogFormat = "auto"
    # Lowest level logged: debug, info, warning, error, critical.
    log_level: str = "info"
    # Lease a session gets when it asks for none; a session silent for longer is reclaimed.
    lease_ttl_ms: int = 10_000
    # Reuse the blocks of identical prompt prefixes across sequences.
    enable_prefix_caching: bool = True
    # Hash of the prefix cache's block keys (daemon/core/content_keys.py): "sha256", or
    # "xxh3_128" (cheaper, not collision-resistant against crafted token ids; needs the xxhash
    # package). Both share the same blocks.
    prefix_hash: PrefixHash = "sha256"
    # Allow prefix_hash = "xxh3_128" though several tenants share the daemon: the operator says
    # they trust each other not to craft colliding blocks. Refused without it.
    allow_fast_hash_with_tenants: bool = False
    # How blocks are handed out: "paged" (as sequences grow; shared by forks and the prefix
    # cache) or "contiguous" (the baseline paging replaced, for comparison: each sequence
    # reserves max_model_len slots as one run of blocks, first fit; nothing shared or cached;
    # the settings it cannot honour, demo/contiguous's CANNOT, are refused with it).
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

    # What the daemon's sessions and tables do across a restart (daemon/process/restart.py):
    # "never" (the default): the next daemon starts cold; "auto": a daemon that stops on
    # SIGTERM writes a snapshot of them into state_dir, and the next one restores it when it
    # maps the same pool memory (handed over through systemd's fd store), else starts cold.
    restore: RestoreMode = "never"
    # Folder of the snapshot, the daemon's own (mode 0700); None: $STATE_DIRECTORY under
    # systemd, else ./state.
    state_dir: Path | None = None
    # With restore = "auto": log every applied change into shm_dir (daemon/service/crash_log.py)
    # so that a daemon killed by SIGKILL comes back with them (daemon/process/crash_restore.py);
    # False: a crash starts cold. restore = "never" keeps nothing across a restart, this log
    # included.
    crash_log: bool = True
    # The crash log's bound in bytes: past it, a checkpoint (the state's image) starts it again.
    crash_log_bytes: int = 64 << 20

    # ---- The host-memory tier (kvpool.proto, "The host-memory tier"): bytes of host memory
    # holding copies of committed blocks the pool evicts; 0: no tier (the default).
    host_tier_memory: int = 0

    # ---- KV events in vLLM's wire format (daemon/events/; ops/OPERATIONS.md, "KV events").
    # ZMQ PUB endpoint; None or "": no events (the default). Bound when it has "*" or "::" or
    # is ipc:// or inproc://, else connected, as vLLM does ("tcp://*:5557" binds; with
    # "tcp://indexer:5557" the daemon connects to a subscriber that binds, as llm-d's does).
    kv_events_endpoint: str | None = None
    # ZMQ ROUTER endpoint (bound) answering replay requests and snapshots; None: neither.
    kv_events_replay_endpoint: str | None = None
    # Batches kept for replay (vLLM's buffer_steps).
    kv_events_buffer: int = 10_000
    # Batches waiting for the sending thread before new ones are dropped (each model that lost
    # one then gets an AllBlocksCleared: its subscribers resync by snapshot).
    kv_events_queue: int = 100_000
    # Topic prefix: a model's batches go on the topic prefix + model name (llm-d reads the pod
    # and the model from "kv@POD@MODEL": set "kv@POD@").
    kv_events_topic: str = ""
    # Publish the blocks of every cache salt, their namespace in extra_keys; default: only
    # blocks under a salt the tenants mark public_salts (the stream has no authentication).
    kv_events_all_salts: bool = False

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
    # Slots one Step may reserve ahead of each sequence's tokens (StepRequest.reserve_tokens).
    max_reserve_tokens: int = _LIMIT_DEFAULTS.max_reserve_tokens
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
        self._check_events()
        check_socket_mode(self.socket_mode)
        self._check_tls()
        check_setting(lambda _: self.limits(), None, "limits")

    def _check_access(self) -> None:
        """Listeners parse, and TCP ones come with a usable token; the tenants are usable; the
        runner socket is none of the listeners and its group exists and is no public socket's."""
        listeners = self.listeners()
        runner = self.runner_listener()
        if any(lst.unix_path == runner.unix_path for lst in listeners):
            raise ConfigError(f"runner_socket: {runner.unix_path} is also a listen address; "
                              "runners need a socket of their own")
        check_runner_group(self.runner_gid(), (lst.unix_path for lst in listeners
                                               if lst.unix_path is not None), self.socket_mode)
        tenants = self.build_tenants()
        self._check_prefix_hash(tenants)
        if any(lst.is_tcp for lst in listeners) and not tenants.any_token:
            raise ConfigError("listen: a TCP listener needs auth_token_file (--auth-token-file) "
                              "or a tenant with a token_file: without one anyone who can reach "
                              "the port could free your blocks")
        if tenants.maps_uids:
            for listener in listeners:
                if listener.unix_path is not None:
                    check_setting(check_gate_paths, listener.unix_path, "listen")

    def _check_prefix_hash(self, tenants: Tenants) -> None:
        """A known hash; xxh3_128 only for one tenant, or with the operator's say-so."""
        if self.prefix_hash not in PREFIX_HASHES:
            raise ConfigError(f"prefix_hash must be one of {', '.join(PREFIX_HASHES)}, "
                              f"got {self.prefix_hash!r}")
        several = tenants.sharing()
        if self.prefix_hash != "sha256" and len(several) > 1 \
                and not self.allow_fast_hash_with_tenants:
            raise ConfigError(
                f"prefix_hash = \"{self.prefix_hash}\" with tenants {', '.join(sorted(several))} "
                "sharing this daemon: a non-cryptographic block key lets one tenant choose token "
                "ids whose blocks collide with another's cached K/V; use prefix_hash = "
                "\"sha256\", or set allow_fast_hash_with_tenants = true "
                "(--allow-fast-hash-with-tenants) if they trust each other")

    def runner_listener(self) -> ListenAddress:
        """The runner socket (see the field)."""
        if self.runner_socket is not None:
            return check_setting(parse_listen, f"unix://{self.runner_socket.absolute()}",
                                 "runner_socket")
        folder = next((lst.unix_path.parent for lst in self.listeners()
                       if lst.unix_path is not None), None)
        path = (folder or runtime_dir(os.environ)) / DAEMON_RUNNER_SOCKET_NAME
        return check_setting(parse_listen, f"unix://{path}", "runner_socket")

    def metrics_token(self) -> str | None:
        """The token /metrics asks for, read from metrics_token_file; None without one."""
        if self.metrics_token_file is None:
            return None
        if self.metrics_listen is None:
            raise ConfigError("metrics_token_file is the token of metrics_listen's /metrics: "
                              "set metrics_listen too, or drop it")
        return read_auth_token(self.metrics_token_file, "metrics_token_file")

    def metrics_open_beyond_loopback(self) -> bool:
        """Whether /metrics (which names tenants) is served beyond loopback with no token."""
        if self.metrics_listen is None or self.metrics_token_file is not None:
            return False
        host, _ = parse_host_port(self.metrics_listen)
        try:
            return not ipaddress.ip_address(host.strip("[]")).is_loopback
        except ValueError:  # a name: it may resolve to any address
            return host != "localhost"

    def runner_gid(self) -> int | None:
        """The gid of runner_group; None without one."""
        return group_id(self.runner_group)

    @property
    def runners_mode(self) -> int:
        """Mode of the runner socket and the pool file."""
        return RUNNERS_ONLY_MODE if self.runner_group is None else RUNNER_GROUP_MODE

    def build_tenants(self) -> Tenants:
        """The run-time tenants (auth_token_file is the "default" tenant's token), their tokens
        read from their files."""
        return load_tenants(self.tenants, self.auth_token_file, self.unix_tenant,
                            self.unmapped_uids)

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
        if self.host_tier_memory < 0:
            raise ConfigError(f"host_tier_memory must be 0 (no tier) or positive, got "
                              f"{self.host_tier_memory}")
        if self.kv_fraction is not None and not 0 < self.kv_fraction <= 1:
            raise ConfigError(f"kv_fraction must be in (0, 1], got {self.kv_fraction}")
        device, _, index = self.device.partition(":")
        if device not in ("cpu", "cuda") or (index and (device != "cuda" or not index.isdigit())):
            raise ConfigError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")
        if self.dtype is not None:
            check_setting(model_dtype, self.dtype, "dtype")
        check_setting(lambda name: cache_dtype("float16", name), self.kv_cache_dtype,
                      "kv_cache_dtype")
        if not self.shm_dir.is_dir():
            raise ConfigError(f"shm_dir: {self.shm_dir} is not a folder")
        if self.page_size is not None and self.page_size <= 0:
            raise ConfigError(f"page_size must be positive, got {self.page_size}")
        if not 1 <= self.max_models <= 1024:
            raise ConfigError(f"max_models must be in 1..1024, got {self.max_models}")
        self._check_allocator()
        if self.restore not in RESTORE_MODES:
            raise ConfigError(f"restore must be one of {', '.join(RESTORE_MODES)}, "
                              f"got {self.restore!r}")
        if not MIN_CRASH_LOG_BYTES <= self.crash_log_bytes <= MAX_CRASH_LOG_BYTES:
            raise ConfigError(f"crash_log_bytes must be in {MIN_CRASH_LOG_BYTES}.."
                              f"{MAX_CRASH_LOG_BYTES}, got {self.crash_log_bytes}")

    def _check_allocator(self) -> None:
        """A known allocator; max_model_len exactly when contiguous, and fitting the pool when
        its size is known here (else `check_reservation` runs once it is); with contiguous, none
        of the settings the baseline cannot honour (demo/contiguous's `CANNOT`)."""
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
        defaults = {setting.name: setting.default for setting in fields(self)}
        asked = [f"{name} ({why})" for name, why in CANNOT.items()
                 if getattr(self, name) != defaults[name]]
        if asked:
            raise ConfigError(f"allocator = \"contiguous\" cannot honour {'; '.join(asked)}: "
                              "remove them, or set allocator = \"paged\"")

    def check_reservation(self, num_blocks: int) -> None:
        """A contiguous reservation of max_model_len slots fits in a pool of `num_blocks`."""
        if self.max_model_len is not None and self.max_model_len > num_blocks * self.block_size:
            raise ConfigError(f"max_model_len {self.max_model_len} does not fit in the pool: "
                              f"{num_blocks} blocks x {self.block_size} slots = "
                              f"{num_blocks * self.block_size} slots")

    def _check_events(self) -> None:
        """ZMQ endpoints the publisher can use; positive buffer and queue."""
        for key in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            endpoint = getattr(self, key)
            if endpoint and not endpoint.startswith(EVENT_TRANSPORTS):
                raise ConfigError(f"{key} must start with one of {', '.join(EVENT_TRANSPORTS)}"
                                  f", got {endpoint!r}")
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("kv_events_replay_endpoint needs kv_events_endpoint: replays "
                              "and snapshots serve the events it publishes")
        for key in ("kv_events_buffer", "kv_events_queue"):
            if not 1 <= getattr(self, key) <= MAX_EVENT_BATCHES:
                raise ConfigError(f"{key} must be in 1..{MAX_EVENT_BATCHES}, "
                                  f"got {getattr(self, key)}")

    def _check_service(self) -> None:
        """Metrics address, logging and leases."""
        if self.metrics_listen is not None:
            check_setting(parse_host_port, self.metrics_listen, "metrics_listen")
        self.metrics_token()
        if self.log_format not in LOG_FORMATS:
            raise ConfigError(f"log_format must be one of {', '.join(LOG_FORMATS)}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level must be one of {', '.join(LOG_LEVELS)}")
        if not 0 < self.lease_ttl_ms <= MAX_LEASE_TTL_MS:
            raise ConfigError(f"lease_ttl_ms must be in 1..{MAX_LEASE_TTL_MS}, "
                              f"got {self.lease_ttl_ms}")

    def _check_tls(self) -> None:
        """TLS files come as a pair and are usable; TCP listeners use TLS or say they do not."""
        self.server_tls()
        tcp = any(lst.is_tcp for lst in self.listeners())
        if tcp and self.tls_cert_file is None and not self.insecure_tcp:
            raise ConfigError("listen: a TCP listener needs TLS (tls_cert_file and tls_key_file) "
                              "or insecure_tcp = true (--insecure-tcp): without TLS the bearer "
                              "token crosses the network in clear")

    def server_tls(self) -> ServerTls | None:
        """The TLS material of TCP listeners, read from the files; None without TLS."""
        return load_tls(self.tls_cert_file, self.tls_key_file, self.tls_client_ca_file)

    def listeners(self) -> list[ListenAddress]:
        """The parsed listen addresses."""
        if not self.listen:
            raise ConfigError("listen: at least one address is needed")
        return [check_setting(parse_listen, text, "listen") for text in self.listen]


assert set(SETTINGS) == {f.name for f in fields(DaemonConfig)}, "a setting is not in SETTINGS"
