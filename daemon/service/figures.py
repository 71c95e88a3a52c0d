"""The service's figures (a session's, each tenant's), and the checks that recount them.

GetStats shows any caller the pool's capacity (num_blocks, block_size, free_blocks) and nothing
of other sessions' activity; per-session figures only for the caller's own session (session
ids are credentials, so no RPC lists other sessions). Operators get every figure from the
metrics endpoint. Each pool counts the blocks each session, each tenant and each model holds
(its holder groups, `CallPath.groups`), so GetStats and /metrics cost O(sessions), not
O(table entries); `check_invariants` recounts them from the tables (for tests).
"""

from collections.abc import Iterable

from pagedkv.daemon.service.call_path import CallPath
from pagedkv.daemon.service.models import Format
from pagedkv.daemon.service.sessions import Session, SessionStats
from pagedkv.daemon.service.tenants import TenantFigures


class ServiceFigures:
    """Figures read from the service's records and the pools' group counts."""

    def __init__(self, calls: CallPath) -> None:
        self._calls = calls

    def stats_of(self, session_id: str) -> SessionStats:
        """One session's figures (renews its lease, like any call naming it)."""
        session = self._calls.sessions.get(session_id)
        pool = self._calls.model_of(session).format.pool
        return SessionStats(
            name=session.label, client_name=session.client_name,
            num_sequences=len(session.seq_ids), block_table_entries=session.table_entries,
            blocks_held=pool.blocks_held(0, session.number), max_blocks=session.max_blocks,
            lease_ttl_ms=session.lease_ttl_ms, prefix_cache_queries=session.prefix_cache_queries,
            prefix_cache_hits=session.prefix_cache_hits, model=session.model)

    def free_blocks_for(self, session_id: str) -> int:
        """What answers of a call of this session report as free: blocks of its model's
        format a call could surely get now (Formats.free_blocks); format 0's free blocks when
        the session is unknown (the call failed) or the pool has one format."""
        session = self._calls.sessions.peek(session_id)
        formats = self._calls.formats
        if session is None or len(formats.models.formats) == 1:
            return formats.models.formats[0].pool.num_free_blocks
        return formats.free_blocks(self._calls.model_of(session))

    def tenant_figures(self) -> list[TenantFigures]:
        """Every tenant's sessions and blocks (over every format), for the metrics endpoint."""
        return self._calls.usage.figures(self._calls.tenants, self._calls.tenant_blocks)

    def recount_held(self, sessions: Iterable[Session]) -> int:
        """Distinct blocks the sessions' sequences reference, from their tables (checks)."""
        held: set[tuple[int, int]] = set()
        for session in sessions:
            fmt = self._calls.model_of(session).format
            for seq_id in session.seq_ids:
                held.update((fmt.number, b) for b in fmt.pool.held_blocks(session.key(seq_id)))
        return len(held)

    def check_invariants(self) -> None:
        """Assert the pools' invariants and that sessions, pools, models and tenants agree."""
        calls = self._calls
        calls.formats.pages.check()
        for model in calls.formats.models:
            mine = [s for s in calls.sessions if s.model == model.name]
            assert model.format.pool.blocks_held(2, model.number) == self.recount_held(mine), \
                f"model {model.name}: used blocks differ from a recount"
        for fmt in calls.formats.models.formats:
            fmt.pool.check_invariants()
            mine = [s for s in calls.sessions if calls.model_of(s).format is fmt]
            self._check_sessions(fmt, mine)
            fmt.hygiene.check({session.number for session in mine})
        by_tenant = {name: set(sessions) for name, sessions in calls.usage.sessions.items()
                     if sessions}
        assert by_tenant == {name: {s for s in calls.sessions if s.tenant == name}
                             for name in {s.tenant for s in calls.sessions}}, \
            "the tenants' session sets disagree with the live sessions"
        for figures in self.tenant_figures():
            assert figures.blocks_held == self.recount_held(by_tenant.get(figures.name, ())), \
                f"tenant {figures.name}: blocks_held differs from a recount"

    def _check_sessions(self, fmt: Format, sessions: list[Session]) -> None:
        """Assert that `sessions` (those of `fmt`) and fmt's pool agree."""
        live = 0
        for session in sessions:
            keys = [session.key(seq_id) for seq_id in session.seq_ids]
            assert all(k in fmt.pool for k in keys), f"{session.label} lost a sequence"
            entries = sum(fmt.pool.quota_of(k) for k in keys)
            assert entries == session.table_entries, (
                f"{session.label} counts {session.table_entries} quota blocks, holds {entries}")
            assert fmt.pool.blocks_held(0, session.number) == self.recount_held([session]), \
                f"{session.label}: blocks_held differs from a recount"
            live += len(keys)
        assert live == len(fmt.pool), "the pool holds sequences of no live session"
