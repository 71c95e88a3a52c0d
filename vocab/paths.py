"""Where pagedkv processes put their unix sockets, named once for the daemon, the runner, the
launcher and the docs.

The runtime folder is systemd's RuntimeDirectory when a process runs as a unit (the
`RUNTIME_DIRECTORY` variable; /run/pagedkv with the shipped units), else ./run under the current
folder. In it:

    pagedkvd.sock           the daemon's public socket (clients)
    pagedkvd-runners.sock   the daemon's runner socket (runners: they map the pool memory)
    pagedkv-runner.sock     the runner's socket (clients send it their steps)

A setting or flag that names another path wins; these are the defaults.
"""

from collections.abc import Mapping
from pathlib import Path

# systemd sets it to the unit's RuntimeDirectory= folders, colon-separated.
RUNTIME_DIR_VARIABLE = "RUNTIME_DIRECTORY"
# The daemon's public socket, where clients connect.
DAEMON_SOCKET_NAME = "pagedkvd.sock"
# The daemon's runner socket: runners alone get the pool memory and act for any session.
DAEMON_RUNNER_SOCKET_NAME = "pagedkvd-runners.sock"
# The runner's socket, where clients send their steps.
RUNNER_SOCKET_NAME = "pagedkv-runner.sock"
# Longest unix socket path the kernel accepts (sun_path is 108 bytes with the trailing NUL).
MAX_UNIX_PATH_BYTES = 107


def runtime_dir(env: Mapping[str, str]) -> Path:
    """The runtime folder (absolute): the first RUNTIME_DIRECTORY entry, else ./run."""
    first = env.get(RUNTIME_DIR_VARIABLE, "").split(":")[0]
    return (Path(first) if first else Path.cwd() / "run").absolute()


def socket_target(path: Path) -> str:
    """The gRPC target of the unix socket at `path` ("unix:///abs/path" when absolute)."""
    return f"unix://{path}"


def default_daemon_listen(env: Mapping[str, str]) -> str:
    """The daemon's public socket: pagedkvd.sock in the runtime folder."""
    return socket_target(runtime_dir(env) / DAEMON_SOCKET_NAME)


def default_daemon_runner_socket(env: Mapping[str, str]) -> str:
    """The daemon's runner socket when it listens in the runtime folder (where a runner looks
    for it by default)."""
    return socket_target(runtime_dir(env) / DAEMON_RUNNER_SOCKET_NAME)


def default_runner_listen(env: Mapping[str, str]) -> str:
    """The runner's socket: pagedkv-runner.sock in the runtime folder."""
    return socket_target(runtime_dir(env) / RUNNER_SOCKET_NAME)
