"""The access settings read into what the server uses: tenants and their tokens, the runner
group, the public sockets' mode and the TCP listeners' TLS.

Each function takes the settings it reads (DaemonConfig's fields; config.py calls them when
the config is built and when the server asks) and raises a `ConfigError` naming the setting,
so a token file nobody may read or a group that does not exist stops the daemon at start.
"""

import grp
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from pagedkv.daemon.edge.tls import ServerTls, load_server_tls
from pagedkv.daemon.process.settings import ConfigError
from pagedkv.daemon.process.tenant_config import TenantSpec, build_tenants, check_specs
from pagedkv.daemon.service.tenants import DEFAULT_TENANT, Tenants

# Permission bits for "every local user": refused on the socket and on the pool file.
WORLD_BITS = 0o007


def read_auth_token(path: Path, key: str = "auth_token_file") -> str:
    """The token in `path` (surrounding whitespace dropped); ConfigError naming the setting
    `key` if unusable."""
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{key}: cannot read {path}: {exc.strerror}") from exc
    if not token:
        raise ConfigError(f"{key}: {path} is empty")
    if path.stat().st_mode & 0o004:
        raise ConfigError(f"{key}: {path} is readable by every user; chmod o-r it")
    return token


def tenant_specs(tenants: tuple[TenantSpec, ...],
                 auth_token_file: Path | None) -> tuple[TenantSpec, ...]:
    """The configured tenants, with auth_token_file as the "default" tenant's token."""
    if auth_token_file is None:
        return tenants
    if any(spec.name == DEFAULT_TENANT for spec in tenants):
        raise ConfigError("auth_token_file is the default tenant's token: give it there or "
                          "as [tenants.default] token_file, not both")
    return (*tenants, TenantSpec(DEFAULT_TENANT, token_file=auth_token_file))


def _token_key(spec: TenantSpec, auth_token_file: Path | None) -> str:
    """The setting that names a tenant's token file, for error messages."""
    if spec.name == DEFAULT_TENANT and spec.token_file == auth_token_file:
        return "auth_token_file"
    return f"tenants.{spec.name}.token_file"


def load_tenants(tenants: tuple[TenantSpec, ...], auth_token_file: Path | None,
                 unix_tenant: str, unmapped_uids: str) -> Tenants:
    """The run-time tenants, their tokens read from their files."""
    specs = tenant_specs(tenants, auth_token_file)
    try:
        check_specs(specs, unix_tenant, unmapped_uids)
        tokens = {spec.name: read_auth_token(spec.token_file, _token_key(spec, auth_token_file))
                  for spec in specs if spec.token_file is not None}
        return build_tenants(specs, unix_tenant, unmapped_uids, tokens)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc


def group_id(runner_group: str | None) -> int | None:
    """The gid of runner_group (a name or a gid); None without one."""
    if runner_group is None:
        return None
    if runner_group.isdigit():
        return int(runner_group)
    try:
        return grp.getgrnam(runner_group).gr_gid
    except KeyError:
        raise ConfigError(f"runner_group: no group named {runner_group!r}") from None


def check_runner_group(runner_gid: int | None, public: Iterable[Path], socket_mode: int) -> None:
    """ConfigError naming runner_group and socket_mode if the runner group is the group of a
    public unix socket that socket_mode opens to its group: each client of that group could then
    connect to the runner socket too, and map every tenant's K/V read-write."""
    if runner_gid is None or not socket_mode & 0o070:
        return
    for path in public:
        if socket_group(path) == runner_gid:
            raise ConfigError(
                f"runner_group (gid {runner_gid}) is the group of the public socket {path}, "
                f"which socket_mode {oct(socket_mode)} opens to its group: every client of that "
                "group could act as a runner and map every tenant's K/V; give runners a group "
                "of their own, or set socket_mode = 0o600")


def socket_group(path: Path) -> int:
    """The group a unix socket made at `path` gets: its nearest existing folder's when that
    folder is set-group-ID (new folders below it inherit both), else the daemon's."""
    folder = path.absolute().parent
    while not folder.exists():
        folder = folder.parent
    info = folder.stat()
    return info.st_gid if info.st_mode & stat.S_ISGID else os.getegid()


def check_socket_mode(mode: int) -> None:
    """The public sockets: owner rw, and nothing for every other user."""
    if mode & ~0o777 or mode & 0o600 != 0o600:
        raise ConfigError(f"socket_mode must be permission bits including owner rw (0o600), "
                          f"got {oct(mode)}")
    if mode & WORLD_BITS:
        raise ConfigError(f"socket_mode {oct(mode)} gives every local user access (calls "
                          "with no token); use 0o660 and a group")


def load_tls(cert_file: Path | None, key_file: Path | None,
             client_ca_file: Path | None) -> ServerTls | None:
    """The TLS material of TCP listeners, read from the files; None without TLS."""
    if (cert_file is None) != (key_file is None):
        raise ConfigError("tls_cert_file and tls_key_file go together: give both or neither")
    if client_ca_file is not None and cert_file is None:
        raise ConfigError("tls_client_ca_file (mutual TLS) needs tls_cert_file and "
                          "tls_key_file")
    if cert_file is None or key_file is None:
        return None
    try:
        return load_server_tls(cert_file, key_file, client_ca_file)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
