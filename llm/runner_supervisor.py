"""A runner child started again when it dies, as its systemd unit's `Restart=on-failure` does.

    supervisor = RunnerSupervisor(lambda: start_runner(daemon.runners_target, folder, *args),
                                  first_runner, startup_timeout_s=300.0)
    supervisor.start()          # a thread watches the child
    ... supervisor.restarts, supervisor.pid, supervisor.failed ...
    supervisor.stop()           # SIGTERM the runner, wait for it, join the thread

The K/V lives in the daemon, so a runner that crashes loses only what it knew of its clients'
sequences: an engine connected with `runner_restart_wait_s` waits for the new runner on the
same socket and resends each sequence's history (client/engine/runner_link.py). Nobody would
restart a runner that `LLM` or `pagedkv serve` started as a child: this does.

The watch runs on a thread of its own: waiting for the child's exit and for the new runner's
READY=1 blocks (a model load takes seconds), and the server's event loop must never block. A
runner that exits with status 2 (a bad setting: it would fail the same way again) is not
restarted, nor one that exits while the supervisor stops; restarts are spaced by a growing
backoff and bounded per minute, past which the supervisor gives up and says why (`failed`).
"""

import collections
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.process.launch import READY_STATE, Launched, NoNotification
from pagedkv.process.log_setup import get_logger

log = get_logger(__name__)

# The runner's exit status for a bad setting (model_runner/process/cli.py, the unit's
# RestartPreventExitStatus=2): a restart would fail the same way.
EXIT_BAD_CONFIG = 2
# The window over which restarts are counted.
RESTART_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How often a dead runner is started again."""

    # Most restarts within RESTART_WINDOW_S; one more and the supervisor gives up (a runner that
    # keeps dying at start would otherwise burn the machine loading its model).
    max_per_minute: int = 5
    # Wait before a restart: none for the first within the window (the clients are waiting),
    # then base_s, growing fourfold with each restart in the window, at most max_s.
    backoff_base_s: float = 0.1
    backoff_max_s: float = 10.0

    def backoff_s(self, recent: int) -> float:
        """The wait before a restart that follows `recent` restarts within the window."""
        if recent == 0:
            return 0.0
        return float(min(self.backoff_max_s, self.backoff_base_s * 4 ** (recent - 1)))


class RunnerSupervisor:
    """Watches one runner child and starts it again (with `start`: the same command, socket
    and folder) when it dies."""

    def __init__(self, start: Callable[[], Launched], runner: Launched, *,
                 startup_timeout_s: float, policy: RestartPolicy | None = None) -> None:
        self._start = start
        self._runner = runner
        self.startup_timeout_s = startup_timeout_s
        self.policy = policy or RestartPolicy()
        # Runners started again so far (for the server's /metrics).
        self.restarts = 0
        # Why the supervisor stopped restarting (None while it restarts): exit status 2, or
        # too many restarts within a minute.
        self.failed: str | None = None
        # Monotonic times of the restarts within the last RESTART_WINDOW_S.
        self._recent: collections.deque[float] = collections.deque()
        self._stopping = threading.Event()
        # Held while the runner is replaced, so stop() signals the runner that is current.
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="pagedkv-runner-supervisor",
                                        daemon=True)

    @property
    def pid(self) -> int:
        """The current runner's process id (a new one after each restart)."""
        return self._runner.process.pid

    @property
    def runner(self) -> Launched:
        """The current runner process."""
        return self._runner

    def start(self) -> None:
        """Start watching (the runner given is already started)."""
        self._thread.start()

    def stop(self) -> int:
        """Stop restarting, stop the current runner (SIGTERM; SIGKILL past launch's
        STOP_TIMEOUT_S) and wait for the watch to end; the runner's exit status. Idempotent."""
        self._stopping.set()
        with self._lock:
            runner = self._runner
            if runner.process.poll() is None:
                runner.send(signal.SIGTERM)
        code = runner.wait_for_exit()
        if self._thread.is_alive():
            self._thread.join()
        self._runner.stop()  # closes its notify socket; the thread no longer reads it
        return code

    def _watch(self) -> None:
        """Until stopped or given up: wait for the runner's exit, then start it again."""
        while True:
            code = self._runner.process.wait()
            if self._stopping.is_set():
                return
            if code == EXIT_BAD_CONFIG:
                self._give_up(f"the runner exited with status {code} (a bad setting)")
                return
            log.warning("runner exited", status=code, pid=self._runner.process.pid)
            if not self._wait_for_turn():
                return
            self._restart()

    def _wait_for_turn(self) -> bool:
        """Sleep the backoff the restarts within the window ask for; False when stopped
        meanwhile or when the bound is reached (then given up)."""
        now = time.monotonic()
        while self._recent and now - self._recent[0] > RESTART_WINDOW_S:
            self._recent.popleft()
        if len(self._recent) >= self.policy.max_per_minute:
            self._give_up(f"the runner died {len(self._recent) + 1} times within "
                          f"{RESTART_WINDOW_S:g} s")
            return False
        return not self._stopping.wait(self.policy.backoff_s(len(self._recent)))

    def _restart(self) -> None:
        """Start a new runner and wait for its READY=1; a runner that dies or stays silent
        meanwhile is left to the next turn of the watch (a silent one is killed first)."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._runner.notify_socket.close()
            self._runner = self._start()
            self._recent.append(time.monotonic())
            self.restarts += 1
        log.warning("runner restarted", pid=self._runner.process.pid, restarts=self.restarts)
        try:
            self._runner.wait_for_notification(READY_STATE, self.startup_timeout_s)
        except (NoNotification, OSError) as exc:  # OSError: stop() closed the socket
            if not self._stopping.is_set():
                log.warning("restarted runner not ready", error=str(exc).splitlines()[0])
                self._runner.process.kill()

    def _give_up(self, reason: str) -> None:
        self.failed = reason
        log.error("runner not restarted", reason=reason)
