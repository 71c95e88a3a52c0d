"""The `LLM`'s own daemon and runner: two child processes in a private folder.

    services = start_services(config, resolve_model(config.model))
    ... Engine.connect(services.daemon_target, services.runner_target) ...
    services.stop()

The folder (mode 0700, from mkdtemp) holds both unix sockets, the notify sockets and the logs;
the pool file lives in /dev/shm on CPU (the daemon names it after its pid and removes it on
exit). The daemon starts first and is ready before the runner connects to it; the runner is
stopped first, so no step is in flight when the daemon drains.
"""

import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .child_process import Child, start_child
from .config import LLMConfig
from .model_ref import ModelRef
from .pool_budget import pool_size_args

# Children log warnings and errors only, as JSON lines (their log tail explains a failed start).
CHILD_LOG_ARGS = ["--log-format", "json", "--log-level", "warning"]
# Longest private folder path: a unix socket path has at most 107 bytes, and the longest file
# in the folder is "runner.notify".
MAX_FOLDER_CHARS = 90


@dataclass
class Services:
    """A running embedded daemon and runner."""

    # The private folder of sockets and logs, removed by stop().
    folder: Path
    daemon: Child
    runner: Child | None
    # gRPC targets of the two unix sockets.
    daemon_target: str
    runner_target: str

    def stop(self) -> None:
        """Stop the runner, then the daemon; remove the folder. Idempotent."""
        if self.runner is not None:
            self.runner.stop()
        self.daemon.stop()
        shutil.rmtree(self.folder, ignore_errors=True)


def start_services(config: LLMConfig, model: ModelRef) -> Services:
    """Start the daemon, planned for `model`, then the runner; return once both are ready.
    On any failure what was started is stopped again."""
    device = config.device or _default_device()
    dtype = model.config_dtype() if config.dtype == "auto" else config.dtype
    pool_args = pool_size_args(config, device, model.weights_bytes(dtype))
    dtype_args = [] if config.dtype == "auto" else ["--dtype", config.dtype]
    folder = _private_folder()
    daemon_target = f"unix://{folder / 'daemon.sock'}"
    runner_target = f"unix://{folder / 'runner.sock'}"
    daemon = start_child("daemon", [
        sys.executable, "-m", "pagedkv.daemon.cli", "serve", "--listen", daemon_target,
        *model.daemon_args(), "--block-size", str(config.block_size), "--device", device,
        *dtype_args, *pool_args, *CHILD_LOG_ARGS], folder)
    services = Services(folder, daemon, None, daemon_target, runner_target)
    try:
        daemon.wait_ready(config.startup_timeout_s)
        services.runner = start_child("runner", [
            sys.executable, "-m", "pagedkv.model_runner", "--daemon", daemon_target,
            "--listen", runner_target, *model.runner_args(config.seed), *dtype_args,
            *CHILD_LOG_ARGS], folder)
        services.runner.wait_ready(config.startup_timeout_s)
    except BaseException:
        services.stop()
        raise
    return services


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
