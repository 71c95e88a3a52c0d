"""Which model each committed cached block of a format belongs to (its memory, its sleep).

A format's prefix cache is one LRU for every model of its geometry; a model's memory counts
the committed cached blocks it left there, and its sleep drops them. The pool tells the
service, per call, which blocks a call parked in the cache and which it evicted
(`cache_events.py`); a block parked by a session of model M is M's until it is evicted, dropped
(`uncache`), withdrawn with its page, or revived by a prefix hit (it is then held by a
sequence, and counted as used instead). Every change goes through the pool's journal, so a
call that fails leaves the record as it was.
"""

from collections import Counter

from pagedkv.daemon.core import Journal


class ModelCache:
    """Cached blocks by model, for one format (see the module docstring)."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        # Block -> (model number, the committed key it was parked under).
        self._of: dict[int, tuple[int, bytes]] = {}
        # Model number -> blocks of `_of` that are its.
        self._count: Counter[int] = Counter()

    def count(self, model: int) -> int:
        return self._count[model]

    def park(self, entries: list[tuple[int, int, bytes]]) -> None:
        """Sessions left these blocks cached: (block, model, key) each, with one undo record
        (a freed sequence parks its table's committed blocks, an eviction to the host tier
        every copy it makes)."""
        old = [(block, self._of.get(block)) for block, _, _ in entries]
        self._journal.record(self._restore, old)
        for block, model, key in entries:
            self._put(block, (model, key))

    def left(self, blocks: list[int]) -> None:
        """These blocks left the cache (evicted, dropped, withdrawn) or were revived. One undo
        record: an eviction runs this for every block it takes."""
        of = self._of
        gone = [(block, of[block]) for block in blocks if block in of]
        if not gone:
            return
        self._journal.record(self._restore, gone)
        for block, _ in gone:
            self._put(block, None)

    def _restore(self, old: list[tuple[int, tuple[int, bytes] | None]]) -> None:
        for block, entry in reversed(old):
            self._put(block, entry)

    def entry(self, block: int) -> tuple[int, bytes] | None:
        """`block`'s model number and key, if it is recorded."""
        return self._of.get(block)

    def blocks_of(self, model: int) -> dict[int, bytes]:
        """The model's cached blocks and their keys, oldest parked first (O(cached))."""
        return {block: key for block, (owner, key) in self._of.items() if owner == model}

    def image(self) -> list[tuple[int, int, bytes]]:
        """The record as (block, model, key), oldest parked first: for a snapshot."""
        return [(block, model, key) for block, (model, key) in self._of.items()]

    def restore(self, image: list[tuple[int, int, bytes]]) -> None:
        """Take a snapshot's record (`image`) into an empty one."""
        for block, model, key in image:
            self._put(block, (model, key))

    def check(self, cached: dict[int, bytes]) -> None:
        """Assert that the record is exactly the format's cached blocks (`cached`: block ->
        key), each under its key, and that the counts agree (for tests)."""
        assert set(self._of) == set(cached), (
            f"cached blocks of no model {sorted(set(cached) - set(self._of))[:8]}, recorded "
            f"blocks not cached {sorted(set(self._of) - set(cached))[:8]}")
        for block, (_, key) in self._of.items():
            assert cached[block] == key, f"block {block} is cached under another key"
        assert +self._count == Counter(owner for owner, _ in self._of.values()), "miscounted"

    def _put(self, block: int, entry: tuple[int, bytes] | None) -> None:
        old = self._of.pop(block, None)
        if old is not None:
            self._count[old[0]] -= 1
        if entry is not None:
            self._of[block] = entry
            self._count[entry[0]] += 1
