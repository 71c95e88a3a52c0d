"""Automatic prefix caching: content keys for full blocks, and the LRU of evictable cached blocks.

A full block is named by a chained SHA-256: key_i = H(key_{i-1} || salt || tokens of block i), with
key_{-1} = ROOT_KEY. The chain makes a key stand for the whole prefix up to and including its block,
so equal keys mean equal K/V. The salt (a tenant's namespace, hashed to 32 bytes) enters every link:
identical tokens under different salts never share a block.

Invariants (checked by `check`):
- `block_of[key] == b`  <=>  `key_of[b] == key`: a key names at most one block and vice versa.
- A block in `evictable` has a key and refcount 0 (the pool checks the refcount side).
- `records[b]` holds what `key_of[b]` was hashed from, so the content behind a key can be verified.
"""

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

# Parent key of a sequence's first block.
ROOT_KEY = bytes(32)


def salt_digest(salt: bytes) -> bytes:
    """The 32-byte form of a namespace salt that enters every key of a chain."""
    return hashlib.sha256(b"pagedkv-salt:" + salt).digest()


def block_key(parent: bytes, salt: bytes, tokens: bytes) -> bytes:
    """Content key of a full block: the chain up to `parent`, the namespace, and its tokens."""
    return hashlib.sha256(parent + salt + tokens).digest()


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """What a registered block's key was computed from."""

    # Key of the previous block of the prefix (ROOT_KEY for a first block).
    parent: bytes
    # Digest of the namespace salt.
    salt: bytes
    # The block's token ids, int64 little-endian bytes.
    tokens: bytes


class PrefixCache:
    """Maps content keys to blocks and keeps refcount-0 cached blocks in LRU order."""

    def __init__(self, num_blocks: int) -> None:
        # key -> block currently holding that content (live or evictable).
        self.block_of: dict[bytes, int] = {}
        # block -> its key, or None for a block with no cached content.
        self.key_of: list[bytes | None] = [None] * num_blocks
        # block -> the inputs of its key (None when key_of is None).
        self.records: list[KeyRecord | None] = [None] * num_blocks
        # Refcount-0 blocks with cached content, least recently released first. Blocks released
        # together enter deepest first, so a sequence's tail is evicted before its shared prefix.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        # Prefix-cache counters, in tokens: offered for reuse, and found cached.
        self.queries = 0
        self.hits = 0

    def copy(self) -> "PrefixCache":
        """An independent copy, for all-or-nothing snapshots."""
        other = PrefixCache.__new__(PrefixCache)
        other.block_of = dict(self.block_of)
        other.key_of = list(self.key_of)
        other.records = list(self.records)
        other.evictable = OrderedDict(self.evictable)
        other.queries, other.hits = self.queries, self.hits
        return other

    def lookup(self, key: bytes) -> int | None:
        """The block holding `key`'s content, if any."""
        return self.block_of.get(key)

    def register(self, block: int, record: KeyRecord, key: bytes) -> bool:
        """Name `block` by `key` unless another block already holds that content."""
        if key in self.block_of:
            return False
        assert self.key_of[block] is None, f"block {block} already has a key"
        self.block_of[key] = block
        self.key_of[block] = key
        self.records[block] = record
        return True

    def forget(self, block: int) -> None:
        """Drop `block`'s key (before it is overwritten); it must not be evictable."""
        key = self.key_of[block]
        assert block not in self.evictable, f"block {block} is still evictable"
        if key is not None:
            del self.block_of[key]
            self.key_of[block] = None
            self.records[block] = None

    def park(self, block: int) -> None:
        """A keyed block's refcount reached 0: keep its content, make it evictable."""
        self.evictable[block] = None

    def revive(self, block: int) -> None:
        """A cache hit on an evictable block takes it back into use."""
        del self.evictable[block]

    def evict(self) -> int:
        """Take the least recently released cached block and drop its key."""
        block, _ = self.evictable.popitem(last=False)
        self.forget(block)
        return block

    def check(self) -> None:
        """Assert the invariants in the module docstring."""
        for key, block in self.block_of.items():
            assert self.key_of[block] == key, f"key of block {block} disagrees with the map"
            record = self.records[block]
            assert record is not None, f"keyed block {block} has no record"
            assert block_key(record.parent, record.salt, record.tokens) == key, (
                f"block {block}'s key does not match its recorded content"
            )
        keyed = sum(key is not None for key in self.key_of)
        assert keyed == len(self.block_of), "a block has a key missing from the map"
        for block in self.evictable:
            assert self.key_of[block] is not None, f"evictable block {block} has no key"
