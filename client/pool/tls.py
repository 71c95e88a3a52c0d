"""TLS options of a client channel to a daemon's TCP listener.

    tls = TlsOptions(ca_file="/etc/pagedkv/ca.pem")                       # server auth
    tls = TlsOptions(ca_file="ca.pem", cert_file="me.pem", key_file="me.key")  # mutual TLS
    client = await PoolClient.connect("10.0.0.5:50051", auth_token=token, tls=tls)

The daemon's certificate is verified against `ca_file` (the system's roots when None) and the
target's host name, or `server_name` when the certificate names the daemon otherwise. Unix
socket targets never use TLS.
"""

from dataclasses import dataclass
from pathlib import Path

import grpc


@dataclass(frozen=True, slots=True)
class TlsOptions:
    """How a client verifies the daemon, and proves itself when the daemon asks."""

    # PEM CA bundle that signed the daemon's certificate; None: the system's root CAs.
    ca_file: Path | str | None = None
    # PEM certificate chain and private key of this client (mutual TLS); both or neither.
    cert_file: Path | str | None = None
    key_file: Path | str | None = None
    # Host name the daemon's certificate must carry, when it is not the target's host.
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together: give both or neither")

    def credentials(self) -> grpc.ChannelCredentials:
        """grpc channel credentials from the files (read now)."""
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file), private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file))

    def channel_options(self) -> list[tuple[str, str]]:
        """Channel arguments: the name to verify the certificate against, when given."""
        if self.server_name is None:
            return []
        return [("grpc.ssl_target_name_override", self.server_name)]


def _read(path: Path | str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()
