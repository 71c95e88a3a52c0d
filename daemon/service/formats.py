"""The formats of one pool and the calls fitted into them (kvpool.proto, "Models and pages").

`Formats` builds format 0 (the daemon's own model's, over the pool the daemon made, holding
every page) and one format per other geometry a runner registers (a `BlockPool` over every
page's block ids, all withdrawn, and its view of the pool memory), and applies each call in its
session's format (`fitted`):

- A call that does not fit (`PoolFull`) is undone, the page broker plans the pages its format
  lacks (pages.py: all of them or none), and it is tried again with them.
- A call that would take its model past max_memory (`ModelAtCap`) is undone, and tried again
  with as many of the model's own oldest cached blocks dropped as it is over; when its cache
  cannot cover that, the call is refused: RESOURCE_EXHAUSTED, cause "ModelAtCap", naming the
  model and its cap.

A retry applies what it was given (pages moved and zeroed, cached blocks dropped) inside the
transactions of the call's format and of the formats giving pages, so a refused call changes
nothing at all, those included. Each retry plans at least one more page or cached block, of
finitely many, so the loop ends.
"""

import contextlib
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar, runtime_checkable

from pagedkv.daemon.core import BlockPool, PrefixHash
from pagedkv.daemon.core.host_tier import HostTier
from pagedkv.daemon.events.sink import KVEventSink, SnapshotItem
from pagedkv.daemon.service.answer_size import AnswerBudget
from pagedkv.daemon.service.cache_hygiene import CacheHygiene
from pagedkv.daemon.service.errors import ModelAtCap, PoolFull
from pagedkv.daemon.service.host_copies import HostCopies
from pagedkv.daemon.service.kv_events import FormatEvents
from pagedkv.daemon.service.limits import Limits
from pagedkv.daemon.service.memory_order import BlockMemory, MemoryWork
from pagedkv.daemon.service.models import (
    Format,
    KvShape,
    Model,
    ModelFigures,
    ModelPolicy,
    ModelRegistry,
)
from pagedkv.daemon.service.pages import PageBroker, Room
from pagedkv.daemon.service.session_ops import SessionOps
from pagedkv.vocab.blocks import blocks_for
from pagedkv.vocab.geometry import ModelGeometry, canonical_dtype

T = TypeVar("T")


@runtime_checkable
class Arena(Protocol):
    """What the formats need of the pool memory's arena (kv_memory.KVMemory)."""

    def view(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: str,
             block_size: int, /) -> BlockMemory: ...


class Formats:
    """Every format of one pool, its models and its pages (see the module docstring)."""

    def __init__(self, pool: BlockPool, memory: BlockMemory | None,
                 geometry: ModelGeometry | None, *, limits: Limits, zero_blocks: bool,
                 prefix_hash: PrefixHash, page_bytes: int, policies: dict[str, ModelPolicy],
                 max_models: int, lends_pages: bool) -> None:
        self._memory = memory
        self._limits = limits
        self._zero = zero_blocks
        self._prefix_hash = prefix_hash
        # Where KV events go, whether every salt's blocks are published, the public salts
        # (None: off).
        self._events: tuple[KVEventSink, bool, frozenset[bytes]] | None = None
        own = self._own_format(pool, memory, geometry, page_bytes)
        # The models; the daemon's own model is model 0 of format 0.
        self.models = ModelRegistry(
            geometry.name if geometry is not None else "default", own,
            page_bytes=page_bytes or own.bytes_per_block, policies=policies,
            max_models=max_models, new_format=self._new_format)
        # Pages of page_bytes, and which format holds each (pages.py).
        self.pages = PageBroker(pool.num_blocks // own.blocks_per_page, self.models)
        # Whether format 0's pool gives pages to other formats (PoolService's `lends_pages`).
        self._lends_pages = lends_pages
        if lends_pages:
            self.pages.park()

    def _own_format(self, pool: BlockPool, memory: BlockMemory | None,
                    geometry: ModelGeometry | None, page_bytes: int) -> Format:
        """Format 0, holding every page (`page_bytes` 0: one block a page)."""
        if geometry is None:
            shape = KvShape(0, 0, 0, "float32")  # a bookkeeping-only pool: one format
        else:
            handle = memory.handle() if memory is not None else None
            shape = KvShape(geometry.num_layers, geometry.num_kv_heads, geometry.head_dim,
                            canonical_dtype(handle.dtype if handle is not None
                                            else geometry.default_dtype))
        per_block = shape.bytes_per_block(pool.block_size)
        if page_bytes and (not per_block or page_bytes % per_block):
            raise ValueError(f"page_bytes={page_bytes} is not a multiple of the model's "
                             f"{per_block} bytes per block")
        blocks_per_page = page_bytes // per_block if page_bytes else 1
        if pool.blocks_per_page != blocks_per_page:
            raise ValueError(f"the pool has {pool.blocks_per_page} blocks a page, page_bytes="
                             f"{page_bytes} makes {blocks_per_page}")
        return self._format(0, shape, pool, memory, blocks_per_page, per_block)

    def _new_format(self, number: int, shape: KvShape, blocks_per_page: int) -> Format:
        """A format for another geometry: every block id of every page, all withdrawn."""
        own = self.models.formats[0].pool
        pool = BlockPool(self.pages.num_pages * blocks_per_page, own.block_size,
                         own.enable_prefix_caching, self._prefix_hash,
                         blocks_per_page=blocks_per_page, withdrawn=True)
        arena = self._arena()
        memory: BlockMemory | None = None if arena is None else arena.view(
            shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype, pool.block_size)
        return self._format(number, shape, pool, memory, blocks_per_page,
                            shape.bytes_per_block(pool.block_size))

    def _format(self, number: int, shape: KvShape, pool: BlockPool,
                memory: BlockMemory | None, blocks_per_page: int, per_block: int) -> Format:
        pool.track_holders(3)  # by session, by tenant, by model
        fmt = Format(number, shape, per_block, blocks_per_page, pool,
                     SessionOps(pool, self._limits, self._zero), CacheHygiene(pool, self._zero),
                     memory)
        fmt.ops.revived = fmt.hygiene.cached.left
        fmt.ops.drain = fmt.hygiene.drain
        if self._events is not None:
            fmt.hygiene.events = FormatEvents(pool, *self._events)
        return fmt

    def publish_events(self, sink: KVEventSink, all_salts: bool,
                       public_salts: frozenset[bytes] = frozenset()) -> None:
        """From now on, tell `sink` the committed blocks every format gains and loses
        (kv_events.py): those under `public_salts`, every salt's with `all_salts`; before any
        session exists."""
        self._events = (sink, all_salts, public_salts)
        for fmt in self.models.formats:
            fmt.hygiene.events = FormatEvents(fmt.pool, sink, all_salts, public_salts)

    def attach_host_tier(self, num_slots: int) -> HostTier:
        """Give format 0 (the daemon's own model's) a host tier of `num_slots` slots
        (host_copies.py); other formats have none. Before any session exists."""
        fmt = self.models.formats[0]
        tier = fmt.pool.attach_host_tier(num_slots)
        fmt.hygiene.host = HostCopies(tier, self._zero)
        return tier

    def kv_snapshot(self) -> Iterator[SnapshotItem]:
        """Every block published when it is called, per model in chunks, parents first:
        what a subscriber rebuilds its index from (the `Snapshot` of daemon/events/sink.py;
        blocks gone between two chunks are skipped)."""
        sources = [fmt.hygiene.events for fmt in self.models.formats]
        return (chunk for events in sources if events is not None
                for chunk in events.snapshot())

    def register(self, name: str, shape: KvShape, runner_target: str) -> Model:
        """Register a runner's model (models.py), giving its format the pages parked for its
        min_memory. A new geometry needs a pool that lends pages and, with memory, per-format
        views of it."""
        many = self._lends_pages and (self._memory is None or self._arena() is not None)
        model = self.models.register(name, shape, runner_target, many)
        self.pages.unpark(model)  # its reserve, parked since start
        return model

    def _arena(self) -> Arena | None:
        """The arena under format 0's memory, which makes the other formats' views; None for
        a bookkeeping-only pool or memory without one (a test's wrapper)."""
        arena = getattr(self._memory, "arena", None)
        return arena if isinstance(arena, Arena) else None

    def fitted(self, model: Model, work: MemoryWork, answer: AnswerBudget,
               body: Callable[[], T]) -> T:
        """`body` (a call of a session of `model`) applied all-or-nothing in the model's
        format, fitted as the module docstring says."""
        fmt, capped = model.format, bool(model.policy.max_memory)
        before = model.memory_bytes() if capped else 0  # a model with no cap: no cost
        room: Room | None = None  # made only when a call needs room (rarely)
        mark, used = len(work.steps), answer.used
        while True:
            try:
                if room is None:  # the usual case: one try
                    with fmt.pool.transaction():
                        result = body()
                        if capped:
                            _check_cap(model, before)
                    return result
                return self._with_room(model, room, work, before, body)
            except PoolFull as full:
                del work.steps[mark:]
                answer.used = used
                room = room or Room()
                if not self.pages.plan(fmt, full.needed - full.available, room):
                    raise
            except ModelAtCap as cap:
                del work.steps[mark:]
                answer.used = used
                room = room or Room()
                cached = fmt.hygiene.cached.blocks_of(model.number)
                want = len(room.shed) + cap.excess_blocks
                if want > len(cached):
                    raise  # its own cache cannot make room: refused, nothing changed
                room.shed = dict(list(cached.items())[:want])

    def _with_room(self, model: Model, room: Room, work: MemoryWork, before: int,
                   body: Callable[[], T]) -> T:
        """One try of a call given `room`: the pages moved and the cached blocks dropped
        inside the transactions of its format and of every format giving pages, so a call that
        fails undoes them with the rest."""
        fmt = model.format
        with contextlib.ExitStack() as stack:
            stack.enter_context(fmt.pool.transaction())
            for other in room.taken:
                stack.enter_context(other.pool.transaction())
            if room.taken:
                self.pages.give(fmt, room, work, _withdrawn)
            if room.shed:
                fmt.hygiene.drop(room.shed, work)
            result = body()
            if model.policy.max_memory:
                _check_cap(model, before)
        return result

    def figures(self) -> list[ModelFigures]:
        """Every model's figures now (O(models))."""
        return [ModelFigures(model, model.format.pool.blocks_held(2, model.number),
                             model.format.hygiene.cached.count(model.number),
                             self.pages.held(model.format)) for model in self.models]

    def free_blocks(self, model: Model) -> int:
        """Blocks of the model's format a call could surely get now: its free and evictable
        blocks, and the blocks of the pages the broker could surely give it (pages of other
        formats beyond both their used blocks and their reserves). O(formats)."""
        fmt = model.format
        free = fmt.pool.num_free_blocks
        if len(self.models.formats) == 1:
            return free
        pages = self.pages.spare_pages(fmt)
        return free + pages * fmt.blocks_per_page


def _check_cap(model: Model, before: int) -> None:
    """ModelAtCap if the change took the model's memory up and past its max_memory."""
    cap = model.policy.max_memory
    after = model.memory_bytes()
    if after > cap and after > before:
        raise ModelAtCap(f"model {model.name!r} is at its cap: the call would take its memory "
                         f"to {after} bytes; max_memory={cap}",
                         blocks_for(after - cap, model.format.bytes_per_block))


def _withdrawn(fmt: Format, blocks: list[int]) -> None:
    """Cached blocks of `fmt` left with a page given to another format."""
    fmt.hygiene.withdrawn(blocks)
