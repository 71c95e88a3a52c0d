"""The runner fuzzer's tenants: the honest clients and the hostile one are different tenants
sharing one cache salt, as teams that share a system prompt would be.

    tenancy = write_tenancy(folder)                 # a TOML file and a token in `folder`
    pagedkvd(..., *tenancy.daemon_args)             # then connect the hostile client to
    PoolClient.connect(tenancy.hostile_target, auth_token=tenancy.hostile_token)

Honest clients (and the killed client processes) are the unix socket's tenant, "honest"; the
hostile client is "mallory", over a loopback TCP listener with its token. Both list the shared
salt, neither certifies it: under it only the runner, which computed the K/V, may commit
(ops/pagedkv.toml, `certifies`), so mallory's Commit of blocks nobody computed must be refused.
"""

import secrets
from dataclasses import dataclass
from pathlib import Path

from fuzz_runner_corpus import SHARED_SALT

from pagedkv.process.launch import free_tcp_port


@dataclass(frozen=True)
class Tenancy:
    """The daemon's tenants for the fuzzer."""

    # pagedkvd arguments: the tenants' TOML file, the hostile tenant's TCP listener.
    daemon_args: tuple[str, ...]
    # The hostile tenant's gRPC target and bearer token.
    hostile_target: str
    hostile_token: str


def write_tenancy(folder: Path) -> Tenancy:
    """Write the tenants' TOML file and the hostile tenant's token (mode 0600) in `folder`."""
    token, target = secrets.token_hex(16), f"127.0.0.1:{free_tcp_port()}"
    token_file = folder / "mallory.token"
    token_file.touch(mode=0o600)
    token_file.write_text(token)
    salt = SHARED_SALT.decode()
    config = folder / "tenants.toml"
    config.write_text(f'unix_tenant = "honest"\n\n[tenants.honest]\nsalts = ["{salt}"]\n\n'
                      f'[tenants.mallory]\ntoken_file = "{token_file}"\nsalts = ["{salt}"]\n')
    # Plain TCP on loopback only: the fuzzer's clients are on this machine.
    return Tenancy(("--config", str(config), "--listen", target, "--insecure-tcp"), target,
                   token)
