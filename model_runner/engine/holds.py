"""The runner's holds on its clients' sessions (kvpool.proto's "Runner holds").

    holds = SessionHolds(session_table, hold_ms=5000)
    await holds.ensure(known)                            # before a forward
    holder = asyncio.create_task(holds.keep(known))      # while it waits and runs
    holds.after_step(session_id, entry)                  # the session's lock let go

A forward writes K/V into the blocks its step's daemon calls answered, after those calls. A
client that freed those blocks directly in the daemon meanwhile (Free, CloseSession) would hand
them to another session, and the forward would write into that session's K/V. So every daemon
call that precedes a forward carries hold_ms (preparation.py), and until the hold ends the daemon
refuses the client's own frees (SessionBusy) and does not expire the session. Here the hold is
kept for as long as a forward of the session may write, and no longer:

- `ensure`: a step whose daemon calls did not just hold the session (it made none: a resend
  without tokens) holds it before its forward is queued;
- `keep`: renewed at half its length while the forward waits and runs (KeepAlive, which renews
  the lease too);
- ended (`end_hold`) once no forward of the session is queued or running: by the engine in the
  Batch that frees released sequences, after a cancelled step's forward (`end`), before a failed
  step answers (`end_quietly`), and here once the session has been idle for IDLE_END_S
  (`after_step`), and when the runner stops.
  The idle end runs under the session's lock, so it never ends a later step's hold, and is sent
  only if no step began meanwhile: a client stepping back to back costs no call.

A decode step inside its sequences' reservations makes no daemon call (reservations.py): the
hold is then renewed by `ensure` and `keep` alone, and a step that finds the hold ended (`ended`:
the client may have freed or re-created its sequences directly since) makes a call first.

A prefill's commit (SeqState.commit_due) rides the session's next daemon Step or Batch
(preparation.py); if none comes, it rides the end of the hold (`end`: a Batch with the commit
and end_hold instead of a KeepAlive), so computed K/V is certified before the client can free
it.

A hold's deadline is the daemon's stall detector, not its release: a hold that lapses while
this runner lives is never released to anyone else; the daemon kills the runner first
(kvpool.proto, "Runner holds"; daemon/service/fence.py). So a hold that lapsed without being
ended still protects what was computed under it: only an ended hold lets the client in. A hold
the runner does not end lapses hold_ms after its last renewal and ends with the runner's
process (it died), or is fenced when the session's blocks are needed (it stalled).
"""

import asyncio
import contextlib
import math
import time

from pagedkv.client import NotFound, PagedKVError, SessionExpired
from pagedkv.model_runner.engine.sequences import SessionSequences
from pagedkv.model_runner.engine.sessions import SessionEntry, SessionTable
from pagedkv.process.lifecycle import cancel

# How long the runner's daemon calls hold a session (`pagedkv runner --hold-ms`): renewed at half
# of it while a forward waits or runs; at most the daemon's max_hold_ms (10 s by default).
DEFAULT_HOLD_MS = 5000
# How soon a renewal that failed (a slow or restarting daemon) is tried again.
HOLD_RETRY_S = 0.1
# How long a session with no step waits before the runner ends its hold: a client that closes
# its session directly after its last answer waits about this long (SessionBusy).
IDLE_END_S = 0.1


class SessionHolds:
    """Holds the runner's clients' sessions while their forwards may write (module docstring)."""

    def __init__(self, sessions: SessionTable, *, hold_ms: int) -> None:
        self.sessions = sessions
        # How long each hold lasts unless renewed or ended.
        self.hold_ms = hold_ms
        # Ends of idle sessions' holds, waiting for IDLE_END_S.
        self._idle_ends: set[asyncio.Task[None]] = set()

    @property
    def renew_after_s(self) -> float:
        """How old a hold is when the runner renews it: half its length."""
        return self.hold_ms / 2000

    async def hold(self, known: SessionSequences) -> None:
        """Hold the session for hold_ms from now (KeepAlive, which renews its lease too)."""
        sent = known.asking_hold()
        await known.session.keep_alive(hold_ms=self.hold_ms)
        known.held_at = sent

    async def end(self, known: SessionSequences) -> None:
        """End the runner's hold (no forward of the session is queued or running), with the
        commits still due (a Batch), else with a KeepAlive."""
        commit = known.due()
        if commit is None:
            await known.session.keep_alive(end_hold=True)
        else:
            await known.session.batch([commit], end_hold=True)
            known.clear_due(commit.seq_ids)
        known.hold_ended()

    def ended(self, known: SessionSequences) -> bool:
        """Whether the session is unheld since the runner's last call (never held, or the hold
        ended): the client may have freed or re-created its sequences directly, so the runner's
        own view of their reservations needs a call to confirm. (A hold that lapsed without
        ending still holds: the daemon stops this runner before anyone else gets its blocks.)"""
        return known.held_at == -math.inf

    async def end_quietly(self, known: SessionSequences) -> None:
        """End the hold, if any, before a failed step answers (its client may free at once);
        one that cannot be ended lapses by itself."""
        if known.may_hold:
            with contextlib.suppress(PagedKVError):
                await self.end(known)

    async def ensure(self, known: SessionSequences) -> None:
        """Hold the session now unless a daemon call just did (before a forward)."""
        if time.monotonic() - known.held_at > self.renew_after_s:
            await self.hold(known)

    async def keep(self, known: SessionSequences) -> None:
        """Renew the hold while a forward of the session waits and runs (until cancelled): a
        client that frees its sequences or closes its session directly meanwhile is refused,
        and the session does not expire (a client that dies stops its own KeepAlive)."""
        while True:
            await asyncio.sleep(max(HOLD_RETRY_S,
                                    known.held_at + self.renew_after_s - time.monotonic()))
            try:
                await self.hold(known)
            except (SessionExpired, NotFound):
                return  # gone already: the step fails at its finish
            except PagedKVError:  # a slow or restarting daemon: try again soon
                continue

    def after_step(self, session_id: str, entry: SessionEntry) -> None:
        """The session's lock was let go (no forward of it is left): end its hold, if any, once
        it has been idle for IDLE_END_S."""
        known = entry.sequences
        if known.may_hold and not entry.ended:
            task = asyncio.create_task(self._end_when_idle(session_id, known.stepped))
            self._idle_ends.add(task)
            task.add_done_callback(self._idle_ends.discard)

    async def _end_when_idle(self, session_id: str, stepped: int) -> None:
        """End the hold if no step of the session began within IDLE_END_S (its `stepped` count
        unchanged: a decode step may make no daemon call, so the hold's age does not tell);
        under the session's lock, so that no forward of the session is queued or running and
        no later hold is ended."""
        await asyncio.sleep(IDLE_END_S)
        entry = self.sessions.get(session_id)
        if entry is None or entry.sequences.stepped != stepped:
            return  # a later step (which ends it in turn), or forgotten
        entry = self.sessions.enter(session_id)
        try:
            async with entry.lock:
                known = entry.sequences
                if known.stepped == stepped and known.may_hold and not entry.ended:
                    with contextlib.suppress(PagedKVError):  # else it lapses by itself
                        await self.end(entry.sequences)
        finally:
            self.sessions.leave(session_id, entry)

    async def stop(self) -> None:
        """End every hold (the runner stopping, its forwards done: nothing writes any more)."""
        await cancel(*self._idle_ends)
        await asyncio.gather(*(self.end(entry.sequences)
                               for _, entry in self.sessions.items()
                               if entry.sequences.may_hold and not entry.ended),
                             return_exceptions=True)
