"""The O(entries) checks of a `BlockPool`: its invariants, and its kept figures recounted.

`BlockPool.stats` is O(1), read from totals the operations keep as they go; here every table
entry is walked instead, so a total kept wrong shows as a difference. The tests run these after
every step (`BlockPool.check_invariants`); the figures benchmark times the recount.
"""

import numpy as np

from pagedkv.daemon.core.holders import HeldBlocks
from pagedkv.daemon.core.pages import Pages
from pagedkv.daemon.core.physical_blocks import PhysicalBlocks
from pagedkv.daemon.core.seq_table import Int64Array, SeqTable
from pagedkv.daemon.core.table_store import ragged_arange
from pagedkv.daemon.core.types import PoolStats
from pagedkv.vocab.blocks import blocks_for


def table_entries(seqs: SeqTable) -> tuple[Int64Array, Int64Array, Int64Array]:
    """Live rows, then every table entry's block and the slots it fills for its row."""
    bs = seqs.block_size
    rows = np.fromiter(seqs.row_of.values(), dtype=np.int64, count=len(seqs.row_of))
    counts = seqs.num_blocks[rows]
    entry_row = np.repeat(rows, counts)
    logical = ragged_arange(counts)
    fills = np.clip(seqs.num_tokens[entry_row] - logical * bs, 0, bs)  # reserved entries: 0
    return rows, seqs.entries(entry_row, logical), fills


def recount_stats(seqs: SeqTable, blocks: PhysicalBlocks, pages: Pages) -> PoolStats:
    """`BlockPool.stats` recounted from every table entry (and the held pages)."""
    rows, entries, fills = table_entries(seqs)
    per_block = np.zeros(blocks.num_blocks, dtype=np.int64)
    np.maximum.at(per_block, entries, fills)  # a shared block counts once, at its fullest
    used = int(np.count_nonzero(blocks.ref))
    cache = blocks.cache
    return PoolStats(
        num_blocks=int(pages.held.sum()) * pages.blocks_per_page, block_size=seqs.block_size,
        free_blocks=blocks.num_available, used_blocks=used,
        cached_blocks=len(cache.evictable), pending_blocks=cache.num_pending,
        filled_slots=int(per_block.sum()),
        allocated_slots=used * seqs.block_size,
        logical_tokens=int(seqs.num_tokens[rows].sum()), num_sequences=len(rows),
        prefix_cache_queries=cache.queries, prefix_cache_hits=cache.hits)


def check_pool(seqs: SeqTable, blocks: PhysicalBlocks, pages: Pages, held: HeldBlocks,
               kept: PoolStats) -> None:
    """Assert the invariants of the blocks (`PhysicalBlocks`, `PrefixCache`, `Pages`), the
    tables (`SeqTable`) and the holder counts together, and that the figures `kept` equal a
    recount."""
    rows, entries, fills = table_entries(seqs)
    blocks.check(entries, blocks.num_blocks - pages.held_blocks)
    pages.check()
    seqs.check()
    bs = seqs.block_size
    expected = blocks_for(seqs.num_tokens[rows], bs)
    assert (seqs.num_blocks[rows] >= expected).all(), "a table is under ceil(tokens / B) long"
    reserved = entries[fills == 0]  # blocks past their row's tokens
    assert (blocks.ref[reserved] == 1).all(), "a reserved block is shared"
    assert all(blocks.cache.key_of[block] is None for block in reserved.tolist()), \
        "a reserved block is keyed"
    assert (seqs.committed[rows] <= seqs.num_tokens[rows] // bs).all(), \
        "a row committed more blocks than it has full"
    for row in rows.tolist():
        table = seqs.table(row)
        assert len(np.unique(table)) == len(table), f"row {row} holds a block twice"
    assert not set(seqs.free_rows) & set(rows.tolist()), "a live row is on the free list"
    recount = recount_stats(seqs, blocks, pages)
    assert kept == recount, f"figures kept {kept} differ from a recount {recount}"
    entry_rows = np.repeat(rows, seqs.num_blocks[rows])
    for level, holders in enumerate(held.levels):
        holders.check(seqs.groups[entry_rows, level], entries)
