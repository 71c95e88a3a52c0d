"""The host-memory tier's bookkeeping: copies of committed blocks, keyed by content, in LRU order.

The pool's prefix cache keeps committed blocks until an allocation needs their memory. With a
host tier, those evicted blocks are not lost: the pool copies each one into a host *slot*
before its new owner gets it (`store`, called by `PhysicalBlocks.take`), and a later prompt
whose prefix runs past the pool's cached blocks into the host tier gets fresh blocks filled
from those slots instead of recomputing them (`lookup`, `BlockPool.allocate`). Slots hold no
sequences and no references: a copy lives until the tier needs its slot for a newer one
(least recently stored or restored first) or the service drops it (`drop`: a private session
that ended, hygiene).

Like the prefix cache, a slot is named by the block's content key (salt and model included), so
equal keys mean equal K/V and a host copy is only ever matched under the salt it was made with.
Only committed blocks come here: K/V the owner certified. This module holds ids and keys, never
bytes; the service performs the copies (`daemon/memory/host_memory.py`) as the call's memory
work, ordered by slot as the pool's by block.

Every change records its undo in the pool's journal, so a call that fails leaves the tier as it
was (the copies it would have made never run: memory work starts only after success).

Invariants (checked by `check`):
- `slot_of[key] == s`  <=>  `key_of[s] == key`; each slot is free or in the LRU, never both.
- A held slot's key is the hash of its parent key and token ids.
"""

from collections import deque
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from pagedkv.daemon.core.content_keys import ContentKeys
from pagedkv.daemon.core.journal import Journal
from pagedkv.daemon.core.lru import LruList


@dataclass(slots=True)
class Stored:
    """What one `store` did."""

    # Index (into the blocks offered) and host slot of each block copied to the tier.
    copied: list[tuple[int, int]] = field(default_factory=list)
    # Host slots whose copy was dropped to make room, with the key each held.
    dropped: list[tuple[int, bytes]] = field(default_factory=list)


class HostTier:
    """Copies of committed blocks in `num_slots` host slots (see the module docstring)."""

    def __init__(self, num_slots: int, block_size: int, journal: Journal,
                 keys: ContentKeys) -> None:
        self.num_slots = num_slots
        self._journal = journal
        # How content keys are hashed (the pool's), to verify a slot's content in `check`.
        self._keys = keys
        # Content key -> the slot holding a copy of that block.
        self.slot_of: dict[bytes, int] = {}
        # Slot -> its key and its parent key (None: free).
        self.key_of: list[bytes | None] = [None] * num_slots
        self.parent_of: list[bytes | None] = [None] * num_slots
        # Slot -> the token ids of its block: [num_slots, block_size].
        self.tokens_of: npt.NDArray[np.int64] = np.zeros((num_slots, block_size), np.int64)
        # Held slots, least recently stored or restored first: the next to be dropped.
        self.lru = LruList(num_slots)
        # Slots holding nothing, handed out oldest first.
        self.free: deque[int] = deque(range(num_slots))
        # Slots an allocation is about to restore from: `store` never drops them (they sit at
        # the LRU's tail, so it drops at most len(lru) - protected of the others).
        self.protected = 0
        # Blocks copied to the tier and restored from it, since the start (for /metrics).
        self.stores = 0
        self.restores = 0

    @property
    def journal(self) -> Journal:
        """The pool's journal, where the service records its own undo of host records."""
        return self._journal

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Slots holding the longest prefix of `keys` (a chain of content keys)."""
        get, slots = self.slot_of.get, []
        for key in keys:
            slot = get(key)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def touch(self, slots: list[int]) -> None:
        """`slots` are used now: they move to the LRU's tail, the last to be dropped."""
        for slot in slots:
            prev, nxt = self.lru.remove(slot)
            self._journal.record(self._untouch, slot, prev, nxt)
            self.lru.extend([slot])

    def _untouch(self, slot: int, prev: int, nxt: int) -> None:
        self.lru.remove(slot)
        self.lru.insert(slot, prev, nxt)

    def restored(self, slots: list[int]) -> None:
        """An allocation copies `slots` back into the pool (it touched them first)."""
        self._count(0, len(slots))

    def store(self, keys: list[bytes], parents: list[bytes],
              tokens: npt.NDArray[np.int64]) -> Stored:
        """Copies of these committed blocks (evicted from the pool: distinct keys) come here, as
        far as room allows. Keys already held are only touched, first, so that the copies of the
        others never drop them; the others take free slots, then the least recently used slots
        that are neither protected nor just touched, whose copies are dropped. One undo record
        for the whole store: this runs for every block an allocation evicts."""
        slot_of = self.slot_of
        held = [slot_of.get(key) for key in keys]
        touched = [slot for slot in dict.fromkeys(held) if slot is not None]
        self.touch(touched)
        # The LRU's tail holds the protected and the touched slots: drop only before them.
        room = len(self.free) + len(self.lru) - self.protected - len(touched)
        new = [index for index, slot in enumerate(held) if slot is None][:max(room, 0)]
        result = Stored()
        if not new:
            return result
        from_free = [self.free.popleft() for _ in range(min(len(new), len(self.free)))]
        reused = [self.lru.pop_head() for _ in range(len(new) - len(from_free))]
        gone: list[tuple[int, bytes, bytes]] = []
        for slot in reused:
            key, parent = self.key_of[slot], self.parent_of[slot]
            assert key is not None and parent is not None, f"host slot {slot} holds nothing"
            gone.append((slot, key, parent))
            del slot_of[key]
        slots = from_free + reused
        if self._journal.active:
            self._journal.record(self._unstore, slots, len(from_free), gone,
                                 self.tokens_of[slots].copy())
        key_of, parent_of = self.key_of, self.parent_of
        for slot, index in zip(slots, new, strict=True):
            key_of[slot], parent_of[slot] = keys[index], parents[index]
            slot_of[keys[index]] = slot
        self.tokens_of[slots] = tokens[new]
        self.lru.extend(slots)
        result.copied = list(zip(new, slots, strict=True))
        result.dropped = [(slot, key) for slot, key, _ in gone]
        self.stores += len(slots)
        return result

    def _unstore(self, slots: list[int], num_free: int,
                 gone: list[tuple[int, bytes, bytes]], tokens: npt.NDArray[np.int64]) -> None:
        """Undo of `store`: its slots leave the LRU and their keys go; the copies it dropped
        come back at the LRU's head, the free slots it took at the free list's."""
        self.lru.drop_tail(len(slots))
        for slot in slots:
            key = self.key_of[slot]
            assert key is not None, f"host slot {slot} lost its key"
            del self.slot_of[key]
            self.key_of[slot] = self.parent_of[slot] = None
        self.tokens_of[slots] = tokens
        for slot, key, parent in reversed(gone):
            self._rekey(slot, key, parent)
            self.lru.put_back_head(slot)
        self.free.extendleft(reversed(slots[:num_free]))
        self.stores -= len(slots)

    def drop(self, slots: list[int]) -> list[tuple[int, bytes]]:
        """Drop the copies in `slots` (those still held); their slots are free again. Returns
        each dropped slot with the key it held."""
        dropped = []
        for slot in slots:
            if self.key_of[slot] is None:
                continue
            prev, nxt = self.lru.remove(slot)
            self._journal.record(self.lru.insert, slot, prev, nxt)
            dropped.append((slot, self._unkey(slot)))
            self.free.append(slot)
            self._journal.record(self.free.pop)
        return dropped

    def content(self, slot: int) -> tuple[bytes, bytes, npt.NDArray[np.int64]]:
        """A held slot's key, parent key and token ids."""
        key, parent = self.key_of[slot], self.parent_of[slot]
        assert key is not None and parent is not None, f"host slot {slot} holds nothing"
        return key, parent, self.tokens_of[slot]

    @property
    def num_held(self) -> int:
        return len(self.lru)

    def _unkey(self, slot: int) -> bytes:
        key, parent = self.key_of[slot], self.parent_of[slot]
        assert key is not None and parent is not None, f"host slot {slot} holds nothing"
        del self.slot_of[key]
        self.key_of[slot] = self.parent_of[slot] = None
        self._journal.record(self._rekey, slot, key, parent)
        return key

    def _rekey(self, slot: int, key: bytes, parent: bytes) -> None:
        self.slot_of[key] = slot
        self.key_of[slot], self.parent_of[slot] = key, parent

    def _count(self, stores: int, restores: int) -> None:
        self.stores += stores
        self.restores += restores
        self._journal.record(self._uncount, stores, restores)

    def _uncount(self, stores: int, restores: int) -> None:
        self.stores -= stores
        self.restores -= restores

    def check(self) -> None:
        """Assert the invariants in the module docstring."""
        held, free = set(self.lru), set(self.free)
        assert len(free) == len(self.free) and not held & free, "a host slot is in two states"
        assert len(held) + len(free) == self.num_slots, "a host slot is unaccounted"
        assert self.protected == 0, "host slots left protected after a call"
        for key, slot in self.slot_of.items():
            assert self.key_of[slot] == key, f"host slot {slot}'s key disagrees with the map"
        for slot in range(self.num_slots):
            held_key, parent = self.key_of[slot], self.parent_of[slot]
            assert (held_key is None) == (slot in free), f"host slot {slot}: key and state disagree"
            if held_key is not None and parent is not None:
                content = self._keys.block(parent, self.tokens_of[slot].tobytes())
                assert content == held_key, f"host slot {slot}'s key does not match its content"
