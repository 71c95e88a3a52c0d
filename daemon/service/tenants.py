"""Tenants: who a caller is, what it may open, and what its sessions may hold together.

A tenant has a bearer token (TCP callers send it; it names the tenant), the uids of the local
users whose unix-socket calls are its own, limits over all its sessions (`max_blocks`:
block-table entries, or a contiguous pool's reserved blocks, the measure of the session quota;
`max_sessions`: sessions open at once; 0 = unlimited), the prefix-cache salts its sessions
may use and those of them it certifies. Every session belongs to the tenant that opened it,
and counts against that tenant's limits.

Who is calling. The interceptor identifies each call: a TCP caller by its token; a unix-socket
caller by its uid when some tenant lists `uids`, else as the configured `unix_tenant`
("default" unless set). grpc's Python API does not expose a unix caller's uid
(`context.peer()` is "unix:" plus the address the caller's socket was bound to, and the auth
context holds no peer credentials), so when a tenant lists uids the public unix socket is
served by the peer-credential gate (peer_gate.py), which reads each connection's uid
(SO_PEERCRED) and hands it to gRPC as the name of the connection's peer. A uid no tenant lists
is refused (the gate closes its connections at accept; the interceptor's PERMISSION_DENIED is
the second check), or is `unix_tenant` with `unmapped_uids = "unix_tenant"`. Who
may connect at all is still the socket's mode. The interceptor puts the caller in a context
variable for the call; the service reads it when a session opens, and the session registry
when a call names a session: a caller naming another tenant's session gets NOT_FOUND, as for
an unknown id.

Runners. The daemon's runner socket (`runner_socket`, its mode and `runner_group` say who may
connect) serves runners: the processes that compute K/V into the pool. A runner may name any
session whose id it holds (it acts for its clients, whatever their tenant), may commit under
any salt, and alone gets the pool memory's handle from GetPoolInfo. Every other caller, unix
or TCP, is a tenant's client.

Cache salts. No salt: the session's own namespace (nothing shared). A tenant configured with
`salts = [...]` may use only those, and they are global: tenants that list the same salt share
its cached blocks. A tenant without `salts` may use any salt, inside its own namespace: its
sessions share with each other, never with another tenant.

Who may commit. A commit certifies that blocks hold the K/V of their tokens; other sessions
under the same salt are then served that memory. Under a global salt that another tenant also
lists, a session's commit (Commit, a Batch commit op, StepRequest.commit) is refused
(PermissionDenied, nothing changed) unless the caller is a runner or the session's tenant
`certifies` that salt: sharing a salt is a statement of trust, and certifying says which
tenants' clients the others trust to tell the truth about K/V. Private, namespaced and
single-tenant salts are unaffected: a wrong commit there misleads only its own tenant.

Which salts are published. The KV event stream is unauthenticated and carries token ids, so
it publishes a global salt's blocks only when the operator marks the salt public
(`public_salts`, every tenant listing it alike); listing a salt, even by one tenant only,
does not publish it (daemon/service/kv_events.py).

The old single `auth_token_file` is the one-tenant shortcut: the "default" tenant, no limits,
any salt in its namespace; unix callers are that tenant too. The [tenants.NAME] settings are
read and checked in tenant_config.py.
"""
import contextlib
import hmac
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedkv.daemon.service.errors import PermissionDenied, PoolExhausted
from pagedkv.daemon.service.fence import RunnerProcess

if TYPE_CHECKING:
    from pagedkv.daemon.service.sessions import (
        Session,  # sessions.py imports this module at run time
    )

# The tenant of unix callers, and of the single auth_token_file, unless configured otherwise.
DEFAULT_TENANT = "default"
# What a unix caller whose uid no tenant lists gets (the `unmapped_uids` setting): refused, or
# the unix tenant.
UNMAPPED_UIDS = ("refuse", "unix_tenant")
# The largest uid: (uid_t)-1 means "no uid" to the kernel.
MAX_UID = 2**32 - 2


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant at run time: its spec with the token read."""

    # The tenant's name: metrics label, log field.
    name: str
    # "Bearer <token>" as TCP callers send it; None: no TCP caller is this tenant.
    bearer: bytes | None = None
    # Block-table entries over all its sessions, and sessions open at once; 0 = unlimited.
    max_blocks: int = 0
    max_sessions: int = 0
    # Cache salts it may use (global); None: any salt, in its own namespace.
    salts: frozenset[bytes] | None = None
    # Uids whose unix-socket calls act as this tenant.
    uids: frozenset[int] = frozenset()
    # Global salts under which its sessions may commit though other tenants list them.
    certifies: frozenset[bytes] = frozenset()
    # Global salts whose blocks the KV events publish (kv_events.py): the operator's mark.
    public_salts: frozenset[bytes] = frozenset()

    def shared_salt(self, requested: bytes) -> bytes:
        """The global salt `requested` is for this tenant's sessions (one of its `salts`), or
        b"" when it is private or in its own namespace."""
        return requested if self.salts is not None else b""

    def cache_salt(self, requested: bytes) -> bytes:
        """The salt a session of this tenant gets for `requested` (b"": its own namespace);
        PermissionDenied for a salt it may not use."""
        if not requested:
            return b""
        if self.salts is None:
            return b"tenant:" + self.name.encode() + b"\0" + requested
        if requested not in self.salts:
            raise PermissionDenied(f"tenant {self.name} may not use cache salt {requested!r}; "
                                   "its salts are set in the daemon's [tenants] config")
        return b"shared:" + requested


@dataclass(frozen=True, slots=True)
class Caller:
    """Who makes the call being served."""

    # The tenant the call acts as (a runner's: the unix tenant, for sessions it opens).
    tenant: Tenant
    # It came over the daemon's runner socket: a runner (module docstring).
    runner: bool = False
    # A runner's process, from the runner socket's peer credentials (fence.py); None: one the
    # daemon cannot see (another pid namespace), which may not hold sessions.
    process: RunnerProcess | None = None


# The caller of the RPC being served; None outside the gRPC server (in-process use, tests).
_CALLER: ContextVar[Caller | None] = ContextVar("pagedkv_caller", default=None)


@contextlib.contextmanager
def calling_as(caller: Caller) -> Iterator[None]:
    """Serve the code inside as a call of `caller`."""
    token = _CALLER.set(caller)
    try:
        yield
    finally:
        _CALLER.reset(token)


def current_caller() -> Caller | None:
    return _CALLER.get()


def trusted_caller() -> bool:
    """Whether the current caller is a runner, or code of the daemon's own process (no call)."""
    caller = _CALLER.get()
    return caller is None or caller.runner


def may_use_session_of(tenant: str) -> bool:
    """Whether the current caller may name a session of `tenant` (module docstring)."""
    caller = _CALLER.get()
    return caller is None or caller.runner or caller.tenant.name == tenant


class Tenants:
    """The daemon's tenants, by name, by token and by uid."""

    def __init__(self, tenants: Iterable[Tenant], unix_tenant: str = DEFAULT_TENANT,
                 unmapped_uids: str = "refuse") -> None:
        self.by_name = {tenant.name: tenant for tenant in tenants}
        self.by_name.setdefault(DEFAULT_TENANT, Tenant(DEFAULT_TENANT))
        # The tenant of unix-socket callers when no tenant lists uids.
        self.unix = self.by_name[unix_tenant]
        # Uid -> the tenant listing it (check_specs makes each uid listed once).
        self.by_uid = {uid: tenant for tenant in self.by_name.values() for uid in tenant.uids}
        assert len(self.by_uid) == sum(len(t.uids) for t in self.by_name.values()), \
            "a uid in two tenants"
        # The tenant of a unix caller whose uid no tenant lists; None: refused.
        self.unmapped = self.unix if unmapped_uids == "unix_tenant" else None
        # Global salt -> the tenants listing it.
        self.salt_users: dict[bytes, set[str]] = {}
        for tenant in self.by_name.values():
            for salt in tenant.salts or ():
                self.salt_users.setdefault(salt, set()).add(tenant.name)

    @property
    def public_salts(self) -> frozenset[bytes]:
        """The global salts marked public (tenant_config.py makes every tenant listing one
        mark it): the only salts whose blocks the KV events publish by default."""
        return frozenset(salt for tenant in self.by_name.values()
                         for salt in tenant.public_salts)

    @classmethod
    def single(cls, token: str | None) -> "Tenants":
        """One tenant, "default", with `token` for TCP callers (the auth_token_file shortcut)."""
        return cls([Tenant(DEFAULT_TENANT, bearer_of(token) if token else None)])

    @property
    def default(self) -> Tenant:
        """The tenant of sessions opened outside any call (in-process use)."""
        return self.by_name[DEFAULT_TENANT]

    @property
    def any_token(self) -> bool:
        return any(tenant.bearer is not None for tenant in self.by_name.values())

    @property
    def maps_uids(self) -> bool:
        """Whether unix callers are told apart by uid (then the peer-credential gate serves
        the unix sockets)."""
        return bool(self.by_uid)

    def sharing(self) -> set[str]:
        """The tenants whose sessions may share this daemon's pool: each with a token or
        uids, the unix tenant (unix callers and runners' sessions act as it), and every tenant
        listing a global salt another also lists."""
        names = {tenant.name for tenant in self.by_name.values()
                 if tenant.bearer is not None or tenant.uids}
        names.add(self.unix.name)
        for users in self.salt_users.values():
            if len(users) > 1:
                names |= users
        return names

    def for_uid(self, uid: int) -> Tenant | None:
        """The tenant of a unix caller with `uid`: the tenant listing it, else the unmapped
        uids' tenant; None: refused."""
        return self.by_uid.get(uid, self.unmapped)

    def for_bearer(self, sent: bytes) -> Tenant | None:
        """The tenant whose "Bearer <token>" was sent, compared in constant time per tenant."""
        found = None
        for tenant in self.by_name.values():
            if tenant.bearer is not None and hmac.compare_digest(sent, tenant.bearer):
                found = tenant
        return found

    def check_commit(self, tenant: str, shared_salt: bytes) -> None:
        """Refuse a commit by the current caller on a session of `tenant` under global salt
        `shared_salt` (b"": none) unless it may certify K/V there (module docstring)."""
        if not shared_salt or trusted_caller():
            return
        if shared_salt in self.by_name[tenant].certifies:
            return
        if self.salt_users.get(shared_salt, set()) <= {tenant}:
            return  # no other tenant reads what is committed under it
        raise PermissionDenied(
            f"tenant {tenant} may not commit K/V under cache salt {shared_salt!r}: other "
            f"tenants list it, and tenants.{tenant}.certifies in the daemon's config does not; "
            "only a runner that computed the blocks, or a certifying tenant, may commit there")

    def caller_tenant(self) -> Tenant:
        """The tenant of the call being served (the default tenant outside a call)."""
        caller = _CALLER.get()
        return self.default if caller is None else caller.tenant


def bearer_of(token: str) -> bytes:
    return f"Bearer {token}".encode()


@dataclass(frozen=True, slots=True)
class TenantFigures:
    """One tenant's figures for the metrics endpoint."""

    # The tenant's name (the metrics label).
    name: str
    # Sessions open now, and the tenant's cap on them (0 = unlimited).
    sessions: int
    max_sessions: int
    # Distinct physical blocks its sessions' sequences reference.
    blocks_held: int
    # Block-table entries over its sessions, and its cap on them (0 = unlimited).
    block_table_entries: int
    max_blocks: int


@dataclass(slots=True)
class TenantUsage:
    """The live sessions of each tenant, to enforce its limits and report its figures."""

    # Tenant name -> its live sessions.
    sessions: dict[str, set["Session"]] = field(default_factory=dict)

    def check_open(self, tenant: Tenant) -> None:
        """Refuse a new session beyond the tenant's max_sessions."""
        open_now = len(self.sessions.get(tenant.name, ()))
        if tenant.max_sessions and open_now >= tenant.max_sessions:
            raise PoolExhausted(f"tenant {tenant.name} has {open_now} sessions open, its "
                                f"max_sessions; close one first")

    def add(self, session: "Session") -> None:
        self.sessions.setdefault(session.tenant, set()).add(session)

    def remove(self, session: "Session") -> None:
        self.sessions.get(session.tenant, set()).discard(session)

    def entries(self, tenant: str) -> int:
        """Block-table entries over the tenant's live sessions."""
        return sum(session.table_entries for session in self.sessions.get(tenant, ()))

    def check_blocks(self, tenant: Tenant) -> None:
        """Refuse a state where the tenant's sessions hold more than its max_blocks (called
        after a change, inside its transaction: raising undoes the change)."""
        if tenant.max_blocks:
            held = self.entries(tenant.name)
            if held > tenant.max_blocks:
                raise PoolExhausted(f"tenant quota: the call would bring tenant {tenant.name} "
                                    f"to {held} blocks, over its max_blocks={tenant.max_blocks}")

    def figures(self, tenants: Tenants,
                blocks_held: Callable[[str], int]) -> list[TenantFigures]:
        """Every tenant's figures (those without sessions too); `blocks_held` gives the
        distinct blocks a tenant's sequences reference. O(tenants + sessions)."""
        return [TenantFigures(
            name=tenant.name, sessions=len(self.sessions.get(tenant.name, ())),
            max_sessions=tenant.max_sessions,
            blocks_held=blocks_held(tenant.name),
            block_table_entries=self.entries(tenant.name), max_blocks=tenant.max_blocks)
            for tenant in tenants.by_name.values()]
