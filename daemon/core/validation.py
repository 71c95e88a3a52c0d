"""Argument checks shared by the pool's operations: caller mistakes become `InvalidArgument`."""

from collections.abc import Hashable, Sequence

import numpy as np
import numpy.typing as npt

from pagedkv.daemon.core.errors import InvalidArgument
from pagedkv.daemon.core.seq_table import Int64Array

TokenIds = Sequence[int] | npt.NDArray[np.integer]
# What `count` accepts as an integer (bools excepted).
_INTEGERS = (int, np.integer)


def count(value: int, name: str, minimum: int) -> int:
    """An integer count >= `minimum` (bools are not counts)."""
    if type(value) is int and value >= minimum:  # the usual case, first: a call per op
        return value
    if isinstance(value, bool) or not isinstance(value, _INTEGERS) or value < minimum:
        raise InvalidArgument(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def as_int64(token_ids: npt.ArrayLike) -> Int64Array:
    """Token ids as an int64 array, or InvalidArgument if they are not integers."""
    if type(token_ids) is np.ndarray and token_ids.dtype == np.int64:  # as is: no copy
        return token_ids
    try:
        tokens = np.asarray(token_ids)
        if tokens.size and tokens.dtype.kind not in "iu":
            raise TypeError(f"dtype {tokens.dtype}")
        return tokens.astype(np.int64, copy=False)
    except (TypeError, ValueError, OverflowError) as err:
        raise InvalidArgument(f"token_ids must be integers: {err}") from None


def seq_tokens(token_ids: TokenIds | None, num_tokens: int) -> Int64Array | None:
    """The token ids of one call on one sequence: exactly `num_tokens` of them, or None."""
    if token_ids is None:
        return None
    tokens = as_int64(token_ids).ravel()
    if len(tokens) != num_tokens:
        raise InvalidArgument(f"{len(tokens)} token_ids given for num_tokens={num_tokens}")
    return tokens


def batch_tokens(token_ids: npt.ArrayLike | None, num_seqs: int,
                 num_tokens: int) -> Int64Array | None:
    """The token ids of a batched call, as [num_seqs, num_tokens], or None."""
    if token_ids is None:
        return None
    tokens = as_int64(token_ids)
    if tokens.size != num_seqs * num_tokens:
        raise InvalidArgument(f"{tokens.size} token_ids given for {num_seqs} sequences of "
                              f"{num_tokens} tokens")
    return tokens.reshape(num_seqs, num_tokens)


def commit_counts(num_tokens: npt.ArrayLike | None, held: Int64Array) -> Int64Array:
    """Tokens to commit of each sequence of a commit: all it holds (`held`) when None, else
    the counts given, one per sequence, each in 0..held."""
    if num_tokens is None:
        return held
    computed = as_int64(num_tokens).ravel()
    if len(computed) != len(held):
        raise InvalidArgument(f"{len(computed)} token counts given for {len(held)} sequences")
    if ((computed < 0) | (computed > held)).any():
        raise InvalidArgument("a committed token count is negative or exceeds the tokens its "
                              "sequence holds")
    return computed


def check_logical_block(logical_block: int, num_blocks: int, seq: Hashable) -> None:
    """`logical_block` indexes one of the `num_blocks` blocks of `seq`'s table."""
    if isinstance(logical_block, bool) or not isinstance(logical_block, int) \
            or not 0 <= logical_block < num_blocks:
        raise InvalidArgument(f"logical_block {logical_block!r} is outside the {num_blocks} "
                              f"blocks of sequence {seq!r}")
