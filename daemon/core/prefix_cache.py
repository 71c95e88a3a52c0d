"""Automatic prefix caching: content keys for full blocks, and the LRU of evictable cached blocks.

A full block is named by a chained SHA-256, key_i = H(key_{i-1} || tokens of block i), token ids
as int64 little-endian. The chain makes a key stand for the whole prefix up to and including its
block, so equal keys mean equal K/V. The chain's root is the namespace salt, key_{-1} =
H("pagedkv-root:" || salt): the salt enters every key through its parents, so identical tokens
under different salts (tenants) never share a block, and each link hashes 32 bytes less.

Invariants (checked by `check`):
- `block_of[key] == b`  <=>  `key_of[b] == key`: a key names at most one block and vice versa.
- A block in `evictable` has a key and refcount 0 (the pool checks the refcount side).
- A keyed block remembers its parent key and token ids, and hashing them gives its key:
  the content behind every key can be verified.
"""

from collections import OrderedDict
from hashlib import sha256

import numpy as np
import numpy.typing as npt


def root_key(salt: bytes) -> bytes:
    """Parent key of the first block of every sequence in the namespace `salt`."""
    return sha256(b"pagedkv-root:" + salt).digest()


def block_key(parent: bytes, tokens: bytes) -> bytes:
    """Content key of a full block: the key of its prefix (rooted in a salt), its token ids."""
    return sha256(parent + tokens).digest()


class PrefixCache:
    """Maps content keys to blocks and keeps refcount-0 cached blocks in LRU order."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        # key -> block currently holding that content (live or evictable).
        self.block_of: dict[bytes, int] = {}
        # block -> its key, or None for a block with no cached content.
        self.key_of: list[bytes | None] = [None] * num_blocks
        # block -> the parent key its key was hashed from (when keyed).
        self.parent_of: list[bytes | None] = [None] * num_blocks
        # block -> its token ids (meaningful when keyed): [num_blocks, block_size].
        self.tokens_of: npt.NDArray[np.int64] = np.zeros((num_blocks, block_size), np.int64)
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
        other.parent_of = list(self.parent_of)
        other.tokens_of = self.tokens_of.copy()
        other.evictable = OrderedDict(self.evictable)
        other.queries, other.hits = self.queries, self.hits
        return other

    def lookup(self, key: bytes) -> int | None:
        """The block holding `key`'s content, if any."""
        return self.block_of.get(key)

    def key_blocks(self, blocks: npt.NDArray[np.int64], parents: list[bytes],
                   tokens: npt.NDArray[np.int64]) -> list[bytes]:
        """Key the just-filled `blocks` (tokens [len(blocks), block_size]) under their parents'
        keys and register each, unless another block already holds that content: that block
        stays unkeyed, a duplicate freed like any uncached block. Returns the keys in order.
        This runs once per filled block on the decode hot path, hence one tight loop."""
        block_of, key_of, parent_of = self.block_of, self.key_of, self.parent_of
        data, width = tokens.tobytes(), tokens.shape[1] * tokens.itemsize
        keys = []
        for i, (block, parent) in enumerate(zip(blocks.tolist(), parents, strict=True)):
            key = sha256(parent + data[i * width:(i + 1) * width]).digest()  # block_key, inline
            keys.append(key)
            if key not in block_of:
                assert key_of[block] is None, f"block {block} already has a key"
                block_of[key] = block
                key_of[block] = key
                parent_of[block] = parent
        self.tokens_of[blocks] = tokens  # harmless for duplicates: read only when keyed
        return keys

    def forget(self, block: int) -> None:
        """Drop `block`'s key (before it is overwritten); it must not be evictable."""
        key = self.key_of[block]
        assert block not in self.evictable, f"block {block} is still evictable"
        if key is not None:
            del self.block_of[key]
            self.key_of[block] = self.parent_of[block] = None

    def park(self, block: int) -> None:
        """A keyed block's refcount reached 0: keep its content, make it evictable."""
        self.evictable[block] = None

    def revive(self, block: int) -> None:
        """A cache hit on an evictable block takes it back into use."""
        del self.evictable[block]

    def evict(self, n: int) -> list[int]:
        """Take the `n` least recently released cached blocks and drop their keys."""
        evictable, block_of, key_of = self.evictable, self.block_of, self.key_of
        blocks = []
        for _ in range(n):
            block, _ = evictable.popitem(last=False)
            key = key_of[block]
            assert key is not None, f"evictable block {block} has no key"
            del block_of[key]
            key_of[block] = self.parent_of[block] = None
            blocks.append(block)
        return blocks

    def check(self) -> None:
        """Assert the invariants in the module docstring."""
        for key, block in self.block_of.items():
            assert self.key_of[block] == key, f"key of block {block} disagrees with the map"
            parent = self.parent_of[block]
            assert parent is not None, f"keyed block {block} lost its parent"
            content = block_key(parent, self.tokens_of[block].tobytes())
            assert content == key, f"block {block}'s key does not match its content"
        keyed = sum(key is not None for key in self.key_of)
        assert keyed == len(self.block_of), "a block has a key missing from the map"
        for block in self.evictable:
            assert self.key_of[block] is not None, f"evictable block {block} has no key"
