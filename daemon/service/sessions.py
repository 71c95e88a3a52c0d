"""Sessions: which client owns which sequences, and the leases that free them when it vanishes.

A session is a lease. Every call that names the session renews it when the call *arrives*,
before it waits for the pool behind other clients' work, and again when it finishes; a session
with a call in flight never expires (the grace for calls queued behind work), nor does one a
runner holds (holds.py: its forward may still write the session's blocks). One that misses
its lease (no call and no KeepAlive within `lease_ttl_ms`) is due, and the service's reaper
frees all its sequences. So a client process that dies never leaks blocks, and a client that
keeps calling is never expired by another client's slow call.

Session ids are credentials: whoever knows one acts for the session. An id reads
`{pool_id}-{number}-{secret}`: the pool id tells a session from before a daemon restart
(FAILED_PRECONDITION) from a mistyped one (NOT_FOUND); the number keys the session's
sequences in the pool; the random secret makes ids unguessable. Ids of recently expired
sessions are remembered (a bounded set) so their owners hear "expired", not "unknown".
Stats and logs name a session by its label `{client_name}#{number}`, never by its id, and
errors name it `#{number}`: an id is neither logged nor echoed back.

Bounds (`Limits`): at most `max_sessions` live sessions; a client_name or session_id over its
byte cap is refused before anything is stored or looked up (a cache_salt is checked as the client
sent it, before its tenant's namespace is added: SessionLife.open); a session's
quota `max_blocks` is the daemon's `max_blocks_per_session` unless the client asks for less.
"""

import re
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import count

from pagedkv.daemon.core import InvalidArgument, PoolError
from pagedkv.daemon.service.errors import LimitExceeded, SessionExpired, SessionNotFound
from pagedkv.daemon.service.fence import RunnerProcess
from pagedkv.daemon.service.limits import Limits, clip
from pagedkv.daemon.service.tenants import DEFAULT_TENANT, may_use_session_of

# Random bytes in the secret part of a session id (64 bits, 16 hex digits).
_SECRET_BYTES = 8
# How many expired ids are remembered to answer FAILED_PRECONDITION instead of NOT_FOUND.
REMEMBERED_EXPIRED_IDS = 4096
# A session id as `open` makes it, "{pool_id}-{number}-{secret}": the daemon run that issued it,
# its number (the one part safe to log), and the secret that makes the id a credential.
SESSION_ID = re.compile(r"^(?P<pool>.+)-(?P<number>[0-9]+)-(?P<secret>[0-9a-f]{16})$")


@dataclass(eq=False, slots=True)
class Session:
    """One client's lease and the sequences it owns."""

    # The credential the client names the session by.
    session_id: str
    # Small integer unique in this daemon run: pool keys are (number, seq_id).
    number: int
    # Free-form name the client gave itself; shown in stats and logs.
    client_name: str
    # The lease granted, and the monotonic time at which it runs out unless renewed.
    lease_ttl_ms: int
    deadline: float
    # Quota on block-table entries over the session's sequences (at most the daemon's
    # max_blocks_per_session).
    max_blocks: int
    # Prefix-cache namespace: only sessions with equal salts share cached blocks.
    salt: bytes
    # The global salt the client asked for when it is one its tenant lists (shared with other
    # tenants listing it: who may commit under it is checked); b"" otherwise.
    shared_salt: bytes = b""
    # The tenant that opened the session: its limits count the session (tenants.py).
    tenant: str = DEFAULT_TENANT
    # Its model's name and number (models.py): its blocks are of that model's format.
    model: str = ""
    model_number: int = 0
    # Put before `salt` where the pool keys prefixes: the model's namespace (models.py).
    salt_tag: bytes = b""
    # Client seq ids of the live sequences.
    seq_ids: set[int] = field(default_factory=set)
    # seq id -> the id of the client's request it serves, for the live sequences given one
    # (AllocateRequest.request_id; a fork's child inherits its parent's): named on log lines
    # about them. Bounded as seq_ids is, each id at most MAX_REQUEST_ID_CHARS.
    request_ids: dict[int, str] = field(default_factory=dict)
    # Block-table entries summed over the live sequences (what max_blocks bounds); in a
    # contiguous pool, their reservations' blocks (the pool's `quota_blocks`).
    table_entries: int = 0
    # Tokens offered for prefix reuse by this session's allocations, and tokens found cached.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Calls naming the session that have arrived and not finished: while any is in flight the
    # session cannot expire.
    in_flight: int = 0
    # Runner holds (holds.py): each holding runner's process (None: code of the daemon's own
    # process) -> the monotonic time its hold lapses. While any holds, no free by another
    # caller and no expiry; a lapsed hold of a live runner holds until the fence ends it.
    holds: dict[RunnerProcess | None, float] = field(default_factory=dict)

    @property
    def private_salt(self) -> bool:
        """Whether the session's prefix-cache namespace is its own (it gave no cache_salt):
        then no one else can ever hit the blocks it leaves cached."""
        return self.salt == private_salt(self.session_id)

    @property
    def label(self) -> str:
        """The name stats and logs use: not the id, which is a credential."""
        return f"{self.client_name}#{self.number}"

    def key(self, seq_id: int) -> tuple[int, int]:
        """The pool's key for one of this session's sequences."""
        return (self.number, seq_id)

    def held(self, now: float, need: str) -> bool:
        """Whether a runner may still write the session's blocks. A hold ends when its runner
        ends it or exits; a lapsed one whose runner is alive is fenced (fence.py) for `need`
        (what wants the blocks), and holds until the runner's exit is seen."""
        for process, until in list(self.holds.items()):
            if process is None:
                if now >= until:  # the daemon's own code: nothing outlives its call
                    del self.holds[process]
            elif not process.alive():
                del self.holds[process]
            elif now >= until:
                process.fence(f"{need} of session {self.label}")
        return bool(self.holds)

    def hold_left_ms(self, now: float) -> int:
        """How long the longest hold still lasts before it lapses (0: lapsed, being fenced)."""
        return max(0, round((max(self.holds.values(), default=now) - now) * 1000))


def private_salt(session_id: str) -> bytes:
    """The cache salt of a session that shares with no one."""
    return b"session:" + session_id.encode()


@dataclass(frozen=True, slots=True)
class SessionStats:
    """Read-only figures of one session, for GetStats and the metrics endpoint."""

    # The session's label, `{client_name}#{number}`.
    name: str
    client_name: str
    # Live sequences.
    num_sequences: int
    # Block-table entries over the live sequences (a shared block counts once per sequence).
    block_table_entries: int
    # Distinct physical blocks those tables reference.
    blocks_held: int
    # The quota and the lease.
    max_blocks: int
    lease_ttl_ms: int
    # Prefix-cache lookups of the session's allocations, in tokens.
    prefix_cache_queries: int
    prefix_cache_hits: int
    # The session's model.
    model: str = ""


class SessionRegistry:
    """Issues session ids, renews leases, and says which sessions are due to expire."""

    def __init__(self, pool_id: str, *, default_lease_ttl_ms: int, max_lease_ttl_ms: int,
                 limits: Limits | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < default_lease_ttl_ms <= max_lease_ttl_ms:
            raise ValueError("need 0 < default_lease_ttl_ms <= max_lease_ttl_ms, got "
                             f"{default_lease_ttl_ms} and {max_lease_ttl_ms}")
        self.pool_id = pool_id
        self.default_lease_ttl_ms = default_lease_ttl_ms
        self.max_lease_ttl_ms = max_lease_ttl_ms
        # Caps on sessions, their names, salts, ids and quotas.
        self.limits = limits or Limits()
        # Expiries so far (a counter for metrics).
        self.expiries_total = 0
        self._clock = clock
        # Where new session ids' secrets come from (a crash log's replay gives the logged ones).
        self.new_secret: Callable[[], str] = lambda: secrets.token_hex(_SECRET_BYTES)
        self._numbers = count(1)
        self._sessions: dict[str, Session] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session: object) -> bool:
        """Whether `session` is live (not closed or expired)."""
        return isinstance(session, Session) and self._sessions.get(session.session_id) is session

    def __iter__(self) -> Iterator[Session]:
        return iter(list(self._sessions.values()))

    def open(self, client_name: str, lease_ttl_ms: int, max_blocks: int,
             cache_salt: bytes, tenant: str = DEFAULT_TENANT,
             shared_salt: bytes = b"", model: tuple[str, int, bytes] = ("", 0, b"")) -> Session:
        """A new session. A zero lease means the default, a long one is clamped to the max;
        a zero quota means max_blocks_per_session, a larger one is clamped to it. `model`:
        its name, number and salt tag."""
        if lease_ttl_ms < 0 or max_blocks < 0:
            raise InvalidArgument(f"lease_ttl_ms ({lease_ttl_ms}) and max_blocks ({max_blocks}) "
                                  "must not be negative")
        limits = self.limits
        limits.check_length("client_name", client_name, "max_client_name_bytes")
        if len(self._sessions) >= limits.max_sessions:
            raise LimitExceeded(f"{len(self._sessions)} sessions are open; the limit is "
                                f"max_sessions={limits.max_sessions}")
        ttl = min(lease_ttl_ms or self.default_lease_ttl_ms, self.max_lease_ttl_ms)
        quota = min(max_blocks or limits.max_blocks_per_session, limits.max_blocks_per_session)
        number = next(self._numbers)
        session_id = f"{self.pool_id}-{number}-{self.new_secret()}"
        # Distinct prefixes keep a client's salt from ever equalling a per-session default.
        salt = b"client:" + cache_salt if cache_salt else private_salt(session_id)
        session = Session(session_id=session_id, number=number, client_name=client_name,
                          lease_ttl_ms=ttl, deadline=self._clock() + ttl / 1000,
                          max_blocks=quota, salt=salt, shared_salt=shared_salt,
                          tenant=tenant, model=model[0], model_number=model[1],
                          salt_tag=model[2])
        self._sessions[session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        """The live session with this id, its lease renewed; raises why there is none.
        A session past its lease with no call in flight is due: refused, never revived."""
        self.limits.check_length("session_id", session_id, "max_session_id_bytes")
        session = self._sessions.get(session_id)
        if session is None or not may_use_session_of(session.tenant):
            raise self._missing(session_id)  # another tenant's session is simply unknown
        now = self._clock()
        if self._is_due(session, now):
            raise SessionExpired(f"session #{session.number} expired: no call or KeepAlive "
                                 "within its lease; open a new session")
        session.deadline = now + session.lease_ttl_ms / 1000
        return session

    def peek(self, session_id: str) -> Session | None:
        """The live session with this id, or None; its lease untouched (for figures)."""
        return self._sessions.get(session_id)

    def arrive(self, session_id: str) -> Session:
        """A call naming the session has arrived: renew the lease and hold it until `depart`."""
        session = self.get(session_id)
        session.in_flight += 1
        return session

    def depart(self, session: Session) -> None:
        """A call that `arrive`d has finished: its lease runs from now."""
        session.in_flight -= 1
        session.deadline = self._clock() + session.lease_ttl_ms / 1000

    def check_live(self, session: Session) -> None:
        """Raise why `session` is gone if it was closed or expired while a call waited."""
        if session not in self:
            raise self._missing(session.session_id)

    def due(self) -> list[Session]:
        """Sessions past their lease with no call in flight and no runner hold: the reaper's to
        expire."""
        now = self._clock()
        return [s for s in self._sessions.values() if self._is_due(s, now)]

    def is_due(self, session: Session) -> bool:
        """Whether `session` is due to expire now (checked again under the pool lock)."""
        return self._is_due(session, self._clock())

    @staticmethod
    def _is_due(session: Session, now: float) -> bool:
        """Past its lease, with no call in flight and no runner holding it (a held session
        waits for its hold to end: a forward may still write its blocks)."""
        return (now > session.deadline and not session.in_flight
                and not session.held(now, "the lease's expiry"))

    def now(self) -> float:
        """The registry's clock (monotonic seconds): what leases and holds are measured by."""
        return self._clock()

    def set_clock(self, clock: Callable[[], float]) -> Callable[[], float]:
        """Measure by `clock` from now on (a crash log's replay runs at each call's time);
        returns the clock it measured by."""
        before, self._clock = self._clock, clock
        return before

    def remove(self, session: Session, *, expired: bool) -> None:
        """Take a session out of the registry (closed, or expired by the reaper); the caller
        frees its sequences, and `reinstate` undoes this if that fails."""
        del self._sessions[session.session_id]
        if expired:
            self._expired[session.session_id] = None
            if len(self._expired) > REMEMBERED_EXPIRED_IDS:
                self._expired.popitem(last=False)
            self.expiries_total += 1

    def reinstate(self, session: Session, expired: bool) -> None:
        """Undo `remove` (the remembered expired id, if evicted meanwhile, is not restored)."""
        self._sessions[session.session_id] = session
        if expired:
            self._expired.pop(session.session_id, None)
            self.expiries_total -= 1

    def readmit(self, session: Session) -> None:
        """Hold `session`, restored from a snapshot (service_image.py) under the id a previous
        run issued; new sessions take numbers past it."""
        assert session.session_id not in self._sessions, "a session restored twice"
        self._sessions[session.session_id] = session
        highest = max(s.number for s in self._sessions.values())
        self._numbers = count(highest + 1)

    def expired_ids(self) -> list[str]:
        """The expired ids remembered, oldest first (bounded: REMEMBERED_EXPIRED_IDS)."""
        return list(self._expired)

    def remember_expired(self, session_ids: list[str], expiries_total: int) -> None:
        """Take a previous run's remembered expired ids and expiry counter (a restore)."""
        for session_id in session_ids[-REMEMBERED_EXPIRED_IDS:]:
            self._expired[session_id] = None
        self.expiries_total = expiries_total

    def _missing(self, session_id: str) -> PoolError:
        """The error for an id that names no live session; it names the session by number,
        never by id (a credential, and input of any length)."""
        if not session_id:
            return InvalidArgument("session_id is empty: open a session first")
        match = SESSION_ID.match(session_id)
        name = f"session #{match['number']}" if match else "session"
        if session_id in self._expired:
            return SessionExpired(f"{name} expired: no call or KeepAlive within its lease; open "
                                  "a new session")
        if match is not None and match["pool"] != self.pool_id:
            return SessionExpired(f"{name} is from pool {clip(match['pool'])}, before a daemon "
                                  f"restart (the pool is now {self.pool_id}); its sequences are "
                                  "gone, open a new session")
        return SessionNotFound(f"unknown {name}: not an id this daemon run issued, or closed")
