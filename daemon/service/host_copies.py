"""The service's part of the host-memory tier: the copies' memory work, owners and events.

The pool decides what moves (`core/host_tier.py`: an evicted committed block is copied to a host
slot, a prefix hit in the host tier restores a slot into a fresh block); this module turns each
move into the call's memory work and keeps the records that tenancy and models need, all through
the pool's journal (a failed call leaves them as they were):

- Memory work: a copy to the host tier is a step of the evicting call's work, recorded before
  the evicted block's zeroing and before the call's own copies, so the old K/V is read before
  anything writes the block; a restore is a step of the allocating call's work, which its answer
  waits for. Both are ordered with every other call's work by block and by slot
  (`memory_order.py`).
- Private salts: a block a private-salt session left cached is that session's alone; its host
  copy is too (`private`, by slot), and is dropped when the session ends, as its cached blocks
  are (`cache_hygiene.py`).
- Models: a host copy belongs to the model whose session left the block cached (`models`, by
  slot); putting the model to sleep drops its copies with its cached blocks.
- Zeroing: with `zero_freed_blocks`, a copy dropped for those reasons is zeroed. A copy dropped
  to make room is overwritten at once by the copy that took its slot.
- KV events: a published block copied to the host tier is announced stored with medium "CPU";
  a published copy leaving it, removed with medium "CPU" (`kv_events.py`).
"""

from pagedkv.daemon.core.host_tier import HostTier, Stored
from pagedkv.daemon.service.kv_events import FormatEvents
from pagedkv.daemon.service.memory_order import MemoryWork
from pagedkv.daemon.service.model_cache import ModelCache
from pagedkv.daemon.service.private_blocks import PrivateBlocks


class HostCopies:
    """The host tier of one format, seen from the service (see the module docstring)."""

    def __init__(self, tier: HostTier, zero_slots: bool) -> None:
        self.tier = tier
        journal = tier.journal
        # Zero the copies dropped with a private session or a sleeping model.
        self.zero_slots = zero_slots
        # Slot -> the live private-salt session whose block it copies.
        self.private = PrivateBlocks(journal)
        # Slot -> the model whose block it copies.
        self.models = ModelCache(journal)

    def offloaded(self, blocks: list[int], stored: Stored, work: MemoryWork,
                  owners: "Owners", events: FormatEvents | None) -> None:
        """Copies of some of the just-evicted `blocks` went to host slots (`stored`), before
        the evicting call hands the blocks out; `owners` says whose they were."""
        dropped = [slot for slot, _ in stored.dropped]
        self._forget(dropped)
        moved = [(blocks[index], slot) for index, slot in stored.copied]
        models: list[tuple[int, int, bytes]] = []
        key_of = self.tier.key_of
        for block, slot in moved:
            key = key_of[slot]
            assert key is not None
            session, model = owners.private_owner(block), owners.model_of(block)
            if session is not None:
                self.private.park(session, [slot], [key])
            if model is not None:
                models.append((slot, model, key))
        self.models.park(models)
        work.to_host([block for block, _ in moved], [slot for _, slot in moved])
        if events is not None:
            events.host_dropped(dropped)
            tokens = self.tier.tokens_of
            events.offloaded([(block, slot, tokens[slot].tolist()) for block, slot in moved])

    def restored(self, slots: list[int], blocks: list[int], work: MemoryWork) -> None:
        """An allocation fills fresh `blocks` from `slots` before its answer leaves."""
        work.from_host(slots, blocks)

    def session_ended(self, number: int, private: bool, work: MemoryWork,
                      events: FormatEvents | None) -> list[int]:
        """A session ended: the copies of a private-salt session's blocks go; returns them."""
        record = self.private.release(number)
        return self.drop(list(record), work, events) if private else []

    def model_asleep(self, model: int, work: MemoryWork, events: FormatEvents | None) -> list[int]:
        """A model sleeps: its copies go with its cached blocks; returns them."""
        return self.drop(list(self.models.blocks_of(model)), work, events)

    def drop(self, slots: list[int], work: MemoryWork, events: FormatEvents | None) -> list[int]:
        """Drop the copies in `slots` that the tier still holds (zeroed when zeroing is on)."""
        dropped = [slot for slot, _ in self.tier.drop(slots)]
        self._forget(dropped)
        if events is not None:
            events.host_dropped(dropped)
        if self.zero_slots:
            work.zero_host(dropped)
        return dropped

    def _forget(self, slots: list[int]) -> None:
        self.private.evicted(slots)
        self.models.left(slots)

    def check(self, live: set[int]) -> None:
        """Assert the records' invariants against the tier's held slots (for tests)."""
        held = {slot: key for key, slot in self.tier.slot_of.items()}
        self.private.check(live, held)
        self.models.check(held)


class Owners:
    """Who owned an evicted block, asked before the pool's records forget it."""

    def __init__(self, private: PrivateBlocks, models: ModelCache) -> None:
        self._private = private
        self._models = models

    def private_owner(self, block: int) -> int | None:
        return self._private.owner_of(block)

    def model_of(self, block: int) -> int | None:
        entry = self._models.entry(block)
        return None if entry is None else entry[0]
