"""Automatic prefix caching: content keys for full blocks, pending until their K/V is written.

A full block is named by a chained hash of its tokens under its prefix, rooted in the namespace
salt (content_keys.py: the chain, and the `prefix_hash` choice of hash), so equal keys mean
equal K/V and identical tokens under different salts (tenants) never share a block.

K/V is shareable only once it is written. A block is keyed *pending* when the pool sees it fill
(the runner has not computed it yet); `lookup` never matches a pending key. It becomes
*committed*, and matchable, only when the sequence's owner certifies that its K/V is written
(`commit`). A pending block whose last reference goes away (a free, an expired lease, a failed
request) loses its key: its slots may hold nothing. If two sequences computed the same content
at once, the first to commit keeps the key and the other's block stays unkeyed.

Invariants (checked by `check`):
- `block_of[key] == b`  =>  `key_of[b] == key`: a committed key names one block and vice versa;
  a pending block has `key_of[b]` set but is not in `block_of`.
- `committed[b] == 1` exactly when `block_of` names b.
- A block in `evictable` holds a committed key (the pool checks that its refcount is 0, and that
  pending blocks are referenced).
- A keyed block remembers its parent key and token ids, and hashing them gives its key:
  the content behind every key can be verified.
"""

import numpy as np
import numpy.typing as npt

from pagedkv.daemon.core import _rows
from pagedkv.daemon.core.content_keys import ContentKeys
from pagedkv.daemon.core.journal import Journal
from pagedkv.daemon.core.lru import LruList

# Keys a call dropped, as (block, key, parent key): what its undo gives back.
DroppedKeys = list[tuple[int, bytes, bytes | None]]


class PrefixCache:
    """Maps committed content keys to blocks and keeps refcount-0 cached blocks in LRU order."""

    def __init__(self, num_blocks: int, block_size: int, journal: Journal,
                 keys: ContentKeys) -> None:
        self._journal = journal
        # How content keys are hashed (the daemon's `prefix_hash`).
        self.keys = keys
        # Committed key -> the block holding that content (live or evictable).
        self.block_of: dict[bytes, int] = {}
        # Block -> 1 while `block_of` names it (its key is committed), else 0: what a free reads
        # per block, cheaper than probing `block_of`, a dict of every cached block.
        self.committed = bytearray(num_blocks)
        # Block -> its key (committed or pending), or None for a block with no cached content.
        self.key_of: list[bytes | None] = [None] * num_blocks
        # Block -> the parent key its key was hashed from (when keyed).
        self.parent_of: list[bytes | None] = [None] * num_blocks
        # Block -> its token ids (meaningful when keyed): [num_blocks, block_size].
        self.tokens_of: npt.NDArray[np.int64] = np.zeros((num_blocks, block_size), np.int64)
        # Refcount-0 blocks with committed content, least recently released first. Blocks
        # released together enter deepest first, so a sequence's tail is evicted before its
        # shared prefix.
        self.evictable = LruList(num_blocks)
        # Blocks with a key, committed or pending (pending = num_keyed - len(block_of)).
        self.num_keyed = 0
        # Prefix-cache counters, in tokens: offered for reuse, and found cached.
        self.queries = 0
        self.hits = 0

    def lookup(self, keys: list[bytes]) -> list[int]:
        """Blocks holding the committed content of the longest prefix of `keys` (a chain from
        `ContentKeys.chain`); a pending key never matches."""
        get, blocks = self.block_of.get, []
        for key in keys:
            block = get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def is_committed(self, block: int) -> bool:
        return bool(self.committed[block])

    def count(self, queries: int, hits: int) -> None:
        """Add one allocation's lookups to the counters."""
        self.queries += queries
        self.hits += hits
        self._journal.record(self._uncount, queries, hits)

    def _uncount(self, queries: int, hits: int) -> None:
        self.queries -= queries
        self.hits -= hits

    def key_blocks(self, blocks: npt.NDArray[np.int64], parents: list[bytes], keys: list[bytes],
                   tokens: npt.NDArray[np.int64]) -> None:
        """Key the just-filled `blocks` (tokens [len(blocks), block_size], hashed by
        `ContentKeys.chain` or `.blocks`) pending: nothing matches them until `commit`. This runs
        for every filled block on the decode hot path: one compiled loop (`_rows.set_keys`)."""
        if self._journal.active:  # an evicted block's old ids go back with its old key
            self._journal.record(self._unkey, blocks, self.tokens_of[blocks])
        _rows.set_keys(blocks, keys, parents, np.ascontiguousarray(tokens), self.key_of,
                       self.parent_of, self.committed, self.tokens_of)
        self.num_keyed += len(blocks)

    def key_sealed(self, rows: npt.NDArray[np.int64], blocks: npt.NDArray[np.int64],
                   partial: npt.NDArray[np.int64], chain_key: list[bytes]) -> None:
        """Key pending the `blocks` that `rows` just filled (the decode hot path): block i's
        ids are partial[rows[i]] and its parent key chain_key[rows[i]], which then becomes
        its key. One compiled loop (`_rows.seal_blocks`), hashing with `keys.digest`."""
        if self._journal.active:  # an evicted block's old ids go back with its old key
            self._journal.record(self._unkey, blocks, self.tokens_of[blocks])
        _rows.seal_blocks(rows, blocks, partial, chain_key, self.keys.digest, self.key_of,
                          self.parent_of, self.committed, self.tokens_of)
        self.num_keyed += len(blocks)

    def _unkey(self, blocks: npt.NDArray[np.int64], tokens: npt.NDArray[np.int64]) -> None:
        for block in blocks.tolist():
            self.key_of[block] = self.parent_of[block] = None
        self.tokens_of[blocks] = tokens
        self.num_keyed -= len(blocks)

    def commit(self, blocks: list[int]) -> list[int]:
        """The K/V of `blocks` is written: make their pending keys matchable, in order. Returns
        the blocks that became matchable, in order. A block whose content another block
        committed first (maybe earlier in `blocks`) loses its key. One compiled loop
        (`_rows.claim_keys`), one undo record."""
        added, dropped = _rows.claim_keys(blocks, self.key_of, self.parent_of, self.committed,
                                          self.block_of)
        self.num_keyed -= len(dropped)
        self._journal.record(self._uncommit, added, dropped)
        return added

    def _uncommit(self, added: list[int], dropped: DroppedKeys) -> None:
        for block in reversed(added):  # newest first: each still holds the key it committed
            key = self.key_of[block]
            assert key is not None, f"committed block {block} lost its key"
            del self.block_of[key]
            self.committed[block] = 0
        for block, key, parent in dropped:
            self._rekey(block, key, parent)

    def forget(self, block: int) -> None:
        """Drop `block`'s key, committed or pending (its content is about to change, or was
        never written); it must not be evictable."""
        assert block not in self.evictable, f"block {block} is still evictable"
        key = self.key_of[block]
        if key is None:
            return
        if self.committed[block]:
            self._uncommit_one(block, key)
        self._drop_key(block)

    def _uncommit_one(self, block: int, key: bytes) -> None:
        """`block` no longer holds the committed content `key` (it keeps its key)."""
        del self.block_of[key]
        self.committed[block] = 0
        self._journal.record(self._recommit, block, key)

    def _recommit(self, block: int, key: bytes) -> None:
        self.block_of[key] = block
        self.committed[block] = 1

    def _drop_key(self, block: int) -> None:
        self._journal.record(self._rekey, block, self.key_of[block], self.parent_of[block])
        self.key_of[block] = self.parent_of[block] = None
        self.num_keyed -= 1

    def _rekey(self, block: int, key: bytes, parent: bytes | None) -> None:
        self.key_of[block], self.parent_of[block] = key, parent
        self.num_keyed += 1

    def release(self, blocks: list[int]) -> list[int]:
        """The refcounts of `blocks` reached 0. Those holding committed content stay cached,
        evictable in the order given; the others lose their pending key, if any (their K/V was
        never certified). Returns those others: free, with no content kept. One compiled loop
        (`_rows.release_keys`)."""
        parked, freed, dropped = _rows.release_keys(blocks, self.key_of, self.parent_of,
                                                    self.committed)
        self.evictable.extend(parked)
        self.num_keyed -= len(dropped)
        self._journal.record(self._unrelease, len(parked), dropped)
        return freed

    def _unrelease(self, num_parked: int, dropped: DroppedKeys) -> None:
        self.evictable.drop_tail(num_parked)
        for block, key, parent in dropped:
            self._rekey(block, key, parent)

    def revive(self, blocks: list[int]) -> None:
        """Cache hits on evictable blocks take them back into use."""
        remove = self.evictable.remove
        links = [(block, *remove(block)) for block in blocks]
        self._journal.record(self._unrevive, links)

    def _unrevive(self, links: list[tuple[int, int, int]]) -> None:
        for block, prev, nxt in reversed(links):  # newest first: old neighbours are back
            self.evictable.insert(block, prev, nxt)

    def unpark(self, block: int) -> None:
        """Drop an evictable block's content: it leaves the LRU and its committed key (no one
        may hit it any more); the caller frees it."""
        prev, nxt = self.evictable.remove(block)
        self._journal.record(self.evictable.insert, block, prev, nxt)
        key = self.key_of[block]
        assert key is not None and self.committed[block], f"block {block} not cached"
        self._uncommit_one(block, key)
        self._drop_key(block)

    def evict(self, n: int) -> tuple[list[int], list[bytes], list[bytes]]:
        """Take the `n` least recently released cached blocks and drop their keys. Returns
        them, with the keys and parent keys they held (their token ids stay in `tokens_of`
        until they are keyed again)."""
        evictable, block_of, key_of, parent_of = (self.evictable, self.block_of, self.key_of,
                                                  self.parent_of)
        committed = self.committed
        blocks: list[int] = []
        keys: list[bytes] = []
        parents: list[bytes] = []
        for _ in range(n):
            block = evictable.pop_head()
            key, parent = key_of[block], parent_of[block]
            assert key is not None and parent is not None, f"evictable block {block} has no key"
            del block_of[key]
            committed[block] = 0
            blocks.append(block)
            keys.append(key)
            parents.append(parent)
            key_of[block] = parent_of[block] = None
        self.num_keyed -= n
        self._journal.record(self._unevict, blocks, keys, parents)
        return blocks, keys, parents

    def _unevict(self, blocks: list[int], keys: list[bytes], parents: list[bytes]) -> None:
        for block, key, parent in zip(reversed(blocks), reversed(keys), reversed(parents),
                                      strict=True):
            self._rekey(block, key, parent)
            self.block_of[key] = block
            self.committed[block] = 1
            self.evictable.put_back_head(block)

    @property
    def num_pending(self) -> int:
        """Blocks whose key is pending: filled, K/V not yet certified."""
        return self.num_keyed - len(self.block_of)

    def pending_blocks(self) -> list[int]:
        """Blocks whose key is pending (O(num_blocks): for checks)."""
        return [block for block, key in enumerate(self.key_of)
                if key is not None and not self.committed[block]]

    def check(self) -> None:
        """Assert the invariants in the module docstring."""
        for key, block in self.block_of.items():
            assert self.key_of[block] == key, f"key of block {block} disagrees with the map"
        assert sorted(self.block_of.values()) == [b for b, c in enumerate(self.committed) if c], \
            "the committed flags disagree with the map"
        for block, block_key_ in enumerate(self.key_of):
            if block_key_ is None:
                continue
            parent = self.parent_of[block]
            assert parent is not None, f"keyed block {block} lost its parent"
            content = self.keys.block(parent, self.tokens_of[block].tobytes())
            assert content == block_key_, f"block {block}'s key does not match its content"
        keyed = sum(key is not None for key in self.key_of)
        assert keyed == self.num_keyed, f"{keyed} keyed blocks, counted {self.num_keyed}"
        for block in self.evictable:
            assert self.is_committed(block), f"evictable block {block} holds no committed key"
