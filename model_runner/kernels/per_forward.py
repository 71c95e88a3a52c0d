"""Work the attention of every layer of one forward shares, done by the first layer only.

The torch kernels' indices (store_kv's slot rows and the tokens that write, the gathers' rows,
the masks as ready tensors), the launch grid of the Triton kernels and every layer's sliding
window (read from the config once) depend on the batch (slots, block tables, sequence lengths,
query layout), the sliding window, the model's config and head counts, never on anything else
of a layer: the key names what they depend on beyond the batch.
A forward's `PagedContext.per_forward` is a fresh dict that the attention calls of its layers
pass to the kernels; the first call under a key computes the value, the others reuse it:

    plan = shared(per_forward, ("decode", window), lambda: decode_plan(...))

A kernel called without one (`per_forward=None`, a direct call) computes it every time.
"""

from collections.abc import Callable, Hashable
from typing import TypeVar, cast

T = TypeVar("T")

# (what, then everything else it depends on besides the batch: the sliding window, ...) -> the
# value computed for this forward's batch.
PerForward = dict[tuple[Hashable, ...], object]


def shared(per_forward: PerForward | None, key: tuple[Hashable, ...], make: Callable[[], T]) -> T:
    """make()'s value, computed once per forward under `key`."""
    if per_forward is None:
        return make()
    if key not in per_forward:
        per_forward[key] = make()
    return cast(T, per_forward[key])
