"""What the runner keeps per client session, bounded: forgotten when the session ends.

    sessions = SessionTable()
    entry = sessions.enter(session_id)      # counted as in use
    async with entry.lock: ...              # one step at a time per session
    sessions.leave(session_id, entry)       # forgotten if it ended or holds nothing

The runner learns a session from its first step and needs nothing of it between steps but the
state of its sequences (their tokens, tables and sampling parameters), which it can always
learn again (a client resends a sequence's history and sampling, the history checked against the
daemon's). So an entry goes as soon as nothing uses it and the session ended
(the daemon answered that it is gone), or the client released every sequence; and idle entries
past `max_idle` go least recently used first. The table so never grows with the number of
session ids a runner has seen, only with the sessions in use.
"""

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, field

from pagedkv.model_runner.engine.sequences import SessionSequences

# Idle sessions kept at most (their sequences' states); past it the least recently used is
# forgotten, and its next step resends histories (recomputing what is not committed).
MAX_IDLE_SESSIONS = 4096


@dataclass
class SessionEntry:
    """One client session as the runner keeps it."""

    # Its sequences as the runner knows them.
    sequences: SessionSequences = field(default_factory=SessionSequences)
    # One step at a time per session: its sequences' states must not race. A step decoded
    # ahead holds it until its forward is done, so every later step (and release) waits.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    # Steps that hold or wait for the lock (a step decoded ahead counts): kept while > 0.
    users: int = 0
    # The daemon answered that the session is gone (closed, expired, unknown).
    ended: bool = False


class SessionTable:
    """The runner's sessions by id, least recently used first."""

    def __init__(self, max_idle: int = MAX_IDLE_SESSIONS) -> None:
        self.max_idle = max_idle
        self._entries: OrderedDict[str, SessionEntry] = OrderedDict()
        # Each session's model per the daemon (SessionStats.model: a session's model never
        # changes), least recently used first: kept past its entry, which goes whenever the
        # session holds no sequence (between two requests), for at most max_idle sessions.
        self._models: OrderedDict[str, str] = OrderedDict()

    def model(self, session_id: str) -> str | None:
        """The session's model if known."""
        model = self._models.get(session_id)
        if model is not None:
            self._models.move_to_end(session_id)
        return model

    def learn_model(self, session_id: str, model: str) -> None:
        """Keep the session's model, as the daemon told it."""
        self._models[session_id] = model
        self._models.move_to_end(session_id)
        while len(self._models) > self.max_idle:
            self._models.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, session_id: str) -> SessionEntry | None:
        """The session's entry if kept (not counted as in use, not moved)."""
        return self._entries.get(session_id)

    def items(self) -> list[tuple[str, SessionEntry]]:
        """Every kept session's id and entry."""
        return list(self._entries.items())

    def enter(self, session_id: str) -> SessionEntry:
        """The session's entry (a new one for a session not kept), in use until `leave`."""
        entry = self._entries.get(session_id)
        if entry is None:
            entry = self._entries[session_id] = SessionEntry()
            self._sweep()
        else:
            self._entries.move_to_end(session_id)
        entry.users += 1
        return entry

    def leave(self, session_id: str, entry: SessionEntry) -> None:
        """A step is done with the session (its lock let go): forget it if nothing else uses
        it and it ended, or holds no sequence the runner knows and no hold the runner must end
        (holds.py ends it under the entry's lock)."""
        entry.users -= 1
        known = entry.sequences
        if (entry.users == 0 and (entry.ended or not (known.seqs or known.may_hold))
                and self._entries.get(session_id) is entry):
            del self._entries[session_id]
            if entry.ended:
                self._models.pop(session_id, None)
        self._sweep()  # an entry kept past max_idle while it held goes once its hold ended

    def forget(self, session_id: str) -> None:
        """Drop the session's entry (what the daemon holds of it is unknown: a call's answer was
        lost); a step still using it goes on with it, and the next step reads back."""
        self._entries.pop(session_id, None)

    def forget_all(self) -> None:
        """Drop every entry (the daemon restarted: its sessions are gone)."""
        self._entries.clear()
        self._models.clear()

    def _sweep(self) -> None:
        """Forget the least recently used idle entries past max_idle."""
        excess = len(self._entries) - self.max_idle
        idle: list[str] = []
        for session_id, entry in self._entries.items():
            if len(idle) >= excess:
                break
            if entry.users == 0 and not entry.sequences.may_hold:  # its hold ends first
                idle.append(session_id)
        for session_id in idle:
            del self._entries[session_id]
