"""Paged decode attention: torch vs a float64 oracle (broad sweep), Triton vs torch (small cases).

Every pool is NaN outside the slots the sequences own and every block-table row is padded with -1,
so a kernel that reads past a sequence (a stale slot, the tail of its last block, a table entry it
does not use) returns NaN and fails `assert_close_to`. On CPU Triton runs under the interpreter,
which runs programs one at a time: the Triton cases stay small.
"""

import itertools
import re

import pytest
import torch

from pagedkv.model_runner.kernels import paged_decode
from pagedkv.model_runner.kernels.paged_decode import (
    default_num_splits,
    length_groups,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    split_plan,
)

from kernel_launches import record_launches
from kernel_utils import (
    PagedBatch,
    assert_close_to,
    device_matrix,
    make_paged_batch,
    oracle_attention,
    ragged_lengths,
    random_tokens,
    skip_unless_triton_runs_on,
)

SCALE = 0.125


def _batch_and_query(seq_lens: list[int], block_size: int, group: int, head_dim: int,
                     dtype: torch.dtype, device: str,
                     num_kv_heads: int = 2) -> tuple[PagedBatch, torch.Tensor]:
    batch = make_paged_batch(seq_lens, block_size, num_kv_heads, head_dim, dtype, device)
    query = random_tokens(len(seq_lens), num_kv_heads * group, head_dim, dtype, device)
    return batch, query


def _decode(impl, batch: PagedBatch, query: torch.Tensor, num_splits: int | None = None):
    return impl(query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, SCALE,
                num_splits)


@pytest.mark.parametrize(
    ("block_size", "group", "head_dim", "dtype", "device"),
    device_matrix(itertools.product([8, 16, 32], [1, 2, 4, 8], [64, 128],
                                    [torch.float32, torch.float16, torch.bfloat16])),
)
def test_torch_matches_float64_oracle(device, block_size, group, head_dim, dtype):
    seq_lens = [*ragged_lengths(block_size), 150]
    batch, query = _batch_and_query(seq_lens, block_size, group, head_dim, dtype, device)
    out = _decode(paged_decode_attention_torch, batch, query)
    expected = oracle_attention(query, batch, [1] * len(seq_lens), SCALE)
    assert out.dtype == dtype and out.shape == query.shape
    assert_close_to(out, expected, dtype)


def test_length_groups_split_where_padding_is_saved():
    # Longest first: 44 44 30 10 2 1. Splitting before the 30 saves 4 x 14 = 56 units, before
    # the 10 3 x 34 = 102: that split comes first. Then [44 44 30] saves at most 1 x 14 = 14,
    # [10 2 1] 2 x 8 = 16 (before the 2), and [2 1] 1.
    lengths = [1, 44, 10, 44, 2, 30]
    assert length_groups(lengths, 1, 10**6) == [[1, 3, 5, 2, 4, 0]]
    assert sorted(length_groups(lengths, 1, 50)) == [[1, 3, 5], [2, 4, 0]]
    assert sorted(length_groups(lengths, 1, 16)) == [[1, 3, 5], [2], [4, 0]]
    assert sorted(length_groups(lengths, 16, 16 * 14)) == [[1, 3], [2], [4, 0], [5]]
    assert length_groups([7], 1, 1) == [[0]]


@pytest.mark.parametrize(("window", "softcap", "device"),
                         device_matrix([(None, None), (20, None), (None, 1.5), (33, 1.5)]))
def test_torch_grouped_by_length_matches_the_oracle(device, window, softcap, monkeypatch):
    """Every split allowed: each length its own group; the batch's order is not the groups'."""
    monkeypatch.setattr(paged_decode, "GROUP_MIN_SAVED", 1)
    seq_lens = [150, 1, 33, 17, 150, 64, 2]
    batch, query = _batch_and_query(seq_lens, 16, 4, 64, torch.float32, device)
    out = paged_decode_attention_torch(query, batch.k_cache, batch.v_cache, batch.block_tables,
                                       batch.seq_lens, SCALE, sliding_window=window,
                                       softcap=softcap)
    expected = oracle_attention(query, batch, [1] * len(seq_lens), SCALE, window or 0,
                                softcap or 0.0)
    assert_close_to(out, expected, torch.float32)


# Each block size, group size, head dim and dtype at least once; 80 and 12 are not powers of two.
TRITON_CASES = [
    (8, 1, 64, torch.float32),
    (16, 2, 128, torch.float16),
    (32, 4, 64, torch.bfloat16),
    (16, 8, 128, torch.float32),
    (12, 4, 80, torch.float16),
]
# Under the interpreter (device_matrix): MHA with exact fp32 dots; GQA (4 query heads of 16
# padded rows) with fp16 through the TF32 dots, a block size and a head_dim that are not powers
# of two. bf16 runs in the split-K tests below and in test_paged_window_softcap.py.
TRITON_CPU_CASES = [
    (8, 1, 64, torch.float32),
    (12, 4, 80, torch.float16),
]


@pytest.mark.parametrize(("block_size", "group", "head_dim", "dtype", "device"),
                         device_matrix(TRITON_CASES, cpu=TRITON_CPU_CASES))
def test_triton_matches_torch(device, block_size, group, head_dim, dtype):
    skip_unless_triton_runs_on(device)
    batch, query = _batch_and_query(ragged_lengths(block_size), block_size, group, head_dim,
                                    dtype, device)
    out = _decode(paged_decode_attention_triton, batch, query)
    assert_close_to(out, _decode(paged_decode_attention_torch, batch, query), dtype)


# Under the interpreter (device_matrix): 6 splits (8 asked for 11 tiles) merged into an fp32
# output and 3 into a bf16 one, the 5-token sequence's later splits empty. One split (what the
# default plan gives without SMs: the kernel writes the output, no log-sum-exp) runs in every
# other decode test.
@pytest.mark.parametrize(("dtype", "num_splits", "device"), device_matrix(
    itertools.product([torch.float32, torch.bfloat16], [None, 1, 3, 8]),
    cpu=[(torch.float32, 8), (torch.bfloat16, 3)]))
def test_split_k_merges_to_the_same_result(device, num_splits, dtype):
    skip_unless_triton_runs_on(device)
    # 700 tokens are 11 tiles; the 5-token sequence leaves most of its splits empty.
    batch, query = _batch_and_query([700, 5], 16, 4, 64, dtype, device, num_kv_heads=1)
    out = _decode(paged_decode_attention_triton, batch, query, num_splits)
    assert_close_to(out, _decode(paged_decode_attention_torch, batch, query), dtype)
    assert_close_to(out, oracle_attention(query, batch, [1, 1], SCALE), dtype)


def _bad_calls(batch: PagedBatch, query: torch.Tensor) -> list[tuple[dict[str, object], str]]:
    """(argument overrides, error fragment) for decode calls that must be refused."""
    tables, lens = batch.block_tables, batch.seq_lens
    too_long = lens.clone()
    too_long[0] = tables.shape[1] * 16 + 1
    wild_block = tables.clone()
    wild_block[1, 0] = batch.k_cache.shape[0]
    return [
        ({"query": query[:1]}, "one query per sequence"),
        ({"query": query[:, :3]}, "must be a multiple of H_kv=2"),
        ({"query": query.double()}, "query is torch.float64"),
        ({"num_splits": 0}, "num_splits must be >= 1"),
        ({"seq_lens": too_long}, "seq_lens must be in [1, 48]"),
        ({"seq_lens": lens * 0}, "seq_lens must be in [1, 48]"),
        ({"seq_lens": lens.long()}, "seq_lens must be torch.int32"),
        ({"block_tables": tables.long()}, "block_tables must be torch.int32"),
        ({"block_tables": wild_block}, "block_tables entries in use must be in [0, 6)"),
        ({"max_seq_len": 0}, "max_seq_len must be None or an int in [1, 48]"),
        ({"max_seq_len": 49}, "max_seq_len must be None or an int in [1, 48]"),
        ({"max_seq_len": True}, "max_seq_len must be None or an int in [1, 48]"),
        ({"max_seq_len": 19}, "max_seq_len=19 is shorter than the longest context (20)"),
    ]


@pytest.mark.parametrize("impl", [paged_decode_attention_torch, paged_decode_attention_triton],
                         ids=["torch", "triton"])
def test_bad_input_is_refused(impl):
    batch, query = _batch_and_query([5, 20], 16, 2, 16, torch.float32, "cpu")
    good = {"query": query, "k_cache": batch.k_cache, "v_cache": batch.v_cache,
            "block_tables": batch.block_tables, "seq_lens": batch.seq_lens, "scale": SCALE,
            "num_splits": None}
    for overrides, message in _bad_calls(batch, query):
        with pytest.raises(ValueError, match=re.escape(message)):
            impl(**(good | overrides))


@pytest.mark.parametrize(
    ("num_programs", "max_context", "num_sms", "expected"),
    [
        (8, 32768, 132, (32, 16)),  # batch 1, 8 KV heads, 32k: 33 wanted, 16 tiles each -> 32
        (512, 4096, 132, (1, 64)),  # batch 64 fills an H200 without splitting
        (8, 512, 132, (2, 4)),  # short context: every split keeps >= 4 tiles
        (8, 100, 132, (1, 2)),
        (8, 32768, 0, (1, 512)),  # no GPU: one split
    ],
)
def test_default_split_policy(num_programs, max_context, num_sms, expected):
    num_splits = default_num_splits(num_programs, -(-max_context // 64), num_sms)
    assert split_plan(num_splits, num_programs, max_context, torch.device("cpu")) == expected
    assert split_plan(None, num_programs, max_context, torch.device("cpu"))[0] == 1


def test_splits_are_sized_by_the_longest_context_not_the_table(monkeypatch):
    """Tables 64 blocks wide (1024 positions, 16 tiles) over contexts of 100 and 30 tokens
    (2 tiles): sized by the table, 8 splits are asked for and 6 of each sequence's are empty;
    sized by the host's max_seq_len, 2 splits, every one reading positions."""
    skip_unless_triton_runs_on("cpu")
    batch, query = _batch_and_query([100, 30], 16, 4, 64, torch.float32, "cpu", num_kv_heads=1)
    wide = torch.full((2, 64), -1, dtype=torch.int32)
    wide[:, :batch.block_tables.shape[1]] = batch.block_tables
    caches = (batch.k_cache, batch.v_cache, wide, batch.seq_lens, SCALE, 8)
    launches = record_launches(monkeypatch)
    paged_decode_attention_triton(query, *caches)
    paged_decode_attention_triton(query, *caches, max_seq_len=100)
    assert [launch.grid for launch in launches if launch.name == "_decode_split_kernel"] == [
        (2, 1, 8), (2, 1, 2)]
    monkeypatch.undo()  # run them
    out = paged_decode_attention_triton(query, *caches, max_seq_len=100)
    assert_close_to(out, oracle_attention(query, batch, [1, 1], SCALE), torch.float32)


def test_explicit_splits_never_start_past_the_table():
    # 10 tiles asked for 4 splits: 3 tiles each, so only 4 splits (3+3+3+1); 16 asked: 10.
    assert split_plan(4, 1, 640, torch.device("cpu")) == (4, 3)
    assert split_plan(16, 1, 640, torch.device("cpu")) == (10, 1)
    assert split_plan(3, 1, 640, torch.device("cpu")) == (3, 4)
