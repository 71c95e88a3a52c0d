"""The block pool's per-row loops, compiled (_rows.h lists the C files, one per concept)."""

from array import array
from collections import deque
from collections.abc import Callable, Hashable, Sequence

import numpy as np
import numpy.typing as npt

_Ints = npt.NDArray[np.int64]
_Flags = npt.NDArray[np.bool_]
# A dropped pending key: (block, key, parent key).
_Dropped = tuple[int, bytes, bytes | None]

# Whether `sha256` runs here (the CPU has SHA instructions).
SHA256_NATIVE: bool

def lookup_rows(row_of: dict[Hashable, int], seqs: Sequence[Hashable], out: _Ints) -> int: ...
def pop_free(free: deque[int], out: _Ints, ref: _Ints) -> int: ...
def fill_row(row: int, table: _Ints, tokens: int, committed: int, tail: _Ints | None,
             region: int, region_size: int, num_tokens: _Ints, num_blocks: _Ints, start: _Ints,
             capacity: _Ints, data: _Ints, committed_counts: _Ints, partial: _Ints) -> None: ...
def plan_step(rows: _Ints, num_tokens: _Ints, num_blocks: _Ints, start: _Ints,
              capacity: _Ints, data: _Ints, ref: _Ints | None, block_size: int,
              written: _Ints, grow: _Ints, logical: _Ints) -> tuple[int, int, int] | None: ...
def apply_step(rows: _Ints, written: _Ints, grow: _Ints, taken: _Ints, tokens: _Ints | None,
               num_tokens: _Ints, num_blocks: _Ints, start: _Ints, capacity: _Ints,
               data: _Ints, partial: _Ints, chain_ok: _Flags, block_size: int,
               keep_ids: bool, slots: _Ints, new_tokens: _Ints, sealed: _Ints) -> int: ...
def commit_runs(rows: _Ints, counts: _Ints | None, num_tokens: _Ints, num_blocks: _Ints,
                start: _Ints, capacity: _Ints, data: _Ints, committed: _Ints,
                block_size: int) -> tuple[list[int], list[int], list[int]]: ...
def claim_keys(blocks: list[int], key_of: list[bytes | None], parent_of: list[bytes | None],
               committed: bytearray, block_of: dict[bytes, int],
               ) -> tuple[list[int], list[_Dropped]]: ...
def set_keys(blocks: _Ints, keys: list[bytes], parents: list[bytes], tokens: _Ints,
             key_of: list[bytes | None], parent_of: list[bytes | None], committed: bytearray,
             tokens_of: _Ints) -> None: ...
def chain_keys(parent: bytes, tokens: _Ints, block_size: int,
               digest: Callable[[bytes], bytes]) -> list[bytes]: ...
def seal_blocks(rows: _Ints, blocks: _Ints, partial: _Ints, chain_key: list[bytes],
                digest: Callable[[bytes], bytes], key_of: list[bytes | None],
                parent_of: list[bytes | None], committed: bytearray,
                tokens_of: _Ints) -> None: ...
def release_keys(blocks: list[int], key_of: list[bytes | None], parent_of: list[bytes | None],
                 committed: bytearray) -> tuple[list[int], list[int], list[_Dropped]]: ...
def release_refs(table: _Ints, ref: _Ints) -> list[int]: ...
def link_tail(prev: array[int], next: array[int], blocks: list[int]) -> None: ...
def table_slots(table: _Ints, num_tokens: int, block_size: int) -> list[int]: ...
def sha256(data: bytes) -> bytes: ...
