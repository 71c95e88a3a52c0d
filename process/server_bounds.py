"""Bounds both gRPC servers (pagedkvd and `pagedkv runner`) set on their calls and connections.

gRPC's defaults bound neither: a server takes any number of calls at once (each holding its
request, up to the message limit, while it waits), keeps a connection whose peer vanished (a
half-open TCP connection, a suspended client) until the kernel gives up hours later, and keeps
an idle connection forever. `ServerBounds` names the settings that bound them, with defaults:

- `max_concurrent_rpcs`: calls served at once by one server; one more is refused by gRPC
  itself, at once, with RESOURCE_EXHAUSTED (and no `pagedkv-error` cause). It bounds the
  memory of calls waiting (with the message limit: at most this many requests received);
- `keepalive_time_ms`, `keepalive_timeout_ms`: the server pings a connection silent this long,
  and closes it if the ping is not answered in time;
- `max_connection_idle_ms`: a connection with no call for this long is closed (a gRPC client
  reconnects on its next call, unnoticed).

`SERVER_BOUNDS` gives each its range and help: the daemon lists them with its limits (TOML keys
and flags of the same names), the runner as flags.
"""

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple


class BoundSpec(NamedTuple):
    """The range of one setting, and what `--help` says about it."""

    # The smallest and the largest value accepted.
    minimum: int
    maximum: int
    # One line for --help.
    help: str


SERVER_BOUNDS: dict[str, BoundSpec] = {
    "max_concurrent_rpcs": BoundSpec(1, 65_536, "calls one gRPC server serves at once; one "
                                     "more is refused with RESOURCE_EXHAUSTED"),
    "keepalive_time_ms": BoundSpec(1_000, 7_200_000, "milliseconds a connection may be silent "
                                   "before the server pings it"),
    "keepalive_timeout_ms": BoundSpec(1_000, 600_000, "milliseconds the ping's answer may take "
                                      "before the connection is closed"),
    "max_connection_idle_ms": BoundSpec(1_000, 86_400_000, "milliseconds a connection may "
                                        "carry no call before it is closed"),
}


def check_ranges(record: Any, specs: Mapping[str, BoundSpec]) -> None:
    """ValueError naming the first field of the dataclass `record` that is not an integer in
    its spec's range (the daemon's Limits and ServerBounds share this one check)."""
    for item in fields(record):
        value, spec = getattr(record, item.name), specs[item.name]
        if (isinstance(value, bool) or not isinstance(value, int)
                or not spec.minimum <= value <= spec.maximum):
            raise ValueError(f"{item.name} must be an integer in "
                             f"{spec.minimum}..{spec.maximum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class ServerBounds:
    """What a gRPC server bounds (see the module docstring); checked on construction."""

    # Calls served at once; one more gets RESOURCE_EXHAUSTED from gRPC. The daemon serves
    # every client's calls and a runner's merged steps; 256 at once is far above what either
    # sends, and bounds their requests' memory.
    max_concurrent_rpcs: int = 256
    # Ping a connection silent for a minute; close it if 20 s pass without the answer.
    keepalive_time_ms: int = 60_000
    keepalive_timeout_ms: int = 20_000
    # Close a connection that carried no call for 5 minutes (clients reconnect on demand).
    max_connection_idle_ms: int = 300_000

    def __post_init__(self) -> None:
        check_ranges(self, SERVER_BOUNDS)

    def options(self) -> list[tuple[str, int]]:
        """The gRPC server options of the connection bounds (max_concurrent_rpcs is the
        server's `maximum_concurrent_rpcs` argument, not an option)."""
        return [("grpc.keepalive_time_ms", self.keepalive_time_ms),
                ("grpc.keepalive_timeout_ms", self.keepalive_timeout_ms),
                ("grpc.max_connection_idle_ms", self.max_connection_idle_ms)]


assert set(SERVER_BOUNDS) == {f.name for f in fields(ServerBounds)}, "a bound has no spec"
