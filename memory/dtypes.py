"""The torch dtype of a dtype name: the one place where pagedkv's dtype names
(pagedkv.vocab.geometry.DTYPE_BYTES and its spellings) meet torch. The daemon allocates its
pool, a runner attaches to it and loads its model, all in the dtype this returns."""

import torch

from pagedkv.vocab.geometry import canonical_dtype


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for any accepted spelling ("fp16", "bfloat16", "torch.float32");
    ValueError naming the known ones for anything else."""
    dtype = getattr(torch, canonical_dtype(name))
    assert isinstance(dtype, torch.dtype), f"torch.{name} is not a dtype"
    return dtype
