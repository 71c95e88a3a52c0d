"""The whole state of a BlockPool as plain data, to prove that a rolled-back change left it
exactly as it was (free-list order, LRU order, keys pending and committed, every row, the
held pages)."""

from pagedkv.daemon.core import BlockPool

# Where pool_state keeps the sequences' rows (seq -> (num_tokens, committed, table, ...)).
ROWS = 9


def pool_state(pool: BlockPool) -> tuple[object, ...]:
    blocks, seqs = pool._blocks, pool._seqs
    cache = blocks.cache
    rows = {seq: (int(seqs.num_tokens[row]), int(seqs.committed[row]), pool.block_table(seq),
                  seqs.partial[row, : int(seqs.num_tokens[row]) % pool.block_size].tolist()
                  if seqs.chain_ok[row] else None,
                  bool(seqs.chain_ok[row]), seqs.chain_key[row] if seqs.chain_ok[row] else None)
            for seq, row in seqs.row_of.items()}
    return (blocks.ref.tolist(), list(blocks.free), list(cache.evictable),
            dict(cache.block_of), list(cache.key_of), list(cache.parent_of),
            cache.num_keyed, cache.queries, cache.hits, rows,
            pool._pages.held.tolist(), pool.held_pages)
