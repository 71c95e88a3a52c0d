"""The `LLM`'s own daemon and runner: two child processes in a private folder.

    with contextlib.ExitStack() as resources:
        services = start_services(config, model, resources)
        ... Engine.connect(services.daemon_target, services.runner_target) ...

The folder (mode 0700, from mkdtemp) holds both unix sockets, the notify sockets and the logs;
the pool file lives in /dev/shm on CPU (the daemon names it after its pid and removes it on
exit). Starting, readiness and stopping are `pagedkv.process.launch`'s. The daemon starts first
and is ready before the runner connects to it; the runner is stopped first (SIGTERM, SIGKILL if
it takes too long), so no step is in flight when the daemon drains. With `supervise`, a child
that dies is reaped and started again on the same sockets (supervisor.py): a runner's clients
connect with `runner_restart_wait_s=RESTART_WAIT_S` to wait for it. The supervisor is then the
daemon's systemd: it keeps the daemon's descriptor store (process/fd_store_host.py; the pool
memory outlives the daemon) and the daemon runs with `restore = auto` and its state folder in
the private folder, so a daemon stopped by SIGTERM (an upgrade) comes back with its sessions
and the clients go on (a planned upgrade, `Supervisor.upgrade`, starts the next daemon in
standby first, so the gap is its adoption only); one that crashed, or comes back cold, makes
its clients open new sessions (server/recovery.py), and the runner maps the pool by itself. At
the end the store is closed and the pool file the last daemon left for a next one removed.
"""

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagedkv.daemon.memory.kv_memory import pool_file_name
from pagedkv.daemon.process.restart import SNAPSHOT_NAME
from pagedkv.llm.config import LLMConfig
from pagedkv.llm.model_ref import ModelRef
from pagedkv.llm.pool_budget import pool_size_args
from pagedkv.llm.supervisor import Supervisor
from pagedkv.process.fd_store_host import FdStoreHost
from pagedkv.process.launch import READY_STATE, Launched, start_daemon, start_runner
from pagedkv.vocab.paths import DAEMON_RUNNER_SOCKET_NAME, MAX_UNIX_PATH_BYTES

# Children log warnings and errors only (as JSON lines: their log tail explains a failed start),
# unless the caller gives them its own log (ChildLogs).
CHILD_LOG_ARGS = ["--log-level", "warning"]
# Longest private folder path (85): room for the longest socket in it, the daemon's runner
# socket, under the unix socket path limit.
MAX_FOLDER_CHARS = MAX_UNIX_PATH_BYTES - len(f"/{DAEMON_RUNNER_SOCKET_NAME}")
# The supervised daemon's state folder (its restart snapshot), in the private folder.
STATE_FOLDER = "state"


@dataclass(frozen=True, slots=True)
class ChildLogs:
    """The children log into this process's stderr, as it logs (`pagedkv serve`: one stream
    for journald, where a request id leads from the HTTP line to the runner's and the
    daemon's), instead of into files in their private folder."""

    # Their --log-level and --log-format (log_setup's names).
    level: str
    fmt: str

    def args(self) -> list[str]:
        return ["--log-level", self.level, "--log-format", self.fmt]


@dataclass(frozen=True, slots=True)
class Services:
    """The started daemon and runner."""

    # gRPC targets of their unix sockets (a restarted runner listens on the same one).
    daemon_target: str
    runner_target: str
    # What restarts each (None without supervise): whether it is up, its restarts and pid.
    daemon_supervisor: Supervisor | None = None
    runner_supervisor: Supervisor | None = None


def start_services(config: LLMConfig, model: ModelRef, resources: contextlib.ExitStack, *,
                   supervise: bool = False, logs: ChildLogs | None = None) -> Services:
    """Start the daemon, planned for `model`, then the runner; return them once both are
    ready. `supervise`: start either again whenever it dies (but for a bad setting). `logs`:
    they log into this process's stderr so (else warnings into files). Closing `resources`
    stops what was started and removes the folder, whether or not the start got that far."""
    log_args = CHILD_LOG_ARGS if logs is None else logs.args()
    device = config.device or _default_device()
    dtype = model.config_dtype() if config.dtype == "auto" else config.dtype
    dtype_args = [] if config.dtype == "auto" else ["--dtype", config.dtype]
    if config.kv_cache_dtype != "auto":  # the daemon's format and the runner's must agree
        dtype_args += ["--kv-cache-dtype", config.kv_cache_dtype]
    folder = _private_folder()
    resources.callback(shutil.rmtree, folder, ignore_errors=True)
    daemon_args = [*model.daemon_args(), "--block-size", str(config.started_block_size),
                   "--device", device, *dtype_args, *pool_size_args(config, model, device, dtype),
                   *_daemon_switches(config), *log_args]

    store: FdStoreHost | None = None
    if supervise:  # the supervisor is the daemon's systemd: its fd store, restore = auto
        store = _kept_store(resources)
        daemon_args += ["--restore", "auto", "--state-dir", str(folder / STATE_FOLDER)]

    def new_daemon(standby: bool = False) -> Launched:
        return start_daemon(folder, *daemon_args, log_file=logs is None, fd_store=store,
                            standby=standby)

    daemon = _started(new_daemon, config, resources)
    daemon_supervisor = _supervised(new_daemon, daemon, config, resources,
                                    resumable=lambda: _resumable(folder, store),
                                    standby=lambda: new_daemon(standby=True)) \
        if supervise else None
    runner_args = [*model.runner_args(config.seed or 0), *dtype_args, *log_args]
    if config.tokenizer is not None:  # what structured outputs compile against
        runner_args += ["--tokenizer", str(Path(config.tokenizer).resolve())]

    def new_runner() -> Launched:
        return start_runner(daemon.runners_target, folder, *runner_args, log_file=logs is None)

    runner = _started(new_runner, config, resources)
    runner_supervisor = _supervised(new_runner, runner, config, resources) if supervise else None
    return Services(daemon.unix_target, runner.unix_target, daemon_supervisor, runner_supervisor)


def _daemon_switches(config: LLMConfig) -> list[str]:
    """The daemon's flags for the host tier and prefix caching (its defaults: none, on)."""
    host_tier = ["--host-tier-memory", str(config.host_tier_bytes)] if config.host_tier_bytes \
        else []
    return [*host_tier, *(["--no-prefix-caching"] if config.enable_prefix_caching is False
                          else [])]


def _started(start: Callable[[], Launched], config: LLMConfig,
             resources: contextlib.ExitStack) -> Launched:
    """A child started, stopped with `resources`, once it is ready."""
    child = start()
    resources.callback(child.stop)
    child.wait_for_notification(READY_STATE, config.startup_timeout_s)
    return child


def _supervised(start: Callable[[], Launched], child: Launched, config: LLMConfig,
                resources: contextlib.ExitStack,
                resumable: Callable[[], bool] | None = None,
                standby: Callable[[], Launched] | None = None) -> Supervisor:
    """`child`'s supervisor, watching; stopped with `resources` before the first child's own
    stop (no restart once stopping; it stops the child that is current)."""
    supervisor = Supervisor(start, child, startup_timeout_s=config.startup_timeout_s,
                            resumable=resumable, standby=standby)
    supervisor.start()
    resources.callback(supervisor.stop)
    return supervisor


def _kept_store(resources: contextlib.ExitStack) -> FdStoreHost:
    """The daemon's descriptor store; closed with `resources` once the daemon has stopped, its
    pool file removed then (a daemon with a store leaves it for the next one)."""
    store = FdStoreHost()
    resources.callback(store.close)
    resources.callback(_remove_pool_files, store)
    return store


def _remove_pool_files(store: FdStoreHost) -> None:
    """Unlink the pool files the stopped daemon left for a next one that will not come (only
    a file that is still the stored one: not a new file of that name)."""
    for fd in store.fds():
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        with contextlib.suppress(OSError):
            if pool_file_name(path.name) and os.path.samestat(os.fstat(fd), path.stat()):
                path.unlink()


def _resumable(folder: Path, store: FdStoreHost | None) -> bool:
    """Whether the daemon that exited left a snapshot and its pool memory: the next one then
    restores the sessions (it still decides, PoolInfo.previous_pool_id says what it did)."""
    return store is not None and bool(store.fds()) \
        and (folder / STATE_FOLDER / SNAPSHOT_NAME).exists()


def _private_folder() -> Path:
    """A new folder (mode 0700) under $TMPDIR, or under /tmp when that path is too long for
    the unix sockets in it."""
    folder = Path(tempfile.mkdtemp(prefix="pagedkv-"))
    if len(str(folder)) <= MAX_FOLDER_CHARS:
        return folder
    folder.rmdir()
    return Path(tempfile.mkdtemp(prefix="pagedkv-", dir="/tmp"))


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
