"""The [tenants.NAME] tables of the daemon's TOML file: parsed, checked, built into `Tenants`.

Every error names the key (`tenants.alice.certifies: ...`), so a bad table stops the daemon
at start with a message saying what to fix; tenants.py says what each key means at run time.
"""
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.daemon.service.tenants import (
    DEFAULT_TENANT,
    MAX_UID,
    UNMAPPED_UIDS,
    Tenant,
    Tenants,
    bearer_of,
)

# Tenant names: they appear in metrics labels and logs.
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# Keys of a [tenants.NAME] table.
TENANT_KEYS = ("token_file", "uids", "max_blocks", "max_sessions", "salts", "certifies",
               "public_salts")


@dataclass(frozen=True, slots=True)
class TenantSpec:
    """One tenant as configured ([tenants.NAME] in TOML)."""

    # The tenant's name: metrics label, log field.
    name: str
    # File holding the bearer token its TCP callers send; None: reachable over unix only.
    token_file: Path | None = None
    # Uids of the local users whose unix-socket calls act as this tenant (none: by uid, no one).
    uids: tuple[int, ...] = ()
    # Block-table entries over all its sessions; 0 = unlimited.
    max_blocks: int = 0
    # Sessions open at once; 0 = unlimited.
    max_sessions: int = 0
    # Cache salts its sessions may use (global); None: any salt, in its own namespace.
    salts: tuple[str, ...] | None = None
    # Those of its salts under which its own sessions may commit K/V that other tenants
    # listing the salt will read (a subset of salts).
    certifies: tuple[str, ...] = ()
    # Those of its salts whose blocks the KV events publish, token ids included (the event
    # stream is unauthenticated): every tenant listing such a salt marks it (check_specs).
    public_salts: tuple[str, ...] = ()


def parse_tenants(raw: Any) -> tuple[TenantSpec, ...]:
    """The [tenants.NAME] tables of a TOML file; ValueError or TypeError if malformed."""
    if not isinstance(raw, Mapping):
        raise TypeError("expected [tenants.NAME] tables")
    return tuple(_parse_tenant(name, table) for name, table in raw.items())


def _parse_tenant(name: str, table: Any) -> TenantSpec:
    if not isinstance(table, Mapping):
        raise TypeError(f"tenants.{name}: expected a table")
    unknown = sorted(set(table) - set(TENANT_KEYS))
    if unknown:
        raise ValueError(f"tenants.{name}: unknown key(s) {', '.join(unknown)}; known: "
                         f"{', '.join(TENANT_KEYS)}")
    salts = table.get("salts")
    if salts is not None and (not isinstance(salts, list)
                              or not all(isinstance(s, str) and s for s in salts)):
        raise TypeError(f"tenants.{name}.salts: expected a list of non-empty strings")
    certifies = _some_salts(table, name, "certifies", salts)
    public_salts = _some_salts(table, name, "public_salts", salts)
    token_file = table.get("token_file")
    if token_file is not None and not isinstance(token_file, str):
        raise TypeError(f"tenants.{name}.token_file: expected a path")
    return TenantSpec(name=name, token_file=None if token_file is None else Path(token_file),
                      uids=_uids(table, name),
                      max_blocks=_count(table, name, "max_blocks"),
                      max_sessions=_count(table, name, "max_sessions"),
                      salts=None if salts is None else tuple(salts), certifies=certifies,
                      public_salts=public_salts)


def _some_salts(table: Mapping[str, Any], name: str, key: str,
                salts: list[str] | None) -> tuple[str, ...]:
    """The tenant's `certifies` or `public_salts`: some of its `salts` (absent: none)."""
    chosen = table.get(key, [])
    if not isinstance(chosen, list) or not all(isinstance(s, str) for s in chosen):
        raise TypeError(f"tenants.{name}.{key}: expected a list of salts, got {chosen!r}")
    outside = [salt for salt in chosen if salt not in (salts or ())]
    if outside:
        raise ValueError(f"tenants.{name}.{key}: {outside[0]!r} is not in "
                         f"tenants.{name}.salts; {key} names global salts the tenant uses")
    return tuple(chosen)


def _count(table: Mapping[str, Any], name: str, key: str) -> int:
    value = table.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"tenants.{name}.{key}: expected an integer >= 0 (0 = unlimited), "
                         f"got {value!r}")
    return value


def _uids(table: Mapping[str, Any], name: str) -> tuple[int, ...]:
    """The tenant's `uids`: a non-empty list of distinct uids (absent: none)."""
    if "uids" not in table:
        return ()
    uids = table["uids"]
    if (not isinstance(uids, list) or not uids
            or not all(isinstance(u, int) and not isinstance(u, bool) for u in uids)):
        raise TypeError(f"tenants.{name}.uids: expected a non-empty list of uids (integers), "
                        f"got {uids!r}")
    for uid in uids:
        if not 0 <= uid <= MAX_UID:
            raise ValueError(f"tenants.{name}.uids: {uid} is not a uid (0..{MAX_UID})")
    if len(set(uids)) != len(uids):
        raise ValueError(f"tenants.{name}.uids: a uid is listed twice")
    return tuple(uids)


def check_specs(specs: Iterable[TenantSpec], unix_tenant: str, unmapped_uids: str) -> None:
    """Names usable as labels, unix_tenant naming a tenant, each uid in one tenant at most and
    a known unmapped_uids; ValueError otherwise."""
    names = {spec.name for spec in specs} | {DEFAULT_TENANT}
    for name in names:
        if not _NAME.match(name):
            raise ValueError(f"tenants.{name}: a tenant name is 1 to 64 letters, digits, "
                             "'_', '.' or '-'")
    if unix_tenant not in names:
        raise ValueError(f"unix_tenant: no tenant named {unix_tenant!r} "
                         f"(tenants: {', '.join(sorted(names))})")
    owners: dict[int, str] = {}
    for spec in specs:
        for uid in spec.uids:
            if uid in owners:
                raise ValueError(f"uid {uid} is in the uids of tenants {owners[uid]} and "
                                 f"{spec.name}: a unix caller has one tenant")
            owners[uid] = spec.name
    _check_public_salts(specs)
    if unmapped_uids not in UNMAPPED_UIDS:
        raise ValueError(f"unmapped_uids: expected one of {', '.join(UNMAPPED_UIDS)}, "
                         f"got {unmapped_uids!r}")


def _check_public_salts(specs: Iterable[TenantSpec]) -> None:
    """A salt is public for every tenant listing it or for none: its blocks are shared, so
    whose prompt a published block came from cannot be told apart."""
    marked = {salt: spec.name for spec in specs for salt in spec.public_salts}
    for spec in specs:
        for salt in spec.salts or ():
            if salt in marked and salt not in spec.public_salts:
                raise ValueError(
                    f"tenants.{marked[salt]}.public_salts: {salt!r} is also in "
                    f"tenants.{spec.name}.salts, which does not mark it public: a salt's "
                    f"blocks are published for every tenant sharing it or for none (add it "
                    f"to tenants.{spec.name}.public_salts, or remove it)")


def build_tenants(specs: Iterable[TenantSpec], unix_tenant: str, unmapped_uids: str,
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
        None if spec.salts is None else frozenset(s.encode() for s in spec.salts),
        frozenset(spec.uids), frozenset(s.encode() for s in spec.certifies),
        frozenset(s.encode() for s in spec.public_salts))
        for spec in specs], unix_tenant, unmapped_uids)
