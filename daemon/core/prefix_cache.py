"""Automatic prefix caching: content keys for full blocks, and the LRU of evictable cached blocks.

A full block is named by a chained SHA-256 over its payload, key_i = H(key_{i-1} || salt ||
tokens of block i) with key_{-1} = ROOT_KEY: 32 + 32 + 8 * block_size bytes, token ids int64
little-endian. The chain makes a key stand for the whole prefix up to and including its block,
so equal keys mean equal K/V. The salt (a tenant's namespace, hashed to 32 bytes) enters every link:
identical tokens under different salts never share a block.

Invariants (checked by `check`):
- `block_of[key] == b`  <=>  `key_of[b] == key`: a key names at most one block and vice versa.
- A block in `evictable` has a key and refcount 0 (the pool checks the refcount side).
- `payload_of[b]` holds what `key_of[b]` was hashed from, so the content behind a key can be
  verified.
"""

import hashlib
from collections import OrderedDict

# Parent key of a sequence's first block.
ROOT_KEY = bytes(32)


def salt_digest(salt: bytes) -> bytes:
    """The 32-byte form of a namespace salt that enters every key of a chain."""
    return hashlib.sha256(b"pagedkv-salt:" + salt).digest()


def block_key(payload: bytes) -> bytes:
    """Content key of a full block from its payload: parent key, salt digest, token ids."""
    return hashlib.sha256(payload).digest()


class PrefixCache:
    """Maps content keys to blocks and keeps refcount-0 cached blocks in LRU order."""

    def __init__(self, num_blocks: int) -> None:
        # key -> block currently holding that content (live or evictable).
        self.block_of: dict[bytes, int] = {}
        # block -> its key, or None for a block with no cached content.
        self.key_of: list[bytes | None] = [None] * num_blocks
        # block -> the payload its key was hashed from (None when key_of is None).
        self.payload_of: list[bytes | None] = [None] * num_blocks
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
        other.payload_of = list(self.payload_of)
        other.evictable = OrderedDict(self.evictable)
        other.queries, other.hits = self.queries, self.hits
        return other

    def lookup(self, key: bytes) -> int | None:
        """The block holding `key`'s content, if any."""
        return self.block_of.get(key)

    def register_many(self, blocks: list[int], payloads: list[bytes], keys: list[bytes]) -> None:
        """Name each block by its key, unless another block already holds that content (then
        the block stays unkeyed: a duplicate, freed like any uncached block)."""
        block_of, key_of, payload_of = self.block_of, self.key_of, self.payload_of
        for block, payload, key in zip(blocks, payloads, keys, strict=True):
            if key in block_of:
                continue
            assert key_of[block] is None, f"block {block} already has a key"
            block_of[key] = block
            key_of[block] = key
            payload_of[block] = payload

    def forget(self, block: int) -> None:
        """Drop `block`'s key (before it is overwritten); it must not be evictable."""
        key = self.key_of[block]
        assert block not in self.evictable, f"block {block} is still evictable"
        if key is not None:
            del self.block_of[key]
            self.key_of[block] = None
            self.payload_of[block] = None

    def park(self, block: int) -> None:
        """A keyed block's refcount reached 0: keep its content, make it evictable."""
        self.evictable[block] = None

    def revive(self, block: int) -> None:
        """A cache hit on an evictable block takes it back into use."""
        del self.evictable[block]

    def evict(self, n: int) -> list[int]:
        """Take the `n` least recently released cached blocks and drop their keys."""
        evictable, block_of, key_of, payload_of = (
            self.evictable, self.block_of, self.key_of, self.payload_of)
        blocks = []
        for _ in range(n):
            block, _ = evictable.popitem(last=False)
            del block_of[key_of[block]]  # type: ignore[arg-type]  # evictable blocks have keys
            key_of[block] = payload_of[block] = None
            blocks.append(block)
        return blocks

    def check(self) -> None:
        """Assert the invariants in the module docstring."""
        for key, block in self.block_of.items():
            assert self.key_of[block] == key, f"key of block {block} disagrees with the map"
            payload = self.payload_of[block]
            assert payload is not None, f"keyed block {block} has no payload"
            assert block_key(payload) == key, f"block {block}'s key does not match its content"
        keyed = sum(key is not None for key in self.key_of)
        assert keyed == len(self.block_of), "a block has a key missing from the map"
        for block in self.evictable:
            assert self.key_of[block] is not None, f"evictable block {block} has no key"
