"""The `LLM`'s own daemon and runner: two child processes in a private folder.

    with contextlib.ExitStack() as resources:
        services = start_services(config, model, resources)
        ... Engine.connect(services.daemon_target, services.runner_target) ...

The folder (mode 0700, from mkdtemp) holds both unix sockets, the notify sockets and the logs;
the pool file lives in /dev/shm on CPU (the daemon names it after its pid and removes it on
exit). Starting, readiness and stopping are `pagedkv.process.launch`'s. The daemon starts first
and is ready before the runner connects to it; the runner is stopped first (SIGTERM, SIGKILL
if it takes too long), so no step is in flight when the daemon drains. With `restart_runner`, a
runner that dies is started again on the same socket (runner_supervisor.py): its clients then
connect with `runner_restart_wait_s=RESTART_WAIT_S` to wait for it.
"""

import contextlib
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pagedkv.llm.config import LLMConfig
from pagedkv.llm.model_ref import ModelRef
from pagedkv.llm.pool_budget import pool_size_args
from pagedkv.llm.runner_supervisor import RunnerSupervisor
from pagedkv.process.launch import READY_STATE, Launched, start_daemon, start_runner
from pagedkv.vocab.paths import DAEMON_RUNNER_SOCKET_NAME, MAX_UNIX_PATH_BYTES

# Children log warnings and errors only (as JSON lines: their log tail explains a failed start).
CHILD_LOG_ARGS = ["--log-level", "warning"]
# Longest private folder path (85): room for the longest socket in it, the daemon's runner
# socket, under the unix socket path limit.
MAX_FOLDER_CHARS = MAX_UNIX_PATH_BYTES - len(f"/{DAEMON_RUNNER_SOCKET_NAME}")


@dataclass(frozen=True, slots=True)
class Services:
    """The started daemon and runner."""

    # gRPC targets of their unix sockets (a restarted runner listens on the same one).
    daemon_target: str
    runner_target: str
    # What restarts the runner (None without restart_runner): its restart count and pid.
    supervisor: RunnerSupervisor | None = None


def start_services(config: LLMConfig, model: ModelRef, resources: contextlib.ExitStack, *,
                   restart_runner: bool = False) -> Services:
    """Start the daemon, planned for `model`, then the runner; return them once both are
    ready. `restart_runner`: start the runner again whenever it dies (but for a bad setting).
    Closing `resources` stops what was started and removes the folder, whether or not the
    start got that far."""
    device = config.device or _default_device()
    dtype = model.config_dtype() if config.dtype == "auto" else config.dtype
    pool_args = pool_size_args(config, device, model.weights_bytes(dtype))
    dtype_args = [] if config.dtype == "auto" else ["--dtype", config.dtype]
    host_args = ["--host-tier-memory", str(config.host_tier_bytes)] if config.host_tier_bytes \
        else []
    folder = _private_folder()
    resources.callback(shutil.rmtree, folder, ignore_errors=True)
    daemon = start_daemon(folder, *model.daemon_args(), "--block-size", str(config.block_size),
                          "--device", device, *dtype_args, *pool_args, *host_args,
                          *CHILD_LOG_ARGS)
    resources.callback(daemon.stop)
    daemon.wait_for_notification(READY_STATE, config.startup_timeout_s)
    runner_args = [*model.runner_args(config.seed), *dtype_args, *CHILD_LOG_ARGS]

    def new_runner() -> Launched:
        return start_runner(daemon.runners_target, folder, *runner_args)

    runner = new_runner()
    resources.callback(runner.stop)
    runner.wait_for_notification(READY_STATE, config.startup_timeout_s)
    if not restart_runner:
        return Services(daemon.unix_target, runner.unix_target)
    supervisor = RunnerSupervisor(new_runner, runner, startup_timeout_s=config.startup_timeout_s)
    supervisor.start()
    resources.callback(supervisor.stop)  # before runner.stop: no restart once stopping
    return Services(daemon.unix_target, runner.unix_target, supervisor)


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
