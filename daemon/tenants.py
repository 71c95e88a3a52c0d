"""Tenants: who a caller is, what it may open, and what its sessions may hold together.

A tenant has a bearer token (TCP callers send it; it names the tenant), limits over all its
sessions (`max_blocks`: block-table entries, or a contiguous pool's reserved blocks, the
measure of the session quota; `max_sessions`: sessions open at once; 0 = unlimited) and the
prefix-cache salts its sessions may use. Every session belongs to the tenant that opened it,
and counts against that tenant's limits.

Who is calling. The interceptor identifies each call: a TCP caller by its token, a unix-socket
caller as the configured `unix_tenant` ("default" unless set). grpc's Python API does not
expose a unix caller's uid: `context.peer()` is just "unix:" and `auth_context()` holds no
peer credentials (grpc's local credentials do not read SO_PEERCRED), so callers cannot be
told apart by uid; the socket's mode decides who may connect at all. The interceptor puts the
caller in a context variable for the call; the service reads it when a session opens, and
the session registry when a call names a session: a TCP caller naming another tenant's
session gets NOT_FOUND, as for an unknown id. Unix callers may name any session: the
co-located runner acts with its clients' sessions, whatever their tenant.

Cache salts. No salt: the session's own namespace (nothing shared). A tenant configured with
`salts = [...]` may use only those, and they are global: tenants that list the same salt share
its cached blocks. A tenant without `salts` may use any salt, inside its own namespace: its
sessions share with each other, never with another tenant.

The old single `auth_token_file` is the one-tenant shortcut: the "default" tenant, no limits,
any salt in its namespace; unix callers are that tenant too.
"""

import contextlib
import hmac
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .core import PoolError
from .operations import PoolExhausted

if TYPE_CHECKING:
    from .sessions import Session  # sessions.py imports this module at run time

# The tenant of unix callers, and of the single auth_token_file, unless configured otherwise.
DEFAULT_TENANT = "default"
# Tenant names: they appear in metrics labels and logs.
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Keys of a [tenants.NAME] table.
TENANT_KEYS = ("token_file", "max_blocks", "max_sessions", "salts")


class PermissionDenied(PoolError):
    """The caller's tenant may not do this (e.g. use that cache salt)."""


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant as configured ([tenants.NAME] in TOML)."""

    # The tenant's name: metrics label, log field.
    name: str
    # File holding the bearer token its TCP callers send; None: reachable over unix only.
    token_file: Path | None = None
    # Block-table entries over all its sessions; 0 = unlimited.
    max_blocks: int = 0
    # Sessions open at once; 0 = unlimited.
    max_sessions: int = 0
    # Cache salts its sessions may use (global); None: any salt, in its own namespace.
    salts: tuple[str, ...] | None = None


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

    # The tenant the call acts as.
    tenant: Tenant
    # It came over a unix socket (the host's users, the runner), not TCP.
    local: bool


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


def may_use_session_of(tenant: str) -> bool:
    """Whether the current caller may name a session of `tenant` (module docstring)."""
    caller = _CALLER.get()
    return caller is None or caller.local or caller.tenant.name == tenant


class Tenants:
    """The daemon's tenants, by name and by token."""

    def __init__(self, tenants: Iterable[Tenant], unix_tenant: str = DEFAULT_TENANT) -> None:
        self.by_name = {tenant.name: tenant for tenant in tenants}
        self.by_name.setdefault(DEFAULT_TENANT, Tenant(DEFAULT_TENANT))
        # The tenant of unix-socket callers.
        self.unix = self.by_name[unix_tenant]

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

    def for_bearer(self, sent: bytes) -> Tenant | None:
        """The tenant whose "Bearer <token>" was sent, compared in constant time per tenant."""
        found = None
        for tenant in self.by_name.values():
            if tenant.bearer is not None and hmac.compare_digest(sent, tenant.bearer):
                found = tenant
        return found

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
                blocks_held: Callable[[Iterable["Session"]], int]) -> list[TenantFigures]:
        """Every tenant's figures (those without sessions too); `blocks_held` counts the
        distinct blocks of some sessions."""
        return [TenantFigures(
            name=tenant.name, sessions=len(self.sessions.get(tenant.name, ())),
            max_sessions=tenant.max_sessions,
            blocks_held=blocks_held(self.sessions.get(tenant.name, ())),
            block_table_entries=self.entries(tenant.name), max_blocks=tenant.max_blocks)
            for tenant in tenants.by_name.values()]


# ------------------------------------------------------------------ configuration

def parse_tenants(raw: Any) -> tuple[TenantSpec, ...]:
    """The [tenants.NAME] tables of a TOML file; ValueError or TypeError if malformed."""
    if not isinstance(raw, Mapping):
        raise TypeError("expected [tenants.NAME] tables")
    return tuple(_parse_tenant(name, table) for name, table in raw.items())


def _parse_tenant(name: str, table: Any) -> TenantSpec:
    if not isinstance(table, Mapping):
        raise TypeError(f"tenants.{name}: expected a table")
    if "uids" in table:
        raise ValueError(f"tenants.{name}.uids: grpc does not tell the daemon a unix caller's "
                         "uid, so unix callers cannot be mapped by uid; they are all "
                         "`unix_tenant` (the socket's mode decides who may connect)")
    unknown = sorted(set(table) - set(TENANT_KEYS))
    if unknown:
        raise ValueError(f"tenants.{name}: unknown key(s) {', '.join(unknown)}; known: "
                         f"{', '.join(TENANT_KEYS)}")
    salts = table.get("salts")
    if salts is not None and (not isinstance(salts, list)
                              or not all(isinstance(s, str) and s for s in salts)):
        raise TypeError(f"tenants.{name}.salts: expected a list of non-empty strings")
    token_file = table.get("token_file")
    if token_file is not None and not isinstance(token_file, str):
        raise TypeError(f"tenants.{name}.token_file: expected a path")
    return TenantSpec(name=name, token_file=None if token_file is None else Path(token_file),
                      max_blocks=_count(table, name, "max_blocks"),
                      max_sessions=_count(table, name, "max_sessions"),
                      salts=None if salts is None else tuple(salts))


def _count(table: Mapping[str, Any], name: str, key: str) -> int:
    value = table.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"tenants.{name}.{key}: expected an integer >= 0 (0 = unlimited), "
                         f"got {value!r}")
    return value


def check_specs(specs: Iterable[TenantSpec], unix_tenant: str) -> None:
    """Names usable as labels, and unix_tenant naming a tenant; ValueError otherwise."""
    names = {spec.name for spec in specs} | {DEFAULT_TENANT}
    for name in names:
        if not _NAME.match(name):
            raise ValueError(f"tenants.{name}: a tenant name is 1 to 64 letters, digits, "
                             "'_', '.' or '-'")
    if unix_tenant not in names:
        raise ValueError(f"unix_tenant: no tenant named {unix_tenant!r} "
                         f"(tenants: {', '.join(sorted(names))})")


def build_tenants(specs: Iterable[TenantSpec], unix_tenant: str,
                  tokens: Mapping[str, str]) -> Tenants:
    """The run-time tenants from their specs and the tokens read from their files (by name);
    ValueError if two tenants share a token."""
    seen: dict[str, str] = {}
    for name, token in tokens.items():
        if token in seen:
            raise ValueError(f"tenants {seen[token]} and {name} have the same token")
        seen[token] = name
    return Tenants([Tenant(
        spec.name, bearer_of(tokens[spec.name]) if spec.name in tokens else None,
        spec.max_blocks, spec.max_sessions,
        None if spec.salts is None else frozenset(s.encode() for s in spec.salts))
        for spec in specs], unix_tenant)
