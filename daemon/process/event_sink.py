"""The daemon's KV-event sink, from its settings: the publisher (daemon/events/) when
kv_events_endpoint is set, else `NullSink` (nothing queued, nothing bound, no thread).

server.py starts it on the event loop once the service is up, hands it to the service with
the service's snapshot, and closes it before the service stops.
"""

from collections.abc import Callable

import zmq

from pagedkv.daemon.events.publisher import EventPublisher
from pagedkv.daemon.events.sender import EventSettings
from pagedkv.daemon.events.sink import ManagedSink, NullSink, Snapshot
from pagedkv.daemon.process.config import DaemonConfig
from pagedkv.process.grpc_server import StartupError


def make_event_sink(config: DaemonConfig, snapshot: Snapshot, first_seq: int = 0,
                    numbered: Callable[[int, bool], None] | None = None) -> ManagedSink:
    """The sink of `config`'s kv_events_* settings (not started), its first batch numbered
    `first_seq`; `snapshot` yields every committed block for snapshot requests
    (daemon/events/sink.py says how it is read); `numbered` is told each batch's numbering
    (EventPublisher's: the crash log keeps it)."""
    if not config.kv_events_endpoint:
        return NullSink()
    return EventPublisher(EventSettings(
        endpoint=config.kv_events_endpoint,
        replay_endpoint=config.kv_events_replay_endpoint or None,
        buffer=config.kv_events_buffer, queue=config.kv_events_queue,
        topic_prefix=config.kv_events_topic, block_size=config.block_size,
        first_seq=first_seq), snapshot, numbered)


def start_event_sink(sink: ManagedSink) -> None:
    """Start the sink on the running loop; an endpoint it cannot bind or connect to is a
    StartupError naming the settings."""
    try:
        sink.start()
    except zmq.ZMQError as exc:
        raise StartupError(f"kv_events_endpoint / kv_events_replay_endpoint: {exc}") from exc
