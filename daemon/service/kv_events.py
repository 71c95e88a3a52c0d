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

Tenancy. The event stream is not authenticated and carries token ids, so by default it shows
only blocks under a public salt: a global salt (one a tenant's `salts` lists) that the operator
marks public (`public_salts` in the tenants' config, every tenant listing it alike), with no
extra key. Listing a salt does not make it public, even when one tenant alone lists it. With
`kv_events_all_salts` every block is published, its namespace in `extra_key`: a global salt not
marked public as b"shared:SALT", a tenant's namespaced salt as b"tenant:NAME\\0SALT", a private
session's as b"session:NUMBER" (never the session id, which is a credential).

Every record goes through the format's journal: the events of a call that fails are undone
with it, and a call's events reach the sink once its transaction succeeded (`Journal.after`).
"""

import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial

from pagedkv.daemon.core import BlockPool, Journal
from pagedkv.daemon.events.sink import KVEventSink, SnapshotItem, StoredBlock
from pagedkv.daemon.events.wire import MEDIUM_CPU, MEDIUM_GPU
from pagedkv.daemon.service.sessions import Session

# Blocks per `stored` of a snapshot: bounded messages, whatever the pool's size.
SNAPSHOT_CHUNK = 256

# A snapshot's entry: a pool block (medium "GPU") or a host slot ("CPU").
Entry = tuple[str, int]


def hash64(key: bytes) -> int:
    """The hash a consumer sees for a content key: its low 64 bits, unsigned, as vLLM's
    `maybe_convert_block_hash` (int.from_bytes(key, "big") & (2**64 - 1))."""
    return int.from_bytes(key[-8:], "big")


def extra_key(session: Session, public_salts: frozenset[bytes]) -> bytes | None:
    """The namespace a session's blocks are published with: None for a public salt."""
    if session.shared_salt and session.shared_salt in public_salts:
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

    def __init__(self, pool: BlockPool, sink: KVEventSink, all_salts: bool,
                 public_salts: frozenset[bytes]) -> None:
        self._pool = pool
        self._sink = sink
        # Publish blocks of every salt (`kv_events_all_salts`), not only public ones.
        self.all_salts = all_salts
        # The global salts the operator marks public (Tenants.public_salts).
        self.public_salts = public_salts
        # Block -> what was announced of it: committed blocks published, in commit order.
        self.published: dict[int, Published] = {}
        # Host slot -> what was announced of its copy ("CPU").
        self.host_published: dict[int, Published] = {}
        # Events of the open transaction, each a call of the sink, made once it succeeds.
        self._queued: list[Callable[[], None]] = []

    def committed(self, session: Session, blocks: list[int]) -> None:
        """A call of `session` made `blocks` matchable, in chain order."""
        extra = extra_key(session, self.public_salts)
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
        """Every block and host copy published when it is first advanced, as stored (medium
        "GPU", then "CPU"), per model in chunks, parents before children. Lazy, as the publisher
        reads it (one item per event-loop callback, calls between two): the first step copies
        the published ids (one C-level copy each), and each chunk reads its blocks when it is
        made, skipping any gone by then (its removal is an event after the snapshot's point)
        and putting a block's published ancestors not yet sent before it, in either tier (a
        pool block's parent may be held by the host tier alone, and a copy's by the pool)."""
        entries = [*((MEDIUM_GPU, block) for block in self.published),
                   *((MEDIUM_CPU, slot) for slot in self.host_published)]
        sent: set[Entry] = set()
        for start in range(0, len(entries), SNAPSHOT_CHUNK):
            order: list[Entry] = []
            for entry in entries[start:start + SNAPSHOT_CHUNK]:
                order.extend(self._unsent_chain(entry, sent))
            yield from self._stored_chunks(order)

    def _record(self, entry: Entry) -> Published | None:
        """What was announced of a pool block ("GPU") or a host slot ("CPU"), if published."""
        medium, where = entry
        return (self.published if medium == MEDIUM_GPU else self.host_published).get(where)

    def _unsent_chain(self, entry: Entry, sent: set[Entry]) -> list[Entry]:
        """`entry` (if still published) after its published ancestors not yet sent, oldest
        first; marks them sent."""
        chain: list[Entry] = []
        current: Entry | None = entry
        while current is not None and current not in sent and self._record(current) is not None:
            chain.append(current)
            sent.add(current)
            current = self._parent(current)
        chain.reverse()
        return chain

    def _parent(self, entry: Entry) -> Entry | None:
        """The published pool block, else host copy, holding `entry`'s parent content."""
        medium, where = entry
        tier = self._pool.host_tier
        if medium == MEDIUM_GPU:
            block = self._pool.parent_block(where)
            if block is not None and block in self.published:
                return MEDIUM_GPU, block
            if tier is None:
                return None
            parent: bytes | None = self._pool.block_content([where])[1][0]
        else:
            assert tier is not None, "a host copy published by a pool without a tier"
            parent = tier.parent_of[where]
            pool = self._pool
            block = pool.committed_block(parent) if parent is not None else None
            if block is not None and block in self.published:
                return MEDIUM_GPU, block
        slot = None if parent is None else tier.slot_of.get(parent)
        return None if slot is None or slot not in self.host_published else (MEDIUM_CPU, slot)

    def _stored_chunks(self, order: list[Entry]) -> Iterator[SnapshotItem]:
        """The published `order` as stored blocks: per model, one item per run of one medium,
        in order."""
        blocks = [where for medium, where in order if medium == MEDIUM_GPU]
        tokens = dict(zip(blocks, self._pool.block_content(blocks)[2].tolist(), strict=True)) \
            if blocks else {}
        tier = self._pool.host_tier
        chunks: dict[str, list[tuple[str, StoredBlock]]] = {}
        for medium, where in order:
            record = self._record((medium, where))
            assert record is not None
            if medium == MEDIUM_GPU:
                ids = tokens[where]
            else:
                assert tier is not None
                ids = tier.tokens_of[where].tolist()
            chunks.setdefault(record.model, []).append((medium, StoredBlock(
                record.block_hash, record.parent_hash, tuple(ids), record.extra_key)))
        for model, stored in chunks.items():
            for medium, run in itertools.groupby(stored, key=lambda pair: pair[0]):
                yield SnapshotItem(model, [block for _, block in run], medium)

    def _set(self, block: int, record: Published | None) -> None:
        """What was announced of pool block `block` (None: nothing), through the journal."""
        _assign(self._pool.journal, self.published, block, record)

    def _set_host(self, slot: int, record: Published | None) -> None:
        """What was announced of host slot `slot`'s copy (None: nothing), likewise."""
        _assign(self._pool.journal, self.host_published, slot, record)

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


def _assign(journal: Journal, records: dict[int, Published], key: int,
            record: Published | None) -> None:
    """records[key] = record (None: removed), its undo in `journal`."""
    journal.record(_put, records, key, records.get(key))
    _put(records, key, record)


def _put(records: dict[int, Published], key: int, record: Published | None) -> None:
    records.pop(key, None)
    if record is not None:
        records[key] = record
