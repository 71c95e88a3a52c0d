"""A session's life: opened, renewed, closed, or expired by the lease reaper.

Every session belongs to the tenant of the call that opened it (`tenants.py`: its
max_sessions is checked at open, its cache salts decide the session's namespace) and to one
awake model (`ModelNotFound`, `ModelAsleep`). Any call naming a session renews its lease;
KeepAlive also sets or ends a runner's hold (`holds.py`). A session ends when it is closed
(refused while a runner holds it), when its lease lapses with no call in flight and no hold
(the reaper looks every `REAP_INTERVAL_S`), or when its model is put to sleep: its sequences
are freed all-or-nothing under the pool's lock, and a private session's cached blocks dropped
(`cache_hygiene.py`), their zeroing waited for before the end is answered.
"""

import asyncio
import contextlib

from pagedkv.daemon.service.call_path import CallPath
from pagedkv.daemon.service.errors import ModelAsleep
from pagedkv.daemon.service.holds import NO_HOLD, Hold, apply_hold, check_hold
from pagedkv.daemon.service.memory_order import MemoryWork, Pending
from pagedkv.daemon.service.sessions import Session
from pagedkv.process.log_setup import get_logger
from pagedkv.vocab.request_ids import listed

log = get_logger(__name__)

# How often the reaper looks for lapsed leases: a session is freed within this of its expiry.
REAP_INTERVAL_S = 0.1


class SessionLife:
    """Open, renew, close and expire the pool's sessions (see the module docstring)."""

    def __init__(self, calls: CallPath) -> None:
        self._calls = calls
        self._reaper: asyncio.Task[None] | None = None

    def open(self, client_name: str, lease_ttl_ms: int = 0, max_blocks: int = 0,
             cache_salt: bytes = b"", model: str = "") -> Session:
        """A session of the calling tenant (checked: its max_sessions and salts) and of
        `model` ("" = the daemon's own; ModelNotFound, ModelAsleep)."""
        calls = self._calls
        # The limit counts the bytes the client sent, not the tenant's namespace around them.
        calls.limits.check_length("cache_salt", cache_salt, "max_cache_salt_bytes")
        tenant = calls.tenants.caller_tenant()
        calls.usage.check_open(tenant)
        known = calls.formats.models.get(model)
        if known.asleep:
            raise ModelAsleep(f"model {known.name!r} is asleep: wake it first "
                              f"(pagedkv model wake {known.name})")
        session = calls.sessions.open(client_name, lease_ttl_ms, max_blocks,
                                      tenant.cache_salt(cache_salt), tenant=tenant.name,
                                      shared_salt=tenant.shared_salt(cache_salt),
                                      model=(known.name, known.number, known.salt_tag))
        calls.usage.add(session)
        log.info("session opened", session=session.label, lease_ttl_ms=session.lease_ttl_ms,
                 max_blocks=session.max_blocks, shared_cache=bool(cache_salt),
                 tenant=tenant.name)
        return session

    def keep_alive(self, session_id: str, hold: Hold = NO_HOLD) -> int:
        """Renew the lease (every call does), and set or end a runner's hold as `hold` asks;
        returns the lease in ms."""
        check_hold(hold, self._calls.limits)
        sessions = self._calls.sessions
        session = sessions.get(session_id)
        apply_hold(session, hold, sessions.now())
        return session.lease_ttl_ms

    async def close(self, session_id: str) -> int:
        """Close a session and free its sequences; returns how many were freed."""
        async with self._calls.call(session_id, frees="CloseSession",
                                    record=lambda: ["close", session_id]) as call:
            freed = self.remove(call.session, call.work, expired=False)
            log.info("session closed", session=call.session.label, freed_sequences=freed)
        return freed

    def drop(self, session: Session, *, expired: bool) -> tuple[int, Pending]:
        """`remove` a session under the lock, its memory work started; returns how many
        sequences it had, and the memory work to wait for (zeroing)."""
        calls = self._calls
        calls.memory_order.check()
        work = MemoryWork()
        count = self.remove(session, work, expired=expired)
        return count, calls.start_work(calls.model_of(session).format, work, tuple)

    def remove(self, session: Session, work: MemoryWork, *, expired: bool) -> int:
        """Remove a session and free its sequences, all-or-nothing, their memory work added
        to `work`; returns how many. The caller holds the lock."""
        calls = self._calls
        count = len(session.seq_ids)
        fmt = calls.model_of(session).format
        with fmt.pool.transaction() as journal:
            calls.sessions.remove(session, expired=expired)
            journal.record(calls.sessions.reinstate, session, expired)
            calls.usage.remove(session)
            journal.record(calls.usage.add, session)
            with fmt.hygiene.watch(session, work):
                for seq_id in list(session.seq_ids):
                    fmt.ops.free(session, seq_id, work)
            fmt.hygiene.session_ended(session, work)
        return count

    # ---------------------------------------------------------------- leases

    async def start(self) -> None:
        """Start the lease reaper (idempotent)."""
        if self._reaper is None:
            self._reaper = asyncio.create_task(self._reap_forever(), name="pagedkv-lease-reaper")

    async def stop(self) -> None:
        """Stop the lease reaper; sessions stay as they are."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
            self._reaper = None

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            await self.expire_due()

    async def expire(self, session_id: str) -> None:
        """Expire the session now, as the reaper did (a crash log's replay)."""
        calls = self._calls
        session = calls.sessions.peek(session_id)
        if session is None:
            raise ValueError(f"no session {session_id} to expire")
        async with calls.lock:
            _freed, pending = self._drop_expired(session)
        await pending.wait()

    def _drop_expired(self, session: Session) -> tuple[int, Pending]:
        """`drop` a session whose lease lapsed (under the lock), written to the crash log."""
        dropped = self.drop(session, expired=True)
        self._calls.note(lambda: ["expire", session.session_id])
        return dropped

    async def expire_due(self) -> int:
        """Expire every session past its lease with no call in flight; returns how many."""
        expired, calls = 0, self._calls
        if calls.memory_order.failure is not None:
            return 0  # fail-stop: the pool changes no more
        for session in calls.sessions.due():
            try:
                async with calls.lock:
                    if session not in calls.sessions or not calls.sessions.is_due(session):
                        continue  # a call or a hold arrived, or it closed, while we waited
                    request_ids = listed(session.request_ids.values())  # before the frees
                    freed, pending = self._drop_expired(session)
                await pending.wait()
            except Exception:  # the reaper must outlive any failure of one expiry
                log.exception("lease expiry failed", session=session.label)
                continue
            expired += 1
            log.info("session expired", session=session.label, freed_sequences=freed,
                     lease_ttl_ms=session.lease_ttl_ms, request_ids=request_ids)
        return expired
