"""What the daemon's event sources call: the `KVEventSink` interface and its records.

The service (daemon/service/kv_events.py) tells a sink which committed blocks each model gained
and lost; the publisher (publisher.py) turns the calls into vLLM's events, `NullSink` (events
off) drops them for nothing. Every call comes from the daemon's event loop and returns without
I/O.

Rules for the callers, on which a subscriber's exact index depends:
- Call once the change is made (its transaction succeeded), never before it: a snapshot
  (publisher.py) reads the pool at or after the point it names, and a removal announced before
  the block is gone could be missed by a snapshot that still sees the block.
- `stored` lists the blocks in chain order: a block whose parent is the block before it in the
  list continues that chain (one vLLM `BlockStored` per chain).
- The snapshot callable (`Snapshot`) yields the committed blocks and host copies as
  `SnapshotItem`s, each list bounded (a few hundred blocks), parents before children. The
  publisher advances it on the event loop ONE item per loop callback, other work running
  between items: the iterator
  must tolerate blocks added and removed between two items (skip a block that is gone).
"""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

# BlockStored/BlockRemoved `medium`: the tier the blocks are in. vLLM's MEDIUM_GPU is the pool
# runners compute into (GPU memory, or a CPU daemon's shared memory); "CPU" is the host tier.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"


@dataclass(frozen=True, slots=True)
class StoredBlock:
    """One committed block as a subscriber sees it."""

    # Low 64 bits of the block's content key, unsigned (vLLM's default external block hash).
    block_hash: int
    # The previous block's hash; None for a prompt's first block.
    parent_hash: int | None
    # The block_size tokens it holds.
    token_ids: tuple[int, ...]
    # The block's cache salt when it is not shared (vLLM's extra_keys carry it); else None.
    extra_key: bytes | None


class SnapshotItem(NamedTuple):
    """One bounded list of a model's blocks in a snapshot, and the tier they are in."""

    model: str
    blocks: list[StoredBlock]
    # MEDIUM_GPU (the pool) or MEDIUM_CPU (the host tier's copies).
    medium: str = MEDIUM_GPU


# Every committed block and host copy, as bounded items (see the module docstring).
Snapshot = Callable[[], Iterator[SnapshotItem]]


class KVEventSink(Protocol):
    """Where the daemon's event sources send what they see (see the module docstring)."""

    def stored(self, model: str, blocks: Sequence[StoredBlock], medium: str = MEDIUM_GPU) -> None:
        """`blocks` became committed (matchable) in `model`'s namespace, in chain order: in the
        pool (MEDIUM_GPU), or copied to the host tier (MEDIUM_CPU)."""

    def removed(self, model: str, hashes: Sequence[int], medium: str = MEDIUM_GPU) -> None:
        """The committed blocks of these hashes left `model`'s cache in that tier."""

    def cleared(self, model: str) -> None:
        """Every committed block of `model` is gone."""


class EventCounts(NamedTuple):
    """What a sink did since it started (the metrics `pagedkv:kv_event*_total`)."""

    # Batches published on the PUB socket.
    sent: int
    # Batches dropped because the queue to the sending thread was full.
    dropped: int
    # Batches sent again in answer to replay requests.
    replayed: int
    # Snapshots answered in full.
    snapshots: int


class ManagedSink(KVEventSink, Protocol):
    """A sink the daemon starts on its event loop and closes when it stops."""

    def start(self) -> None:
        """Bind the sockets and start sending; called on the running event loop."""

    async def close(self) -> None:
        """Stop sending (what is queued is sent first, briefly) and close the sockets."""

    def counts(self) -> EventCounts:
        """The figures so far."""

    @property
    def next_seq(self) -> int:
        """The seq the next batch would get."""


class NullSink:
    """Events off: every call returns at once and nothing is kept."""

    def stored(self, model: str, blocks: Sequence[StoredBlock], medium: str = MEDIUM_GPU) -> None:
        pass

    def removed(self, model: str, hashes: Sequence[int], medium: str = MEDIUM_GPU) -> None:
        pass

    def cleared(self, model: str) -> None:
        pass

    def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def counts(self) -> EventCounts:
        return EventCounts(0, 0, 0, 0)

    @property
    def next_seq(self) -> int:
        return 0
