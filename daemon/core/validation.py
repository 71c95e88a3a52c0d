"""Argument checks shared by the pool's operations: caller mistakes become `InvalidArgument`."""

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from .errors import InvalidArgument

Int64Array = npt.NDArray[np.int64]
TokenIds = Sequence[int] | npt.NDArray[np.integer]


def count(value: int, name: str, minimum: int) -> int:
    """An integer count >= `minimum` (bools are not counts)."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < minimum:
        raise InvalidArgument(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def as_int64(token_ids: npt.ArrayLike) -> Int64Array:
    """Token ids as an int64 array, or InvalidArgument if they are not integers."""
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
