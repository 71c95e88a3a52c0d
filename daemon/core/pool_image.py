"""A BlockPool's whole state as plain data (ints, bytes, lists, dicts), and back.

A daemon that stops writes its pools' images into a snapshot (`daemon/process/snapshot_file.py`)
and the next one restores them into fresh pools of the same geometry, so that every query
answers as before: block tables, refcounts, the free list's and the LRU's order (what is taken
and evicted next), committed and pending keys with their chain (parent keys, token ids), the
sequences' rows (committed counts, partial blocks' ids, chain keys, holder groups), the held
pages, the holder figures, the host tier's index and every counter.

Only plain data crosses: no object is pickled, so reading an image runs no code. A sequence key
that is a tuple (the service's (session, seq id)) comes back a tuple. `restore_image` expects a
fresh pool, built with the geometry the image names (`image_geometry`), and no open
transaction; the caller runs `check_invariants` after it.
"""

from collections.abc import Hashable
from typing import Any

import numpy as np

from pagedkv.daemon.core.block_pool import BlockPool
from pagedkv.daemon.core.errors import InvalidArgument
from pagedkv.daemon.core.host_tier import HostTier

Image = dict[str, Any]


def image_geometry(pool: BlockPool) -> dict[str, object]:
    """What a pool must be built with to take an image of `pool`."""
    host = pool.host_tier
    return {"num_blocks": pool.num_blocks, "block_size": pool.block_size,
            "prefix_caching": pool.enable_prefix_caching, "prefix_hash": pool._keys.algo,
            "blocks_per_page": pool.blocks_per_page, "holder_levels": len(pool._held.levels),
            "host_slots": 0 if host is None else host.num_slots}


def pool_image(pool: BlockPool) -> Image:
    """Every piece of `pool`'s state, as plain data (outside any transaction)."""
    assert not pool.journal.active, "an image taken inside a transaction"
    blocks, seqs, cache = pool._blocks, pool._seqs, pool._blocks.cache
    rows = []
    for seq, row in seqs.row_of.items():
        rows.append([_key_out(seq), int(seqs.num_tokens[row]), int(seqs.committed[row]),
                     seqs.table(row).tolist(), seqs.partial[row].tolist(),
                     bool(seqs.chain_ok[row]), seqs.chain_key[row], seqs.groups[row].tolist()])
    return {
        "geometry": image_geometry(pool),
        "ref": blocks.ref.tolist(), "free": list(blocks.free),
        "block_of": list(cache.block_of.items()), "committed": bytes(cache.committed),
        "key_of": cache.key_of, "parent_of": cache.parent_of,
        "tokens_of": cache.tokens_of.tobytes(), "evictable": list(cache.evictable),
        "counters": [cache.num_keyed, cache.queries, cache.hits, pool._appender.shared_waste],
        "held_pages": pool._pages.held.tolist(),
        "holders": [[h.owner.tolist(), [[b, list(g.items())] for b, g in h.mixed.items()],
                     list(h.held.items())] for h in pool._held.levels],
        "rows": rows,
        "host": None if blocks.host is None else _host_image(blocks.host),
    }


def restore_image(pool: BlockPool, image: Image) -> None:
    """Put `image` into `pool`, fresh and of the image's geometry. InvalidArgument, nothing
    read further: the geometry differs (the message names what)."""
    want, have = image["geometry"], image_geometry(pool)
    differs = [f"{name} {want.get(name)!r} != {value!r}" for name, value in have.items()
               if want.get(name) != value]
    if differs:
        raise InvalidArgument(f"pool image of another geometry: {', '.join(differs)}")
    assert not len(pool) and not pool.journal.active, "an image restored into a used pool"
    blocks, seqs, cache = pool._blocks, pool._seqs, pool._blocks.cache
    blocks.ref[:] = image["ref"]
    blocks.free.clear()
    blocks.free.extend(image["free"])
    cache.block_of = {bytes(key): block for key, block in image["block_of"]}
    cache.committed[:] = image["committed"]
    cache.key_of[:] = image["key_of"]
    cache.parent_of[:] = image["parent_of"]
    cache.tokens_of.reshape(-1)[:] = np.frombuffer(image["tokens_of"], dtype=np.int64)
    cache.evictable.extend(list(image["evictable"]))  # empty in a fresh pool
    cache.num_keyed, cache.queries, cache.hits, pool._appender.shared_waste = image["counters"]
    pool._pages.held[:] = image["held_pages"]
    pool._pages.num_held = int(pool._pages.held.sum())
    for holders, (owner, mixed, held) in zip(pool._held.levels, image["holders"], strict=True):
        holders.owner[:] = owner
        holders.mixed = {block: dict(groups) for block, groups in mixed}
        holders.held = dict(held)
    for key, num_tokens, committed, table, partial, chain_ok, chain_key, groups in image["rows"]:
        row = seqs.add(_key_in(key), chain_key, chain_ok)
        seqs.put_table(row, table)
        seqs.num_tokens[row], seqs.num_blocks[row], seqs.committed[row] = (num_tokens,
                                                                           len(table), committed)
        seqs.partial[row], seqs.groups[row] = partial, groups
        seqs.grew(num_tokens, len(table))
    if blocks.host is not None:
        _restore_host(blocks.host, image["host"])


def _host_image(host: HostTier) -> Image:
    return {"slot_of": list(host.slot_of.items()), "key_of": host.key_of,
            "parent_of": host.parent_of, "tokens_of": host.tokens_of.tobytes(),
            "lru": list(host.lru), "free": list(host.free),
            "counters": [host.stores, host.restores]}


def _restore_host(host: HostTier, image: Image) -> None:
    host.slot_of = {bytes(key): slot for key, slot in image["slot_of"]}
    host.key_of[:] = image["key_of"]
    host.parent_of[:] = image["parent_of"]
    host.tokens_of.reshape(-1)[:] = np.frombuffer(image["tokens_of"], dtype=np.int64)
    host.lru.extend(list(image["lru"]))
    host.free.clear()
    host.free.extend(image["free"])
    host.stores, host.restores = image["counters"]


def _key_out(seq: Hashable) -> object:
    """A sequence key as plain data: an int, a str, or a tuple of them (a list on the wire)."""
    if isinstance(seq, tuple):
        return list(seq)
    if isinstance(seq, (int, str)):
        return seq
    raise InvalidArgument(f"sequence key {seq!r} cannot be kept in an image")


def _key_in(key: object) -> Hashable:
    return tuple(key) if isinstance(key, list) else key
