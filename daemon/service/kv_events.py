"""KV events' sources: which committed blocks each model gained and lost (issue 22).

A router in front of several daemons (llm-d's KV-cache indexer, Dynamo's KV router) keeps an
index of the committed blocks each daemon holds; the publisher (`daemon/events/`) sends what
this module tells its sink (`KVEventSink`), in vLLM's wire format.

- Stored: a pending block becomes committed (Commit, a Batch commit op, StepRequest.commit, a
  runner's certification): `stored(model, blocks)` with exactly the blocks the call made
  matchable, in chain order (each sequence's in table order), each with its token ids, its
  parent's hash (None for a prompt's first block) and its salt as `extra_key`.
- Host tier (kvpool.proto, "The host-memory tier"): a published block copied to the host tier
  is announced stored again with medium "CPU" (the pool's own blocks are "GPU": the tier the
  runners compute into, GPU memory or a CPU daemon's shared memory), and its copy's leaving
  the host tier removed with medium "CPU". A router so knows which daemon holds a prefix and
  in which tier.
- Removed: a committed block's key goes: evicted for a new owner, withdrawn with its page,
  dropped by cache hygiene (a private session ended, a model put to sleep, a capped model's
  cache shed), or rewritten in place by its owner (copy-on-write of a private block). A
  pending block losing its key is never announced: it was never stored.
- The hash a consumer sees is the low 64 bits of the block's content key within its model's
  namespace (the key's last 8 bytes, big-endian, unsigned: what vLLM sends as an integer
  block hash); its parent's likewise.

Tenancy. The event stream is not authenticated, so by default it shows only blocks under a
global salt (a salt a tenant's `salts` lists: sessions of every tenant listing it share them),
with no extra key. With `kv_events_all_salts` every block is published, its namespace in
`extra_key`: a tenant's namespaced salt as b"tenant:NAME\\0SALT", a private session's as
b"session:NUMBER" (never the session id, which is a credential).

Every record goes through the format's journal: the events of a call that fails are undone
with it, and a call's events reach the sink once its transaction succeeded (`Journal.after`).
"""

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

from pagedkv.daemon.core import PoolAllocator
from pagedkv.daemon.core.host_tier import HostTier
from pagedkv.daemon.events.sink import KVEventSink, SnapshotItem, StoredBlock
from pagedkv.daemon.events.wire import MEDIUM_CPU, MEDIUM_GPU
from pagedkv.daemon.service.sessions import Session

# Blocks per `stored` of a snapshot: bounded messages, whatever the pool's size.
SNAPSHOT_CHUNK = 256


def hash64(key: bytes) -> int:
    """The hash a consumer sees for a content key: its low 64 bits, unsigned, as vLLM's
    `maybe_convert_block_hash` (int.from_bytes(key, "big") & (2**64 - 1))."""
    return int.from_bytes(key[-8:], "big")


def extra_key(session: Session) -> bytes | None:
    """The namespace a session's blocks are published with: None for a global salt."""
    if session.shared_salt:
        return None
    if session.private_salt:
        return b"session:%d" % session.number
    return session.salt.removeprefix(b"client:")


@dataclass(frozen=True, slots=True)
class Published:
    """A committed block announced as stored, until it is announced removed."""

    # The model whose namespace keys it, and its hash there.
    model: str
    block_hash: int
    # Its parent's hash (None: a prompt's first block), and its namespace (None: global).
    parent_hash: int | None
    extra_key: bytes | None


class FormatEvents:
    """The KV events of one format's pool (see the module docstring)."""

    def __init__(self, pool: PoolAllocator, sink: KVEventSink, all_salts: bool) -> None:
        self._pool = pool
        self._sink = sink
        # Publish blocks of every salt (`kv_events_all_salts`), not only global ones.
        self.all_salts = all_salts
        # Block -> what was announced of it: committed blocks published, in commit order.
        self.published: dict[int, Published] = {}
        # Host slot -> what was announced of its copy ("CPU").
        self.host_published: dict[int, Published] = {}
        # Events of the open transaction, each a call of the sink, made once it succeeds.
        self._queued: list[Callable[[], None]] = []

    def committed(self, session: Session, blocks: list[int]) -> None:
        """A call of `session` made `blocks` matchable, in chain order."""
        extra = extra_key(session)
        if extra is not None and not self.all_salts:
            return
        keys, parents, tokens = self._pool.block_content(blocks)
        root = self._pool.root_key(session.salt_tag + session.salt)
        stored = []
        for block, key, parent, ids in zip(blocks, keys, parents, tokens.tolist(), strict=True):
            record = Published(session.model, hash64(key),
                               None if parent == root else hash64(parent), extra)
            self._set(block, record)
            stored.append(StoredBlock(record.block_hash, record.parent_hash, tuple(ids), extra))
        self._queue(partial(self._sink.stored, session.model, stored))

    def removed(self, blocks: Sequence[int]) -> None:
        """These blocks lost their committed key; those published are announced removed, one
        event per run of one model's blocks."""
        run: list[int] = []
        model = ""
        for block in blocks:
            record = self.published.get(block)
            if record is None:
                continue
            self._set(block, None)
            if run and record.model != model:
                self._queue(partial(self._sink.removed, model, run))
                run = []
            model = record.model
            run.append(record.block_hash)
        if run:
            self._queue(partial(self._sink.removed, model, run))

    def offloaded(self, moved: list[tuple[int, int, list[int]]]) -> None:
        """Published blocks were copied to host slots: (block, slot, its token ids) each, in
        eviction order; announced stored with medium "CPU", parents first."""
        records = {}
        for block, slot, ids in moved:
            record = self.published.get(block)
            if record is not None:
                self._set_host(slot, record)
                records[record.block_hash] = (record, ids)
        by_model: dict[str, list[StoredBlock]] = {}
        for record, ids in _parents_first(records):
            by_model.setdefault(record.model, []).append(StoredBlock(
                record.block_hash, record.parent_hash, tuple(ids), record.extra_key))
        for model, stored in by_model.items():
            self._queue(partial(self._sink.stored, model, stored, MEDIUM_CPU))

    def host_dropped(self, slots: Sequence[int]) -> None:
        """These host copies are gone; those published are announced removed ("CPU")."""
        by_model: dict[str, list[int]] = {}
        for slot in slots:
            record = self.host_published.get(slot)
            if record is not None:
                self._set_host(slot, None)
                by_model.setdefault(record.model, []).append(record.block_hash)
        for model, hashes in by_model.items():
            self._queue(partial(self._sink.removed, model, hashes, MEDIUM_CPU))

    def snapshot(self) -> Iterator[SnapshotItem]:
        """Every block published when it is first advanced, as stored, per model in chunks,
        parents before children. Lazy, as the publisher reads it (one item per event-loop
        callback, calls between two): the first step copies the published block ids (one
        C-level copy), and each chunk reads its blocks when it is made, skipping any gone by
        then (its removal is an event after the snapshot's point) and putting a block's
        published ancestors not yet sent before it."""
        blocks = list(self.published)
        sent: set[int] = set()
        for start in range(0, len(blocks), SNAPSHOT_CHUNK):
            order: list[int] = []
            for block in blocks[start:start + SNAPSHOT_CHUNK]:
                order.extend(self._unsent_chain(block, sent))
            yield from self._stored_chunks(order)
        yield from self._host_snapshot()

    def _host_snapshot(self) -> Iterator[SnapshotItem]:
        """The host copies published when first advanced, as stored with medium "CPU", per
        model in chunks, parents first (a copy dropped meanwhile is skipped). Copies are
        published in eviction order, children before parents (a freed table's tail is evicted
        first), so each chunk puts a copy's published ancestors not yet sent before it, as the
        pool's chunks do."""
        slots, tier = list(self.host_published), self._pool.host_tier
        if tier is None:
            return
        sent: set[int] = set()
        for start in range(0, len(slots), SNAPSHOT_CHUNK):
            order: list[int] = []
            for slot in slots[start:start + SNAPSHOT_CHUNK]:
                order.extend(self._unsent_host_chain(tier, slot, sent))
            chunks: dict[str, list[StoredBlock]] = {}
            for slot in order:
                record = self.host_published[slot]
                chunks.setdefault(record.model, []).append(StoredBlock(
                    record.block_hash, record.parent_hash, tuple(tier.tokens_of[slot].tolist()),
                    record.extra_key))
            for model, stored in chunks.items():
                yield SnapshotItem(model, stored, MEDIUM_CPU)

    def _unsent_host_chain(self, tier: HostTier, slot: int, sent: set[int]) -> list[int]:
        """`slot` (if still published) after the published slots of its ancestors not yet
        sent, oldest first; marks them sent."""
        chain: list[int] = []
        current: int | None = slot
        while current is not None and current not in sent and current in self.host_published:
            chain.append(current)
            sent.add(current)
            parent = tier.parent_of[current]
            current = None if parent is None else tier.slot_of.get(parent)
        chain.reverse()
        return chain

    def _unsent_chain(self, block: int, sent: set[int]) -> list[int]:
        """`block` (if still published) after its published ancestors not yet sent, oldest
        first; marks them sent."""
        chain: list[int] = []
        current: int | None = block
        while current is not None and current not in sent and current in self.published:
            chain.append(current)
            sent.add(current)
            current = self._pool.parent_block(current)
        chain.reverse()
        return chain

    def _stored_chunks(self, order: list[int]) -> Iterator[SnapshotItem]:
        """The published `order` as stored blocks, one list per model, in order."""
        tokens = self._pool.block_content(order)[2].tolist() if order else []
        chunks: dict[str, list[StoredBlock]] = {}
        for block, ids in zip(order, tokens, strict=True):
            record = self.published[block]
            chunks.setdefault(record.model, []).append(StoredBlock(
                record.block_hash, record.parent_hash, tuple(ids), record.extra_key))
        for model, stored in chunks.items():
            yield SnapshotItem(model, stored, MEDIUM_GPU)

    def _set(self, block: int, record: Published | None) -> None:
        self._pool.journal.record(self._put, block, self.published.get(block))
        self._put(block, record)

    def _put(self, block: int, record: Published | None) -> None:
        self.published.pop(block, None)
        if record is not None:
            self.published[block] = record

    def _set_host(self, slot: int, record: Published | None) -> None:
        self._pool.journal.record(self._put_host, slot, self.host_published.get(slot))
        self._put_host(slot, record)

    def _put_host(self, slot: int, record: Published | None) -> None:
        self.host_published.pop(slot, None)
        if record is not None:
            self.host_published[slot] = record

    def _queue(self, event: Callable[[], None]) -> None:
        self._pool.journal.record(self._unqueue, len(self._queued))
        self._queued.append(event)
        self._pool.journal.after(self._send)

    def _unqueue(self, mark: int) -> None:
        del self._queued[mark:]

    def _send(self) -> None:
        queued, self._queued = self._queued, []
        for event in queued:
            event()


def _parents_first(records: dict[int, tuple[Published, list[int]]]
                   ) -> list[tuple[Published, list[int]]]:
    """`records` (by block hash) ordered so that a record whose parent is among them comes
    after that parent."""
    order: list[tuple[Published, list[int]]] = []
    sent: set[int] = set()
    for block_hash in records:
        chain = []
        current: int | None = block_hash
        while current is not None and current not in sent and current in records:
            sent.add(current)
            chain.append(records[current])
            current = records[current][0].parent_hash
        order.extend(reversed(chain))
    return order
