"""TLS for the daemon's TCP listeners: the bearer token never crosses the network in clear.

TCP listeners serve TLS with the certificate chain and private key of `tls_cert_file` and
`tls_key_file` (PEM). With `tls_client_ca_file` the daemon also asks every TCP client for a
certificate that chains to that CA (mutual TLS) and refuses the handshake without one; the
bearer token is still required on top, since it names the caller's tenant. Unix sockets never
use TLS: the file system decides who may connect, and the traffic stays on the host.

A TCP listener without TLS is allowed only with `insecure_tcp = true` (for a private network
or a TLS-terminating proxy in front), and the daemon logs a warning at start.

The files are read (and checked: PEM content, a private key no other user can read) when the
config is built, so a bad file stops the daemon with the setting named; grpc is imported only
to build the credentials, so checking a config stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import grpc


@dataclass(frozen=True, slots=True)
class ServerTls:
    """What a TLS listener serves with, read from the configured files."""

    # PEM certificate chain the daemon presents (leaf first).
    cert_chain: bytes
    # PEM private key of the leaf certificate.
    private_key: bytes
    # PEM CA bundle client certificates must chain to (mutual TLS); None: none asked for.
    client_ca: bytes | None

    def credentials(self) -> grpc.ServerCredentials:
        """grpc's server credentials: a client certificate is required iff a client CA is set."""
        import grpc

        return grpc.ssl_server_credentials(
            [(self.private_key, self.cert_chain)], root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None)


def load_server_tls(cert_file: Path, key_file: Path, client_ca_file: Path | None) -> ServerTls:
    """The TLS material in these files; ValueError naming the setting if one is unusable."""
    client_ca = None
    if client_ca_file is not None:
        client_ca = read_pem(client_ca_file, "tls_client_ca_file", "CERTIFICATE")
    key = read_pem(key_file, "tls_key_file", "PRIVATE KEY")
    if key_file.stat().st_mode & 0o004:
        raise ValueError(f"tls_key_file: {key_file} is readable by every user; chmod o-r it")
    return ServerTls(cert_chain=read_pem(cert_file, "tls_cert_file", "CERTIFICATE"),
                     private_key=key, client_ca=client_ca)


def read_pem(path: Path, key: str, kind: str) -> bytes:
    """A PEM file's bytes; ValueError naming `key` if unreadable or holding no `kind` block
    ("PRIVATE KEY" also matches "RSA PRIVATE KEY" and "EC PRIVATE KEY")."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{key}: cannot read {path}: {exc.strerror}") from exc
    if b"-----BEGIN " not in data or f"{kind}-----".encode() not in data:
        raise ValueError(f"{key}: {path} holds no PEM {kind.lower()}")
    return data
