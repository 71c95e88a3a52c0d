"""The page broker: which format holds each page of the pool's memory, and moves between them.

The pool's memory is num_pages pages of page_bytes; each format holds whole pages (its block
pool has the blocks of the others withdrawn). At start the daemon's own model's format holds
every page but those parked for other models' reserves, so a one-model daemon never moves
one. When a call of a session of format F does not fit (the pool's `NoFit`: F has no free
block and no cached block left to evict), the service plans the pages for the blocks missing
(`plan`, into the call's `Room`) and tries the call again with them (`give`):

- F gets ceil(missing / blocks_per_page(F)) pages, never more: idle pages of other formats
  (pages with no block in use: free or cached blocks, whose cached keys go with the page), from
  the format with the most idle pages first, each format's coldest first
  (`BlockPool.idle_pages`). So cached K/V is evicted within a format by its LRU before another
  format loses a page, and across formats from the one that has the most memory doing nothing.
  Every page belongs to one format or is parked (below): a page goes straight from the format
  that gives it to the one that needs it.
- min_memory is reserved: a format never gives a page away below the pages its models'
  min_memory sum to (rounded up to whole pages), and while a format holds fewer, the idle
  pages it still lacks are left to it (another format takes pages only beyond them).
- A reserve is its model's from the start: at start, each model with a min_memory that is not
  the daemon's own has its pages (min_memory rounded up) *parked*: withdrawn from format 0,
  owned by no format, so no call of another model can use them before it registers. Its
  registration gives them to its format (`unpark`). They need no zeroing: no format used
  them since the pool was made. A model that never registers keeps them parked: that is what
  reserving means.
- A page that changes format is zeroed in its new format's view before the call's answer
  leaves: the zeroing is the first step of the call's memory work, ordered per page with the
  earlier work of the old format on the same bytes (memory_order.py keys work by page).

Pages move inside the call's transaction and those of the formats giving them (all journaled:
the withdrawals, the restore, the broker's own records), so a call that fails anyway (a later
op of a Batch, a quota, a cap) leaves every page where it was: the call, moves included, is
all-or-nothing, and the zeroing is work of the call only once it succeeds.
"""

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.daemon.service.memory_order import MemoryWork
from pagedkv.daemon.service.models import Format, Model, ModelRegistry
from pagedkv.vocab.blocks import blocks_for


@dataclass(slots=True)
class Room:
    """What one call of a format is given before it is tried (again): pages, and cached
    blocks of its model to drop (a capped model's); planned on the pool as it was before the
    call, applied inside the call's transaction."""

    # Idle pages of other formats, by format.
    taken: dict[Format, list[int]] = field(default_factory=dict)
    # The model's own oldest cached blocks and their keys (Formats.fitted).
    shed: dict[int, bytes] = field(default_factory=dict)

    def pages(self) -> list[int]:
        return [page for pages in self.taken.values() for page in pages]


# The owner of a page parked for a model that has not registered yet (`PageBroker.park`).
PARKED = -1


class PageBroker:
    """Pages between formats (see the module docstring)."""

    def __init__(self, num_pages: int, registry: ModelRegistry) -> None:
        self.num_pages = num_pages
        self._registry = registry
        # Page -> the number of the format holding it (all the daemon's own at start), or
        # PARKED.
        self.owner: list[int] = [0] * num_pages
        # Format number (or PARKED) -> pages it holds, kept with `owner`.
        self._count: Counter[int] = Counter({0: num_pages})
        # Pages that changed format so far (a counter for metrics).
        self.moves_total = 0
        # Model name -> the pages parked for its min_memory until it registers.
        self.parked: dict[str, list[int]] = {}

    def park(self) -> None:
        """At start, before any call: withdraw from format 0 the reserve (min_memory in whole
        pages) of every model with a policy but the daemon's own, the highest pages first, so
        no other model can take them before it registers. ValueError naming min_memory if the
        reserves do not fit in the pool."""
        registry = self._registry
        own = registry.formats[0]
        wanted = {name: self._pages_of(policy.min_memory)
                  for name, policy in registry.policies.items()
                  if name != registry.own.name and policy.min_memory}
        total = sum(wanted.values()) + self.reserve(own)
        if total > self.num_pages:
            raise ValueError(f"the models' min_memory ({', '.join(sorted(wanted))} and the "
                             f"daemon's own) sum to {total} pages of {registry.page_bytes} "
                             f"bytes; the pool has {self.num_pages}")
        top = self.num_pages
        for name, count in wanted.items():
            pages = list(range(top - count, top))
            top -= count
            own.pool.withdraw_pages(pages)
            for page in pages:
                self._own(page, PARKED)
            self.parked[name] = pages

    def unpark(self, model: Model) -> None:
        """Give `model`'s format the pages parked for it, if any (at its registration)."""
        pages = self.parked.pop(model.name, [])
        if pages:
            model.format.pool.restore_pages(pages)
            for page in pages:
                self._own(page, model.format.number)

    def held(self, fmt: Format) -> int:
        """Pages `fmt` holds."""
        return self._count[fmt.number]

    def plan(self, fmt: Format, missing: int, room: Room) -> bool:
        """Add to `room` (a call's, planned on the pool as it was before the call) the pages
        that `missing` more blocks of `fmt` take, as far as the policy allows: all of them, or
        none and False."""
        need = blocks_for(missing, fmt.blocks_per_page)
        owed = self._owed(fmt)
        offers = self._idle_offers(fmt, need + owed, room)
        if sum(len(idle) for _, idle in offers) < need + owed:
            return False  # not enough: the call is refused as it is
        for other, idle in offers:  # the most idle first; what is left covers the owed pages
            take = idle[:need]
            need -= len(take)
            if take:
                room.taken.setdefault(other, []).extend(take)
        return True

    def _owed(self, fmt: Format) -> int:
        """Idle pages to leave for the other formats below their reserves (what their models'
        min_memory still needs)."""
        return sum(max(0, self.reserve(other) - self.held(other))
                   for other in self._registry.formats if other is not fmt)

    def give(self, fmt: Format, room: Room, work: MemoryWork,
             withdrawn: Callable[[Format, list[int]], None]) -> None:
        """Move the pages of `room` to `fmt`, inside the transactions of `fmt` and of every
        format giving pages (the caller's), so a call that fails undoes the moves too; each
        page zeroed by `work`; `withdrawn(old format, cached blocks)` told of cached blocks that
        left with a page."""
        for other, idle in room.taken.items():
            withdrawn(other, other.pool.withdraw_pages(idle))
        pages = room.pages()
        fmt.pool.restore_pages(pages)
        k = fmt.blocks_per_page
        work.zero([b for page in pages for b in range(page * k, (page + 1) * k)])
        journal = fmt.pool.journal
        for page in pages:
            journal.record(self._own, page, self.owner[page])
            self._own(page, fmt.number)
        self.moves_total += len(pages)
        journal.record(self._unmove, len(pages))

    def _own(self, page: int, number: int) -> None:
        self._count[self.owner[page]] -= 1
        self.owner[page] = number
        self._count[number] += 1

    def _unmove(self, count: int) -> None:
        self.moves_total -= count

    def image(self) -> list[object]:
        """Which format holds each page, the moves so far and the reserves still parked, as
        plain data: for a restart snapshot (models_image.py)."""
        return [list(self.owner), self.moves_total, list(self.parked.items())]

    def restore(self, image: list[Any]) -> None:
        """Take a snapshot's `image` into this broker, once the formats' pools took theirs
        (the caller runs `check` after it)."""
        owner, self.moves_total, parked = image
        self.owner = list(owner)
        self._count = Counter(self.owner)
        self.parked = {name: list(pages) for name, pages in parked}

    def check(self) -> None:
        """Assert that each format's pool holds the pages the broker says, and that every page
        is held once (for tests)."""
        for fmt in self._registry.formats:
            held = fmt.pool.held_pages
            assert held == self.held(fmt), f"format {fmt.shape.label}: {held} pages, broker says " \
                f"{self.held(fmt)}"
        parked = sum(len(pages) for pages in self.parked.values())
        assert parked == self._count[PARKED], f"{parked} pages parked, {self._count[PARKED]} owned"
        assert sum(self._count.values()) == self.num_pages == len(self.owner), "pages miscounted"
        assert Counter(self.owner) == +self._count, "the page counts disagree with the owners"

    def reserve(self, fmt: Format) -> int:
        """Pages `fmt` keeps for its models' min_memory."""
        return self._pages_of(sum(m.policy.min_memory for m in self._registry.models_of(fmt)))

    def _pages_of(self, memory: int) -> int:
        """`memory` bytes in whole pages, rounded up."""
        page_bytes = self._registry.page_bytes
        return -(-memory // page_bytes) if page_bytes else 0

    def spare_pages(self, fmt: Format) -> int:
        """Pages `fmt` could surely be given now: pages of other formats beyond their used
        blocks and reserves (a used block pins at most one page). O(formats): what answers
        report as free."""
        spare = -self._owed(fmt)
        for other in self._registry.formats:
            if other is not fmt:
                held = self.held(other)
                stats = other.pool.stats()
                spare += max(0, min(held - stats.used_blocks, held - self.reserve(other)))
        return max(0, spare)

    def _idle_offers(self, fmt: Format, need: int,
                     room: Room) -> list[tuple[Format, list[int]]]:
        """Up to `need` idle pages of other formats, above their reserves and past what
        `room` already takes: per format, the pages it would give, the format with the most
        idle pages first."""
        if need <= 0:
            return []
        offers = []
        for other in self._registry.formats:
            taken = room.taken.get(other, [])
            spare = self.held(other) - len(taken) - self.reserve(other)
            if other is not fmt and spare > 0:
                idle = [page for page in other.pool.idle_pages() if page not in taken][:spare]
                if idle:
                    offers.append((other, idle))
        offers.sort(key=lambda offer: -len(offer[1]))  # the most idle memory first
        chosen: list[tuple[Format, list[int]]] = []
        for other, idle in offers:
            pages = idle[:need - sum(len(taken) for _, taken in chosen)]
            if pages:
                chosen.append((other, pages))
        return chosen
