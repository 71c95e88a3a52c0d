"""A child process (the daemon, the runner) started again when it dies, as its systemd unit's
`Restart=on-failure` does.

    supervisor = Supervisor(lambda: start_runner(daemon.runners_target, folder, *args),
                            first_runner, startup_timeout_s=300.0)
    supervisor.listeners.append(on_change)   # called on the watch's thread
    supervisor.start()          # a thread watches the child
    ... supervisor.up, supervisor.restarts, supervisor.pid, supervisor.failed ...
    supervisor.upgrade()        # a planned restart: the next child first, in standby
    supervisor.stop()           # SIGTERM the child, wait for it, join the thread

Nobody would restart a daemon or a runner that `LLM` or `pagedkv serve` started as a child:
this does, with the same command, sockets and folder. What survives depends on the child: the
K/V lives in the daemon, so a runner that crashes loses only what it knew of its clients'
sequences (an engine connected with `runner_restart_wait_s` waits for the new runner and resends
each sequence's history: client/engine/runner_link.py). A daemon keeps its pool's memory in the
descriptor store its starter gives it (llm/services.py), and one stopped by SIGTERM its
sessions in a snapshot: the next one restores them, and `resumable` (asked at each exit, its
answer in `resumes`) tells the clients they may wait for it (server/recovery.py). A daemon that
crashes loses every session, so its clients fail their requests and open a new session, while
the runner maps the new pool by itself (model_runner/process/server.py). The notify socket's
last messages (a store's FDSTOREREMOVE) are applied before the next start.

A planned restart (`upgrade`, given a `standby` start: `pagedkv serve`'s SIGHUP) shortens the
gap to the adoption itself: the next child starts in standby (process/standby.py: its imports
done, no pool touched) while the current one serves; once it says it is ready, the current one
gets SIGTERM, and when it has exited (snapshot written, descriptors stored and drained) the
standby receives the store's descriptors and goes on to adopt, restore and bind. A standby that
dies or stays silent is killed and the current child left running.

The watch runs on a thread of its own: waiting for the child's exit (which reaps it: no zombie)
and for the new child's READY=1 blocks (a model load takes seconds), and the server's event loop
must never block. `up` is true from a child's READY=1 to its exit; each change of `up`, and a
give-up, calls the listeners. A child that exits with status 2 (a bad setting: it would fail the
same way again) is not restarted, nor one that exits while the supervisor stops; restarts are
spaced by a growing backoff and bounded per minute, past which the supervisor gives up and says
why (`failed`).
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

# The exit status of the daemon and the runner for a bad setting (their CLIs; the units'
# RestartPreventExitStatus=2): a restart would fail the same way.
EXIT_BAD_CONFIG = 2
# The window over which restarts are counted.
RESTART_WINDOW_S = 60.0


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How often a dead child is started again."""

    # Most restarts within RESTART_WINDOW_S; one more and the supervisor gives up (a child that
    # keeps dying at start would otherwise burn the machine loading its model or its pool).
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


class Supervisor:
    """Watches one child and starts it again (with `start`: the same command, sockets and
    folder) when it dies."""

    def __init__(self, start: Callable[[], Launched], child: Launched, *,
                 startup_timeout_s: float, policy: RestartPolicy | None = None,
                 resumable: Callable[[], bool] | None = None,
                 standby: Callable[[], Launched] | None = None) -> None:
        self._start = start
        self._child = child
        # Starts the next child in standby (process/standby.py) for a planned restart
        # (`upgrade`); None: this child has none.
        self._standby = standby
        # The standby that replaces the current child when it exits (set once it is ready to
        # adopt, before the current child is stopped); None: the next start is a plain one.
        self._next: Launched | None = None
        # Set while an upgrade runs: a second one is refused.
        self._upgrading = threading.Lock()
        # Asked when a child exits, before it is started again: whether it left what the next
        # one restores (the daemon's snapshot and stored pool), so its clients may wait.
        self._resumable = resumable
        # Its answer for the child that exited last (False before any exit, or without it).
        self.resumes = False
        self.startup_timeout_s = startup_timeout_s
        self.policy = policy or RestartPolicy()
        # Children started again so far (for the server's /metrics).
        self.restarts = 0
        # Why the supervisor stopped restarting (None while it restarts): exit status 2, or
        # too many restarts within a minute.
        self.failed: str | None = None
        # The last exit status of a child (None: none exited yet), for the reasons it gives.
        self.last_exit: int | None = None
        # Called (on the watch's thread, so they must not block) whenever `up` changes or the
        # supervisor gives up.
        self.listeners: list[Callable[[], None]] = []
        # Set from the current child's READY=1 (the first child is given ready) to its exit.
        self._up = threading.Event()
        self._up.set()
        # Monotonic times of the restarts within the last RESTART_WINDOW_S.
        self._recent: collections.deque[float] = collections.deque()
        self._stopping = threading.Event()
        # Held while the child is replaced, so stop() signals the child that is current.
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name=f"pagedkv-{child.name}-supervisor",
                                        daemon=True)

    @property
    def name(self) -> str:
        """The child's name ("pagedkvd", "runner")."""
        return self._child.name

    @property
    def pid(self) -> int:
        """The current child's process id (a new one after each restart)."""
        return self._child.process.pid

    @property
    def child(self) -> Launched:
        """The current child process."""
        return self._child

    @property
    def up(self) -> bool:
        """Whether the current child runs and said READY=1."""
        return self._up.is_set()

    def start(self) -> None:
        """Start watching (the child given is already started and ready)."""
        self._thread.start()

    def stop(self) -> int:
        """Stop restarting, stop the current child (SIGTERM; SIGKILL past launch's
        STOP_TIMEOUT_S) and wait for the watch to end; the child's exit status. Idempotent."""
        self._stopping.set()
        with self._lock:
            child = self._child
            if child.process.poll() is None:
                child.send(signal.SIGTERM)
        code = child.wait_for_exit()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            if self._next is not None:  # an upgrade's standby the watch did not take
                self._next.stop(signal.SIGKILL)
                self._next = None
        self._child.stop()  # closes its notify socket; the thread no longer reads it
        return code

    def upgrade(self) -> bool:
        """A planned restart, on a thread of its own (returns at once): start the next child in
        standby, and once it is ready to adopt, SIGTERM the current one; the watch hands the
        standby what the current one left when it exits. False (nothing done) without a
        standby start, or while an upgrade or the stop runs."""
        if self._standby is None or self._stopping.is_set() \
                or not self._upgrading.acquire(blocking=False):
            return False
        threading.Thread(target=self._upgrade, name=f"pagedkv-{self.name}-upgrade",
                         daemon=True).start()
        return True

    def _upgrade(self) -> None:
        """`upgrade`'s thread: a standby that dies or stays silent is killed, the current
        child left running."""
        assert self._standby is not None
        try:
            standby = self._standby()
            try:
                standby.wait_for_standby(self.startup_timeout_s)
            except (NoNotification, OSError) as exc:
                log.warning("upgrade given up: the standby was not ready", child=self.name,
                            error=str(exc).splitlines()[0])
                standby.stop(signal.SIGKILL)
                return
            with self._lock:
                if self._stopping.is_set() or self._child.process.poll() is not None:
                    standby.stop(signal.SIGKILL)  # stopping, or the child died meanwhile
                    return
                self._next = standby
                log.warning("upgrade: standby ready, stopping the current child",
                            child=self.name, pid=self.pid, standby_pid=standby.process.pid)
                self._child.send(signal.SIGTERM)
        finally:
            self._upgrading.release()

    def _watch(self) -> None:
        """Until stopped or given up: wait for the child's exit, then start it again."""
        while True:
            code = self._child.process.wait()
            if self._stopping.is_set():
                return
            self.last_exit = code
            self._child.drain()  # the store commands it sent last, before the next start
            self.resumes = self._resumable is not None and self._resumable()
            self._changed(up=False)
            if self._next is not None:
                self._adopt()
                continue
            if code == EXIT_BAD_CONFIG:
                self._give_up(f"the {self.name} exited with status {code} (a bad setting)")
                return
            log.warning("child exited", child=self.name, status=code, pid=self.pid)
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
            self._give_up(f"the {self.name} died {len(self._recent) + 1} times within "
                          f"{RESTART_WINDOW_S:g} s")
            return False
        return not self._stopping.wait(self.policy.backoff_s(len(self._recent)))

    def _adopt(self) -> None:
        """A planned restart's second half: the ready standby receives the store's
        descriptors and becomes the child (not counted against the restart bound: nothing
        died)."""
        with self._lock:
            standby, self._next = self._next, None
            assert standby is not None
            if self._stopping.is_set():
                standby.stop(signal.SIGKILL)
                return
            self._child.notify_socket.close()
            self._child = standby
            self.restarts += 1
            try:
                standby.hand_over()
            except OSError as exc:  # it died meanwhile: the watch restarts it
                log.warning("standby lost before the hand-over", child=self.name, error=str(exc))
                return
        log.warning("child upgraded", child=self.name, pid=self.pid, restarts=self.restarts)
        self._wait_ready()

    def _restart(self) -> None:
        """Start a new child and wait for its READY=1; a child that dies or stays silent
        meanwhile is left to the next turn of the watch (a silent one is killed first)."""
        with self._lock:
            if self._stopping.is_set():
                return
            self._child.notify_socket.close()
            self._child = self._start()
            self._recent.append(time.monotonic())
            self.restarts += 1
        log.warning("child restarted", child=self.name, pid=self.pid, restarts=self.restarts)
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Wait for the new child's READY=1 and say it is up; a silent one is killed."""
        try:
            self._child.wait_for_notification(READY_STATE, self.startup_timeout_s)
        except (NoNotification, OSError) as exc:  # OSError: stop() closed the socket
            if not self._stopping.is_set():
                log.warning("restarted child not ready", child=self.name,
                            error=str(exc).splitlines()[0])
                self._child.process.kill()
            return
        self._changed(up=True)

    def _changed(self, *, up: bool) -> None:
        if up:
            self._up.set()
        else:
            self._up.clear()
        self._tell()

    def _give_up(self, reason: str) -> None:
        self.failed = reason
        log.error("child not restarted", child=self.name, reason=reason)
        self._tell()

    def _tell(self) -> None:
        for listener in self.listeners:
            listener()
