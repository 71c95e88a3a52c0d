"""A per-sequence pure-Python block manager: the baseline the block-pool core is measured against.

The design of nano-vllm's `engine/block_manager.py` (a free deque, refcounts, a dict from a
chained hash of a full block's token ids to the block holding it, one call per sequence per
decoded token), written for speed: plain lists and dicts, locals cached in the hot methods, every
full block hashed exactly once with xxhash64 (seeded with its parent's hash, so the chain costs
no concatenation), no objects made per call beyond the block table's growth.

It follows `pagedkv.daemon.core.BlockPool`'s policy exactly, so that on a trace both do the same
work and hand out the same block ids (tests/benchmarks/test_reference_block_manager.py checks it):
- a new block comes from the FIFO free deque first, and only then by evicting the least
  recently released cached block;
- a full block is keyed as soon as it fills, unless another block already holds that content;
- allocation shares the longest cached prefix of full blocks and checks that the rest fits
  before it changes anything;
- a freed sequence releases its blocks deepest first; a keyed block whose refcount reaches 0
  stays cached (evictable), any other goes back to the free deque.
What it leaves out: fork and copy-on-write, salts (one namespace), batched or multi-token
appends, and the checks of caller mistakes (an unknown sequence raises KeyError). A 64-bit
non-cryptographic key can collide, so a cache hit is confirmed by comparing the block's token
ids, as nano-vllm does; pagedkv's SHA-256 keys need no such check.

The hash is a parameter, so that a benchmark can give both sides the same function:
`block_hash(chunk, parent_key)` and the first block's parent key `root` (xxhash64 seeded with
the parent, root 0, by default; `bench_core_trace.py` also passes the core's own chains).
"""

import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np
import numpy.typing as npt
from xxhash import xxh64_intdigest

# A full block's key from its token ids (int64 little-endian bytes) and its parent's key.
BlockHash = Callable[[bytes, Any], Hashable]
# Seed of the first block's hash in every sequence (there is one namespace).
ROOT_KEY = 0


class _Seq:
    """One sequence's state."""

    __slots__ = ("key", "num_tokens", "table", "tail")

    def __init__(self, table: list[int], num_tokens: int, tail: list[int],
                 key: Hashable) -> None:
        # Block table: logical block i -> physical block.
        self.table = table
        # Tokens held.
        self.num_tokens = num_tokens
        # Token ids of the unfilled last block.
        self.tail = tail
        # Hash of the last full block (the root before the first): the next block's parent.
        self.key = key


class ReferenceBlockManager:
    """Blocks of `block_size` tokens for many sequences, with prefix caching. Pure Python."""

    def __init__(self, num_blocks: int, block_size: int = 16,
                 block_hash: BlockHash = xxh64_intdigest, root: Hashable = ROOT_KEY) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # How a full block is keyed from its parent's key, and the first block's parent.
        self.block_hash = block_hash
        self.root = root
        # Refcount of each block: how many block tables reference it.
        self.ref = [0] * num_blocks
        # Blocks with no cached content, handed out oldest first.
        self.free_ids: deque[int] = deque(range(num_blocks))
        # Refcount-0 blocks that keep a keyed full block, least recently released first.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        # Hash -> block holding that content; block -> its hash (None if unkeyed) and the token
        # ids (int64 little-endian bytes) the hash was computed from.
        self.block_of: dict[Hashable, int] = {}
        self.key_of: list[Hashable | None] = [None] * num_blocks
        self.content_of: list[bytes] = [b""] * num_blocks
        # Live sequences.
        self.seqs: dict[Hashable, _Seq] = {}
        # Cached blocks evicted so far (to show a benchmark's pool was large enough).
        self.evictions = 0
        self._pack = struct.Struct(f"<{block_size}q").pack

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new block can come from: free plus evictable cached blocks."""
        return len(self.free_ids) + len(self.evictable)

    def block_table(self, seq: Hashable) -> list[int]:
        return list(self.seqs[seq].table)

    def allocate(self, seq: Hashable, token_ids: npt.NDArray[np.int64]) -> int | None:
        """A new sequence holding the prompt `token_ids`, sharing its longest cached prefix of
        full blocks. Returns the number of cached tokens, or None (and changes nothing) if the
        rest does not fit."""
        bs, n = self.block_size, len(token_ids)
        width = 8 * bs
        data = token_ids.astype("<i8", copy=False).tobytes()
        block_of, content_of, ref, block_hash = (self.block_of, self.content_of, self.ref,
                                                 self.block_hash)
        full = n // bs
        hits: list[int] = []
        key = self.root
        chunk, miss_key = b"", key  # the first missed full block, already hashed
        for i in range(full):
            chunk = data[i * width:(i + 1) * width]
            h = block_hash(chunk, key)
            block = block_of.get(h)
            if block is None or content_of[block] != chunk:
                miss_key = h
                break
            hits.append(block)
            key = h
        cached = len(hits)
        fresh = -(-n // bs) - cached
        revived = sum(1 for block in hits if ref[block] == 0)
        if fresh > len(self.free_ids) + len(self.evictable) - revived:
            return None
        evictable = self.evictable
        for block in hits:
            if ref[block] == 0:
                del evictable[block]
            ref[block] += 1
        table = hits
        if fresh:
            taken = self._take(fresh)
            table += taken
            key_of = self.key_of
            for i in range(cached, full):  # key the prompt's fresh full blocks
                if i == cached:
                    h = miss_key
                else:
                    chunk = data[i * width:(i + 1) * width]
                    h = block_hash(chunk, key)
                if h not in block_of:
                    block = table[i]
                    block_of[h] = block
                    key_of[block] = h
                    content_of[block] = chunk
                key = h
        self.seqs[seq] = _Seq(table, n, token_ids[full * bs:].tolist(), key)
        return cached * bs

    def append(self, seq: Hashable, token_id: int) -> int | None:
        """One decoded token for `seq`: a new block exactly when the last one is full, and the
        block keyed when this token fills it. Returns the token's slot, or None (and changes
        nothing) if a new block was needed and none is left."""
        s = self.seqs[seq]
        bs = self.block_size
        n = s.num_tokens
        offset = n % bs
        if offset:
            block = s.table[-1]
        else:
            free = self.free_ids
            if free:
                block = free.popleft()
            elif self.evictable:
                block = self._evict(1)[0]
            else:
                return None
            self.ref[block] = 1
            s.table.append(block)
        s.num_tokens = n + 1
        tail = s.tail
        tail.append(token_id)
        if offset == bs - 1:  # the block is full: key it
            chunk = self._pack(*tail)
            h = self.block_hash(chunk, s.key)
            s.key = h
            s.tail = []
            block_of = self.block_of
            if h not in block_of:
                block_of[h] = block
                self.key_of[block] = h
                self.content_of[block] = chunk
        return block * bs + offset

    def free(self, seq: Hashable) -> None:
        """Drop `seq`, releasing its blocks deepest first."""
        ref, key_of, free, evictable = self.ref, self.key_of, self.free_ids, self.evictable
        for block in reversed(self.seqs.pop(seq).table):
            count = ref[block] - 1
            ref[block] = count
            if count == 0:
                if key_of[block] is None:
                    free.append(block)
                else:
                    evictable[block] = None

    def _take(self, n: int) -> list[int]:
        """`n` blocks with refcount 1, from the free deque first (the caller checked that
        enough are available)."""
        free = self.free_ids
        if n <= len(free):
            blocks = [free.popleft() for _ in range(n)]
        else:
            blocks = list(free)
            free.clear()
            blocks += self._evict(n - len(blocks))
        ref = self.ref
        for block in blocks:
            ref[block] = 1
        return blocks

    def _evict(self, n: int) -> list[int]:
        """Take the `n` least recently released cached blocks and drop their keys."""
        evictable, block_of, key_of = self.evictable, self.block_of, self.key_of
        blocks = []
        for _ in range(n):
            block, _ = evictable.popitem(last=False)
            key = key_of[block]
            assert key is not None, f"evictable block {block} has no key"
            del block_of[key]
            key_of[block] = None
            blocks.append(block)
        self.evictions += n
        return blocks
