"""Distinct blocks held by each group of sequences (a session, a tenant), kept as tables change.

A figure such as "blocks this session holds" is a count of distinct blocks over many tables;
recounting it walks every table entry. Here it is kept up to date by the operations, so reading
it costs O(1) whatever the pool holds, and the journal undoes it with the rest.

How: most used blocks are referenced by tables of one group only, and then the group's count of
references to the block is its refcount. `owner[b]` names that group; a block referenced by
several groups is marked MIXED and keeps, in `mixed[b]`, each group's references. A group
holds a block while it has a reference to it: `held[g]` counts those blocks. Fresh blocks
(refcount 0 -> 1) and drops of a sole owner's references are vectorized; only blocks shared
between groups take a Python step each, which happens where a call already walks them.

`owner[b]` is meaningful while block b is used (refcount > 0).
"""

import contextlib
from collections.abc import Iterator, Sequence

import numpy as np

from pagedkv.daemon.core.journal import Journal
from pagedkv.daemon.core.table_store import Int64Array

# `owner` of a block referenced by tables of several groups.
MIXED = -1


class Holders:
    """Distinct blocks held per group, for one way of grouping sequences (see the module)."""

    def __init__(self, num_blocks: int, journal: Journal) -> None:
        self._journal = journal
        # The one group whose tables reference each used block, or MIXED.
        self.owner: Int64Array = np.full(num_blocks, MIXED, dtype=np.int64)
        # Block -> group -> references, for MIXED blocks only.
        self.mixed: dict[int, dict[int, int]] = {}
        # Group -> distinct blocks its tables reference (groups holding none are absent).
        self.held: dict[int, int] = {}

    def add(self, groups: Int64Array, blocks: Int64Array, before: Int64Array) -> None:
        """Tables of groups[i] gained a reference to blocks[i] (distinct), whose refcount was
        before[i]."""
        fresh = before == 0
        if fresh.all():
            self._take(groups, blocks)
            return
        self._take(groups[fresh], blocks[fresh])
        rest = (~fresh).nonzero()[0]
        other = rest[self.owner[blocks[rest]] != groups[rest]]  # a sole owner's: no change
        for i in other.tolist():
            self._join(int(groups[i]), int(blocks[i]), int(before[i]))

    def drop(self, group: int, blocks: Int64Array, after: Int64Array) -> None:
        """Tables of `group` lost a reference to each of `blocks` (distinct), whose refcount
        is now after[i]."""
        owner = self.owner[blocks]
        gone = int(np.count_nonzero((owner == group) & (after == 0)))
        if gone:
            self._shift(group, -gone)
        for block in blocks[owner == MIXED].tolist():
            self._leave(group, block)

    def _take(self, groups: Int64Array, blocks: Int64Array) -> None:
        if not len(blocks):
            return
        self._journal.record(self._set_owner, blocks, self.owner[blocks])
        self.owner[blocks] = groups
        for group, count in _counts(groups):
            self._shift(group, count)

    def _join(self, group: int, block: int, before: int) -> None:
        """`group` adds a reference to a used block that is not its alone."""
        self._save(block)
        owner = int(self.owner[block])
        if owner != MIXED:
            self.mixed[block] = {owner: before}
            self.owner[block] = MIXED
        refs = self.mixed[block]
        if group not in refs:
            self._shift(group, 1)
        refs[group] = refs.get(group, 0) + 1

    def _leave(self, group: int, block: int) -> None:
        """`group` drops a reference to a MIXED block; one group left owns it alone."""
        self._save(block)
        refs = self.mixed[block]
        refs[group] -= 1
        if not refs[group]:
            del refs[group]
            self._shift(group, -1)
        if len(refs) == 1:
            (self.owner[block],) = refs
            del self.mixed[block]

    def _save(self, block: int) -> None:
        if self._journal.active:
            refs = self.mixed.get(block)
            self._journal.record(self._restore, block, int(self.owner[block]),
                                 None if refs is None else dict(refs))

    def _restore(self, block: int, owner: int, refs: dict[int, int] | None) -> None:
        self.owner[block] = owner
        if refs is None:
            self.mixed.pop(block, None)
        else:
            self.mixed[block] = refs

    def _set_owner(self, blocks: Int64Array, owners: Int64Array) -> None:
        self.owner[blocks] = owners

    def _shift(self, group: int, delta: int) -> None:
        held = self.held.get(group, 0) + delta
        if held:
            self.held[group] = held
        else:
            del self.held[group]
        self._journal.record(self._shift, group, -delta)

    def check(self, groups: Int64Array, blocks: Int64Array) -> None:
        """Assert the counts against a recount from every table entry: groups[i] references
        blocks[i]."""
        pairs = set(zip(groups.tolist(), blocks.tolist(), strict=True))
        recount: dict[int, int] = {}
        for group, _ in pairs:
            recount[group] = recount.get(group, 0) + 1
        assert self.held == recount, f"held blocks {self.held}, recounted {recount}"
        by_block: dict[int, set[int]] = {}
        for group, block in pairs:
            by_block.setdefault(block, set()).add(group)
        for block, holders in by_block.items():
            owner = int(self.owner[block])
            assert (owner == MIXED) == (len(holders) > 1), f"block {block}: owner {owner}"
            assert owner == MIXED or holders == {owner}, f"block {block} owned by {owner}"
            assert owner != MIXED or set(self.mixed[block]) == holders, f"block {block} mixed"
        assert set(self.mixed) <= set(by_block), "a block no table holds is marked MIXED"


class HeldBlocks:
    """A pool's Holders, one per level of grouping (none until `track`), and the groups of
    the sequences it makes now (`holding`)."""

    def __init__(self) -> None:
        # One Holders per level (the service: by session, by tenant).
        self.levels: list[Holders] = []
        # The groups of sequences made inside `holding`, one per level.
        self._current: Int64Array | None = None

    def track(self, levels: int, num_blocks: int, journal: Journal) -> None:
        self.levels = [Holders(num_blocks, journal) for _ in range(levels)]

    @contextlib.contextmanager
    def holding(self, groups: Sequence[int]) -> Iterator[None]:
        """Sequences made inside belong to `groups`, one per level."""
        assert len(groups) == len(self.levels), f"{len(groups)} groups for {len(self.levels)}"
        self._current = np.array(groups, dtype=np.int64)
        try:
            yield
        finally:
            self._current = None

    def current(self) -> Int64Array:
        """The groups of a sequence being made (inside `holding`)."""
        assert self._current is not None, "a sequence made outside `holding`"
        return self._current

    def held(self, level: int, group: int) -> int:
        return self.levels[level].held.get(group, 0)

    def add(self, groups: Int64Array, blocks: Int64Array, before: Int64Array) -> None:
        """A sequence of `groups` (one per level) references `blocks`, whose refcounts were
        `before`."""
        for holders, group in zip(self.levels, groups.tolist(), strict=True):
            holders.add(np.full(len(blocks), group, dtype=np.int64), blocks, before)

    def drop(self, groups: Int64Array, blocks: Int64Array, after: Int64Array) -> None:
        """A sequence of `groups` dropped its references to `blocks`, whose refcounts are now
        `after`."""
        for holders, group in zip(self.levels, groups.tolist(), strict=True):
            holders.drop(group, blocks, after)


def _counts(groups: Int64Array) -> Iterator[tuple[int, int]]:
    """(group, how many times it appears) for the groups in `groups`; one group: no sort."""
    first = int(groups[0])
    if (groups == first).all():
        yield first, len(groups)
        return
    values, counts = np.unique(groups, return_counts=True)
    yield from zip(values.tolist(), counts.tolist(), strict=True)
