"""The server's engine across restarts of the daemon and the runner it started.

    keeper = EngineKeeper(backend, connect, services.daemon_supervisor,
                          services.runner_supervisor)
    failed = await keeper.watch_until(stop)    # None once `stop` is set; else why it gave up
    await keeper.close()                       # the current engine too

The engine is one daemon session. The daemon `pagedkv serve` starts runs with `restore = auto`
and an fd store (llm/services.py): one stopped by SIGTERM (an upgrade, a restart) writes its
sessions and tables, and the next one adopts the pool memory and restores them. So when the
daemon's supervisor (llm/supervisor.py) sees it exit having left that (`Supervisor.resumes`),
the keeper pauses: the engine and its requests stay (the runner keeps its sequences, RunnerLink
sends the steps it refuses again, the pool client's read-backs wait out the gap:
DAEMON_OUTAGE_S); once the daemon is back, the keeper keeps the engine if the daemon restored
the pool the engine was opened on (PoolInfo.previous_pool_id), and goes on as below if not.

A daemon that dies otherwise (a crash: no snapshot), or starts cold, takes the session, the
pool's contents and every sequence with it: no request in flight can go on, and the runner,
which stays up, maps the restarted daemon's pool by itself (model_runner/process/server.py).
The keeper then fails every request of the engine with a retryable 503 (`unavailable`: the
client sends it again) and closes the engine (and each API key group's, which open again at
their next request: key_engines.py); once the daemon is back it opens a new engine (a new
session) on it and the runner, retrying until the runner has mapped the new pool. A runner that
dies keeps the engine: its requests wait for the new runner and go on
(client/engine/runner_link.py).

While either child is down, or the engine is being opened again, `backend.down` says why: new
requests get 503 with it at once, and /health answers 503 with it. New requests do not wait
for a restoring daemon: admitting one needs the daemon, the gap is a few seconds that a client
told `Retry-After: 1` bridges by itself, and a server that queued them would hold connections
for a daemon that may come back cold.

A supervisor that gives up (a bad setting, too many deaths within a minute), or an engine that
cannot be opened again within `reopen_timeout_s`, ends `watch_until` with the reason: the
server then exits with a failure status, for systemd to restart the whole unit.
"""

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from pagedkv.client.engine.engine import Engine
from pagedkv.client.pool.errors import PagedKVError
from pagedkv.client.pool.recovery import RetryPolicy
from pagedkv.llm.supervisor import Supervisor
from pagedkv.process.lifecycle import cancel
from pagedkv.process.log_setup import get_logger
from pagedkv.server.backend import Backend, unavailable

log = get_logger("pagedkv.server")
# How long a new engine may take to open on a restarted daemon (the runner maps the new pool
# within a second of its READY=1; a loaded machine is slower), and how often it is tried.
REOPEN_TIMEOUT_S = 60.0
REOPEN_POLL_S = 0.1
# How long the engine's daemon calls wait out a daemon that is away (RetryPolicy.outage_s): a
# restored restart (its model load and the restore) takes a few seconds, a loaded machine more.
DAEMON_OUTAGE_S = 60.0
# The pool client's retry rules for the engine under a supervised daemon.
OUTAGE_RETRY = RetryPolicy(outage_s=DAEMON_OUTAGE_S)
# How long the lost engine's close may take (its runner and daemon calls meet a daemon that is
# gone): past it the close is cut short.
CLOSE_LOST_S = 5.0


class ServicesFailed(RuntimeError):
    """The daemon or the runner is not restarted, or no engine could be opened again."""


class EngineKeeper:
    """Keeps `backend.engine` on the daemon and runner that are current, and `backend.down`
    saying why no request can be served now."""

    def __init__(self, backend: Backend, connect: Callable[[], Awaitable[Engine]],
                 daemon: Supervisor | None, runner: Supervisor | None, *,
                 reopen_timeout_s: float = REOPEN_TIMEOUT_S) -> None:
        self.backend = backend
        self._connect = connect
        # The supervised children (none when the server uses running services: --daemon).
        self._supervisors = [s for s in (daemon, runner) if s is not None]
        self._daemon = daemon
        self.reopen_timeout_s = reopen_timeout_s
        # Set when the engine died with its daemon, until a new one is opened.
        self._lost = False
        # Set while the daemon restarts from its snapshot: the engine waits, until the daemon
        # is back and says whether it restored the engine's pool.
        self._paused = False
        # The daemon's restarts when the engine was opened or kept (another count: the daemon
        # restarted since).
        self._daemon_restarts = 0
        # The pool the engine's session lives on now (a kept engine's moves to the restored
        # daemon's pool).
        self._pool_id = backend.engine.pool_id
        # Set (from the supervisors' threads) whenever a child goes down, comes up or is given
        # up on.
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        for supervisor in self._supervisors:
            supervisor.listeners.append(self._woken)

    def _woken(self) -> None:
        """A supervisor's listener, on its thread: wake the keeper on its loop."""
        self._loop.call_soon_threadsafe(self._wake.set)

    async def watch_until(self, stop: asyncio.Event) -> str | None:
        """Follow the children until `stop` is set (None) or recovery is given up (why); a
        recovery under way when `stop` is set is cancelled (an engine being opened closes)."""
        following = asyncio.create_task(self._follow())
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({following, stopped}, return_when=asyncio.FIRST_COMPLETED)
            return following.result() if following.done() else None
        finally:
            await cancel(following, stopped)

    async def _follow(self) -> str:
        """Recover at each wake; the reason once recovery is given up."""
        while True:
            self._wake.clear()  # a change during the recovery wakes it again
            try:
                await self._recover()
            except ServicesFailed as exc:
                self.backend.down = str(exc)
                log.error("services_failed", reason=str(exc))
                return str(exc)
            await self._wake.wait()

    async def _recover(self) -> None:
        """Bring the engine in line with the children as they are now (a daemon that died and
        came back before the keeper woke is seen by its restart count)."""
        failed = [s.failed for s in self._supervisors if s.failed is not None]
        if failed:
            raise ServicesFailed(failed[0])
        daemon = self._daemon
        if daemon is not None and not (self._lost or self._paused) \
                and (not daemon.up or daemon.restarts != self._daemon_restarts):
            if daemon.resumes:
                self._pause(daemon)
            else:
                await self._lose_engine(daemon)
        if self._paused and all(s.up for s in self._supervisors):
            await self._resume(daemon)
        if self._lost and all(s.up for s in self._supervisors):
            await self._reopen()
        self.backend.down = self._reason()

    def _reason(self) -> str | None:
        """Why no request can be served now (None: it can)."""
        for supervisor in self._supervisors:
            if not supervisor.up:
                return (f"the {supervisor.name} exited (status {supervisor.last_exit}) and is "
                        "being restarted")
        if self._paused:
            return "the KV cache daemon is restoring its state after a restart"
        return "the engine is being opened again on the restarted daemon" if self._lost else None

    def _pause(self, daemon: Supervisor) -> None:
        """The daemon exited leaving its snapshot and pool memory: the engine's requests wait
        for the next one."""
        self._paused = True
        self.backend.down = self._reason()
        log.warning("daemon_restarting", status=daemon.last_exit, restarts=daemon.restarts)

    async def _resume(self, daemon: Supervisor | None) -> None:
        """The daemon is back: keep the engine if it restored the engine's pool and still
        runs, else lose it (its requests fail as retryable). A daemon that does not answer
        within reopen_timeout_s is lost too."""
        assert daemon is not None, "only the daemon's supervisor pauses the keeper"
        restarts = daemon.restarts
        deadline = asyncio.get_running_loop().time() + self.reopen_timeout_s
        while True:
            try:
                info = await self.backend.engine.pool.pool_info()
                break
            except PagedKVError:
                if asyncio.get_running_loop().time() >= deadline or not daemon.up:
                    await self._lose_engine(daemon)
                    return
                await asyncio.sleep(REOPEN_POLL_S)
        self._paused = False
        # An engine whose loop ended in the gap (a step its runner could not place: the
        # runner's daemon went away under it) is lost even on a restored pool.
        if info.previous_pool_id != self._pool_id or daemon.restarts != restarts \
                or self.backend.engine.failure() is not None:
            await self._lose_engine(daemon)
            return
        self._pool_id = info.pool_id
        self._daemon_restarts = restarts
        log.warning("engine_kept", pool_id=info.pool_id, previous_pool_id=info.previous_pool_id)

    async def _lose_engine(self, daemon: Supervisor) -> None:
        """The daemon died: fail the requests of every engine (the server's, and each API key
        group's) as retryable, and close them (a key group's opens again at its next request)."""
        if self._lost:
            return
        self._lost = True
        self._paused = False
        self.backend.down = self._reason()
        log.warning("daemon_lost", status=daemon.last_exit, restarts=daemon.restarts)
        keys = self.backend.key_engines
        for engine in [self.backend.engine, *(keys.engines.values() if keys else ())]:
            engine.waiters.fail_all(unavailable("the KV cache daemon died, and the request's "
                                                "K/V with it"))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_LOST_S):
                await self.backend.engine.close()
                if keys is not None:
                    await keys.close()

    async def _reopen(self) -> None:
        """Open a new engine on the restarted daemon, trying until the runner serves its pool;
        ServicesFailed past reopen_timeout_s. Left to the next wake if a child goes down
        meanwhile."""
        self.backend.down = self._reason()
        deadline = asyncio.get_running_loop().time() + self.reopen_timeout_s
        while all(s.up for s in self._supervisors):
            restarts = self._daemon.restarts if self._daemon is not None else 0
            try:
                engine = await self._connect()
            except (PagedKVError, ValueError) as exc:  # ValueError: the runner's pool is old
                if asyncio.get_running_loop().time() >= deadline:
                    raise ServicesFailed(f"no engine could be opened on the restarted daemon "
                                         f"within {self.reopen_timeout_s:g} s: {exc}") from exc
                await asyncio.sleep(REOPEN_POLL_S)
                continue
            self.backend.engine = engine
            self._lost = False
            self._daemon_restarts = restarts
            self._pool_id = engine.pool_id
            log.warning("engine_reopened")
            return

    async def close(self) -> None:
        """Stop listening to the supervisors (their threads outlive the event loop) and close
        the current engine."""
        for supervisor in self._supervisors:
            supervisor.listeners.remove(self._woken)
        if not self._lost:
            await self.backend.engine.close()
