"""Content keys of full blocks: the chained hash the prefix cache names blocks by.

A full block is named by a chained hash, key_i = H(key_{i-1} || tokens of block i), token ids
as int64 little-endian. The chain makes a key stand for the whole prefix up to and including its
block, so equal keys mean equal K/V. The chain's root is the namespace salt, key_{-1} =
H("pagedkv-root:" || salt): the salt enters every key through its parents, so identical tokens
under different salts (tenants) never share a block, and each link hashes the parent's digest
(32 or 16 bytes), never the salt again.

H is the daemon's `prefix_hash` setting, as vLLM's `--prefix-caching-hash-algo`:
- "sha256" (the default): cryptographic, so no one can make two contents share a key, even
  with token ids chosen for it: the only choice where several tenants share a daemon (config.py
  refuses the other unless the operator says they trust each other).
- "xxh3_128": xxhash's 128-bit XXH3, several times cheaper per block. A random collision is as
  unlikely as with SHA-256 at any pool size, but it is not built to resist crafted inputs: a
  caller choosing token ids could, in principle, make its blocks collide with another's
  content. Within one tenant that misleads only the tenant itself (as a wrong commit does).
  The `xxhash` package is imported only when this hash is chosen.
Both hash the same bytes, so they share exactly the same blocks; only the keys differ.
"""

from collections.abc import Callable
from functools import lru_cache
from hashlib import sha256
from typing import Literal

import numpy as np
import numpy.typing as npt

from pagedkv.daemon.core import _rows

# The `prefix_hash` setting's values: the hash of the content keys.
PrefixHash = Literal["sha256", "xxh3_128"]
PREFIX_HASHES: tuple[PrefixHash, ...] = ("sha256", "xxh3_128")


def _sha256(data: bytes) -> bytes:
    return sha256(data).digest()


def _digest_of(algo: PrefixHash) -> Callable[[bytes], bytes]:
    """The one-shot digest function of `algo`. SHA-256 is the compiled one where the CPU has
    SHA instructions (`_rows.sha256`: the compiled loops then hash without calling back into
    Python, ~150 ns a block against hashlib's ~330), hashlib's elsewhere: the same keys."""
    if algo == "sha256":
        return _rows.sha256 if _rows.SHA256_NATIVE else _sha256
    if algo == "xxh3_128":
        from xxhash import xxh3_128_digest  # only here: a sha256 daemon runs without xxhash
        return xxh3_128_digest
    raise ValueError(f"prefix_hash must be one of {', '.join(PREFIX_HASHES)}, got {algo!r}")


class ContentKeys:
    """The content keys of one pool: every key it makes is hashed with `algo`."""

    def __init__(self, algo: PrefixHash = "sha256") -> None:
        # The hash's name, and its one-shot digest: bytes -> key.
        self.algo = algo
        self.digest = _digest_of(algo)
        # Root key of each salt; salts are few (one per tenant), the bound keeps a flood small.
        self.root: Callable[[bytes], bytes] = lru_cache(maxsize=256)(self._root)

    def _root(self, salt: bytes) -> bytes:
        """Parent key of the first block of every sequence in the namespace `salt`."""
        return self.digest(b"pagedkv-root:" + salt)

    def block(self, parent: bytes, tokens: bytes) -> bytes:
        """Content key of a full block: the key of its prefix (rooted in a salt), its token
        ids."""
        return self.digest(parent + tokens)

    def chain(self, parent: bytes, tokens: npt.NDArray[np.int64]) -> list[bytes]:
        """Keys of consecutive full blocks (token ids [n, block_size]) following the block
        keyed `parent`: each block's parent is the one before it. One compiled loop
        (`_rows.chain_keys`), each block hashed once with `digest`."""
        return _rows.chain_keys(parent, np.ascontiguousarray(tokens, dtype=np.int64),
                                tokens.shape[1], self.digest)
