"""Listen addresses as people write them: "unix:///run/pagedkv/pagedkvd.sock", "10.0.0.5:50051".

Parsing here is pure: a malformed address is a ValueError, and the caller names the setting.
"""

import os
from dataclasses import dataclass
from pathlib import Path

from pagedkv.vocab.paths import MAX_UNIX_PATH_BYTES


@dataclass(frozen=True, slots=True)
class ListenAddress:
    """One parsed gRPC listener address."""

    # The address in the form grpc's add_insecure_port takes ("unix:///abs/path", "host:port").
    target: str
    # The socket file of a unix listener; None for TCP.
    unix_path: Path | None

    @property
    def is_tcp(self) -> bool:
        return self.unix_path is None


def parse_host_port(text: str) -> tuple[str, int]:
    """("127.0.0.1", 50051) from "127.0.0.1:50051"; IPv6 hosts in brackets ("[::1]:50051")."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not host:port (e.g. 127.0.0.1:50051)")
    return host, int(port)


def parse_listen(text: str) -> ListenAddress:
    """A listener from "unix:///abs/path", "unix:relative/path" or "host:port"."""
    if text.startswith("unix:"):
        rest = text.removeprefix("unix:")
        if rest.startswith("//"):
            rest = rest.removeprefix("//")
            if not rest.startswith("/"):
                raise ValueError(f"{text!r}: use unix:///absolute/path or unix:relative")
        path = Path(rest).absolute()
        if not rest or len(os.fsencode(path)) > MAX_UNIX_PATH_BYTES:
            raise ValueError(f"{text!r}: a socket path must be 1 to {MAX_UNIX_PATH_BYTES} "
                             "bytes long")
        return ListenAddress(target=f"unix://{path}", unix_path=path)
    host, port = parse_host_port(text)
    bracketed = f"[{host}]" if ":" in host else host
    return ListenAddress(target=f"{bracketed}:{port}", unix_path=None)
