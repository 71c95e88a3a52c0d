"""Which cached blocks each private-salt session left, so they go when it ends.

A session that gave no cache_salt has a salt of its own: once it ends, no one can ever hit
what it left cached, in the pool (`cache_hygiene.py`, by block id) or in the host tier
(`host_copies.py`, by host slot: one record per id space). Every change goes through the pool's
journal, so a call that fails leaves the record as it was.
"""

from pagedkv.daemon.core import Journal


class PrivateBlocks:
    """Which cached blocks each private-salt session left, so they go when it ends."""

    def __init__(self, journal: Journal) -> None:
        self._journal = journal
        # Session number -> {block: the committed key it was parked under}.
        self._of: dict[int, dict[int, bytes]] = {}
        # Block -> the session number whose record holds it (at most one: a block is parked
        # by one session at a time, and leaves the record when evicted).
        self._owner: dict[int, int] = {}

    def park(self, number: int, blocks: list[int], keys: list[bytes]) -> None:
        """Session `number` left these blocks cached, each under its key (one undo record: a
        freed sequence parks its table's committed blocks together)."""
        self._journal.record(self._restore_all, [(block, *self._entry(block)) for block in blocks])
        for block in blocks:
            self._forget(block)  # from any record, this session's among them
        record = self._of.setdefault(number, {})
        record.update(zip(blocks, keys, strict=True))
        self._owner.update(dict.fromkeys(blocks, number))

    def evicted(self, blocks: list[int]) -> None:
        """These blocks left the cache for a new owner: no session's record holds them now."""
        for block in blocks:
            if block in self._owner:
                self._journal.record(self._restore, block, *self._entry(block))
                self._forget(block)

    def owner_of(self, block: int) -> int | None:
        """The session whose record holds `block`, if any."""
        return self._owner.get(block)

    def _entry(self, block: int) -> tuple[int | None, bytes | None]:
        """The session whose record holds `block`, and the key there (None, None if none)."""
        owner = self._owner.get(block)
        return (None, None) if owner is None else (owner, self._of[owner][block])

    def release(self, number: int) -> dict[int, bytes]:
        """Session `number` has ended: its record, removed."""
        record = self._of.pop(number, {})
        for block in record:
            del self._owner[block]
        self._journal.record(self._unrelease, number, record)
        return record

    def _forget(self, block: int) -> None:
        owner = self._owner.pop(block, None)
        if owner is not None:
            record = self._of[owner]
            del record[block]
            if not record:
                del self._of[owner]

    def _restore(self, block: int, owner: int | None, key: bytes | None) -> None:
        self._forget(block)
        if owner is not None and key is not None:
            self._of.setdefault(owner, {})[block] = key
            self._owner[block] = owner

    def _restore_all(self, entries: list[tuple[int, int | None, bytes | None]]) -> None:
        for block, owner, key in reversed(entries):
            self._restore(block, owner, key)

    def _unrelease(self, number: int, record: dict[int, bytes]) -> None:
        if record:
            self._of[number] = record
            self._owner.update(dict.fromkeys(record, number))

    def image(self) -> list[tuple[int, int, bytes]]:
        """The records as (session number, block, key): for a snapshot."""
        return [(number, block, key) for number, record in self._of.items()
                for block, key in record.items()]

    def restore(self, image: list[tuple[int, int, bytes]]) -> None:
        """Take a snapshot's records (`image`) into empty ones."""
        for number, block, key in image:
            self._of.setdefault(number, {})[block] = key
            self._owner[block] = number

    def check(self, live: set[int], cached: dict[int, bytes]) -> None:
        """Assert that only live sessions have records, each of blocks cached under the
        recorded key or in use again (revived by their session), and that the two maps agree."""
        assert set(self._of) <= live, f"records of ended sessions {set(self._of) - live}"
        for number, record in self._of.items():
            assert record, f"an empty record for session {number}"
            for block, key in record.items():
                assert self._owner[block] == number, f"block {block}'s owner disagrees"
                assert cached.get(block, key) == key, f"block {block} is cached under another key"
        assert len(self._owner) == sum(map(len, self._of.values())), "a block recorded twice"
