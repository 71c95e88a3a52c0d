"""Host-side checks shared by the paged attention kernels and their torch twins.

Every kernel entry point validates its arguments here before anything is launched or written, so a
caller mistake is a ValueError that changes nothing, never an out-of-bounds access on the device.
Shape, dtype and stride checks are free. Value checks (slot and block ids in range, lengths that
fit the block table) read the tensors back, which synchronizes with the device once; callers on a
hot path whose tables come from the block pool may skip them with ``check_values=False``.

Pool layout (one layer's view): ``k_cache``, ``v_cache``: [num_blocks, block_size, H_kv, D],
strided views of the block-major pool (pagedkv.memory.handle): block b's K/V of every layer lie
together, so one layer's next block is ``num_layers * 2`` blocks' worth of slots further on.
"""

import math
from dataclasses import dataclass

import torch

from pagedkv.vocab.blocks import blocks_for

# Cache dtypes the kernels handle; scores and softmax are always computed in fp32.
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
# The fp8 cache (kv_cache_dtype fp8): K/V stored as e4m3 with a per-tensor scale of 1.0, so
# quantizing is a cast saturated at +-FP8_MAX (store_kv) and dequantizing a cast to the
# query's dtype in registers (paged_tile's loads; the torch twins' float()); tokens of any
# model dtype read and write it.
FP8_CACHE_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_CACHE_DTYPE).max)


@dataclass(frozen=True)
class CacheGeometry:
    """Shape of one layer's paged K (or V) cache."""

    num_blocks: int  # physical blocks in the pool
    block_size: int  # tokens per block; slot = block * block_size + offset
    num_kv_heads: int  # H_kv
    head_dim: int  # D
    # Rows from one block to the next in `slot_rows`' view: stride(0) / stride(1) (block_size
    # for a contiguous cache, num_layers * 2 * block_size for a layer of the pool).
    rows_per_block: int

    @property
    def num_slots(self) -> int:
        """Token slots in the pool: the exclusive upper bound of a slot id."""
        return self.num_blocks * self.block_size


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> CacheGeometry:
    """Validate a K/V cache pair and return its geometry."""
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be [num_blocks, block_size, H_kv, D], got {k_cache.shape}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {v_cache.shape} != k_cache shape {k_cache.shape}")
    if k_cache.dtype not in CACHE_DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"caches must share one dtype of {CACHE_DTYPES}, got {k_cache.dtype}/{v_cache.dtype}"
        )
    if v_cache.device != k_cache.device:
        raise ValueError(f"k_cache on {k_cache.device} but v_cache on {v_cache.device}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("caches must be contiguous in the last (head_dim) dimension")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    if min(num_blocks, block_size, num_kv_heads, head_dim) < 1:
        raise ValueError(f"empty cache dimension in {k_cache.shape}")
    block_stride, slot_stride = k_cache.stride(0), k_cache.stride(1)
    if (v_cache.stride() != k_cache.stride() or slot_stride < 1
            or block_stride % slot_stride or block_stride < block_size * slot_stride):
        raise ValueError("caches must share strides, each block a whole number of slot rows "
                         f"past the last, got {k_cache.stride()} and {v_cache.stride()}")
    return CacheGeometry(num_blocks, block_size, num_kv_heads, head_dim,
                         block_stride // slot_stride)


def check_fp8_device(cache: torch.Tensor) -> None:
    """ValueError for an fp8 cache on a CUDA device before sm_89 (Ada, Hopper): Triton has no
    e4m3 conversion there, so the first launch would fail mid-serving instead of now."""
    if cache.dtype != FP8_CACHE_DTYPE or cache.device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(cache.device)
    if capability < (8, 9):
        raise ValueError(f"kv_cache_dtype fp8 needs a CUDA device of compute capability 8.9 or "
                         f"later (e4m3 conversions); {cache.device} is "
                         f"{capability[0]}.{capability[1]}: use kv_cache_dtype auto")


def slot_rows(cache: torch.Tensor, rows_per_block: int) -> torch.Tensor:
    """The cache's slots as rows [R, H_kv, D] of the memory it lies in: slot o of block b is row
    b * rows_per_block + o (`slot_row`). A layer of the block-major pool is no flat view of its
    slots, but its slots are rows of the pool, one index_select or index_copy_ away; the rows
    between a block's slots belong to other layers and are never indexed."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = (num_blocks - 1) * rows_per_block + block_size
    return cache.as_strided((rows, num_kv_heads, head_dim), cache.stride()[1:],
                            cache.storage_offset())


def slot_row(slots: torch.Tensor, geometry: CacheGeometry) -> torch.Tensor:
    """The row in `slot_rows` of each slot (block * block_size + offset)."""
    extra = geometry.rows_per_block - geometry.block_size
    return torch.add(slots, slots // geometry.block_size, alpha=extra) if extra else slots


def check_tokens(name: str, x: torch.Tensor, heads: int | None, cache: torch.Tensor) -> None:
    """Validate a per-token tensor [T, heads, D] against the cache (dtype, device, head_dim):
    the cache's dtype, or any model dtype over an fp8 cache.

    `heads=None` accepts any multiple of the cache's KV heads (query heads under GQA).
    """
    _, _, num_kv_heads, head_dim = cache.shape
    if x.dim() != 3 or x.shape[2] != head_dim:
        raise ValueError(f"{name} must be [T, H, {head_dim}], got {tuple(x.shape)}")
    if heads is not None and x.shape[1] != heads:
        raise ValueError(f"{name} has {x.shape[1]} heads, the cache has {heads}")
    if heads is None and (x.shape[1] == 0 or x.shape[1] % num_kv_heads != 0):
        raise ValueError(f"{name} heads ({x.shape[1]}) must be a multiple of H_kv={num_kv_heads}")
    fp8_cache = cache.dtype == FP8_CACHE_DTYPE and x.dtype in CACHE_DTYPES[:3]
    if (x.dtype != cache.dtype and not fp8_cache) or x.device != cache.device:
        raise ValueError(
            f"{name} is {x.dtype} on {x.device}, the cache is {cache.dtype} on {cache.device}"
        )
    if x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in the last (head_dim) dimension")


def check_index(name: str, x: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
                device: torch.device) -> None:
    """Validate an index tensor's dtype, exact shape and device."""
    if x.dtype != dtype or tuple(x.shape) != shape or x.device != device:
        raise ValueError(
            f"{name} must be {dtype} of shape {shape} on {device}, "
            f"got {x.dtype} of shape {tuple(x.shape)} on {x.device}"
        )


def check_slot_values(slot_mapping: torch.Tensor, geometry: CacheGeometry) -> None:
    """Every slot is -1 (padding) or a slot of the pool."""
    if slot_mapping.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(slot_mapping))
    if low < -1 or high >= geometry.num_slots:
        raise ValueError(
            f"slot_mapping values must be -1 or in [0, {geometry.num_slots}), got [{low}, {high}]"
        )


def check_table_values(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, geometry: CacheGeometry
) -> None:
    """Lengths fit the table, and every block a sequence uses is a block of the pool.

    Entries past a sequence's last used block are never read, so they may hold anything (-1).
    """
    if seq_lens.numel() == 0:
        return
    capacity = block_tables.shape[1] * geometry.block_size
    low_len, high_len = (int(v) for v in torch.aminmax(seq_lens))
    if low_len < 1 or high_len > capacity:
        raise ValueError(
            f"seq_lens must be in [1, {capacity}] (block_tables width x block_size), "
            f"got [{low_len}, {high_len}]"
        )
    used_blocks = blocks_for(seq_lens.long(), geometry.block_size)
    columns = torch.arange(block_tables.shape[1], device=block_tables.device)
    used = block_tables[columns[None, :] < used_blocks[:, None]]
    low, high = (int(v) for v in torch.aminmax(used))
    if low < 0 or high >= geometry.num_blocks:
        raise ValueError(
            f"block_tables entries in use must be in [0, {geometry.num_blocks}), "
            f"got [{low}, {high}]"
        )


def check_window_softcap(sliding_window: int | None, softcap: float | None) -> tuple[int, float]:
    """Validate the optional attention variants; return (window, softcap) with 0 meaning off.

    sliding_window: a query at position p sees keys at positions in (p - sliding_window, p];
    softcap: scores = softcap * tanh(scores / softcap). None or 0 turns either off.
    """
    window = 0 if sliding_window is None else sliding_window
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise ValueError(f"sliding_window must be None or an int >= 0, got {sliding_window!r}")
    cap = 0.0 if softcap is None else float(softcap)
    if not math.isfinite(cap) or cap < 0:
        raise ValueError(f"softcap must be None or a finite float >= 0, got {softcap!r}")
    return window, cap


def check_attention_args(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    check_values: bool,
) -> CacheGeometry:
    """Validate the arguments every paged attention call shares; return the cache geometry.

    query: [T, H_q, D]; block_tables: [S, max_blocks] int32; seq_lens: [S] int32.
    """
    geometry = check_cache(k_cache, v_cache)
    check_tokens("query", query, None, k_cache)
    if block_tables.dim() != 2 or block_tables.shape[1] == 0:
        raise ValueError(f"block_tables must be [S, max_blocks >= 1], got {block_tables.shape}")
    num_seqs = block_tables.shape[0]
    check_index("block_tables", block_tables, torch.int32, (num_seqs, block_tables.shape[1]),
                k_cache.device)
    check_index("seq_lens", seq_lens, torch.int32, (num_seqs,), k_cache.device)
    if check_values:
        check_table_values(block_tables, seq_lens, geometry)
    return geometry
