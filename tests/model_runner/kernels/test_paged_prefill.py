"""Paged prefill attention: full prompts, prefix-cache hits and chunked prefill.

Torch vs a float64 oracle over a broad sweep; Triton (interpreted on CPU) vs torch on small cases.
Pools are NaN outside the owned slots (see kernel_utils), so reading past a sequence fails.
"""

import itertools
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pagedkv.model_runner.kernels.paged_decode import (
    paged_decode_attention_torch,
    paged_decode_attention_triton,
)
from pagedkv.model_runner.kernels.paged_prefill import (
    attend,
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
)

from kernel_utils import (
    DEVICES,
    PagedBatch,
    assert_close_to,
    device_matrix,
    make_paged_batch,
    oracle_attention,
    query_start_loc,
    ragged_lengths,
    random_tokens,
    skip_unless_triton_runs_on,
)

SCALE = 0.09


def _chunks(block_size: int) -> tuple[list[int], list[int]]:
    """(seq_lens, q_lens): whole prompts, a block-aligned cached prefix, unaligned chunks."""
    seq_lens = [*ragged_lengths(block_size), 2 * block_size, 2 * block_size + 3]
    q_lens = [*ragged_lengths(block_size), block_size, 5]
    q_lens[-3] = 7  # the 3B+5 context: a 7-token chunk after an unaligned prefix
    return seq_lens, q_lens


def _setup(seq_lens: list[int], q_lens: list[int], block_size: int, group: int, head_dim: int,
           dtype: torch.dtype, device: str) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    batch = make_paged_batch(seq_lens, block_size, 2, head_dim, dtype, device)
    query = random_tokens(sum(q_lens), 2 * group, head_dim, dtype, device)
    return batch, query, query_start_loc(q_lens, device)


def _prefill(impl, batch: PagedBatch, query: torch.Tensor, qsl: torch.Tensor) -> torch.Tensor:
    return impl(query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, qsl,
                SCALE)


@pytest.mark.parametrize(
    ("block_size", "group", "head_dim", "dtype", "device"),
    device_matrix(itertools.product([8, 16, 32], [1, 2, 4, 8], [64, 128],
                                    [torch.float32, torch.float16, torch.bfloat16])),
)
def test_torch_matches_float64_oracle(device, block_size, group, head_dim, dtype):
    seq_lens, q_lens = _chunks(block_size)
    batch, query, qsl = _setup(seq_lens, q_lens, block_size, group, head_dim, dtype, device)
    out = _prefill(paged_prefill_attention_torch, batch, query, qsl)
    assert out.dtype == dtype and out.shape == query.shape
    assert_close_to(out, oracle_attention(query, batch, q_lens, SCALE), dtype)


# Each block size, group size, head dim and dtype at least once; 12 and 80 are not powers of two.
TRITON_CASES = [
    (8, 1, 64, torch.float32),
    (16, 2, 128, torch.float16),
    (32, 4, 64, torch.bfloat16),
    (16, 8, 64, torch.float32),
    (12, 2, 80, torch.float32),
]
# Under the interpreter (device_matrix): MHA with exact fp32 dots; GQA with bf16 through the
# TF32 dots; a block size and head_dim that are not powers of two (padded, masked columns).
# fp16 (the same TF32 dots, an fp16 store) runs in test_paged_window_softcap.py's
# test_triton_prefill_rows_whose_window_starts_in_a_later_tile.
TRITON_CPU_CASES = [
    (8, 1, 64, torch.float32),
    (32, 4, 64, torch.bfloat16),
    (12, 2, 80, torch.float32),
]


@pytest.mark.parametrize(("block_size", "group", "head_dim", "dtype", "device"),
                         device_matrix(TRITON_CASES, cpu=TRITON_CPU_CASES))
def test_triton_matches_torch(device, block_size, group, head_dim, dtype):
    skip_unless_triton_runs_on(device)
    seq_lens, q_lens = _chunks(block_size)
    batch, query, qsl = _setup(seq_lens, q_lens, block_size, group, head_dim, dtype, device)
    out = _prefill(paged_prefill_attention_triton, batch, query, qsl)
    assert_close_to(out, _prefill(paged_prefill_attention_torch, batch, query, qsl), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_long_chunk_spans_several_row_blocks(device):
    skip_unless_triton_runs_on(device)
    # 150 new tokens after a 30-token cached prefix: three 64-row query blocks, three tiles.
    batch, query, qsl = _setup([180, 9], [150, 9], 16, 2, 64, torch.float32, device)
    out = _prefill(paged_prefill_attention_triton, batch, query, qsl)
    assert_close_to(out, oracle_attention(query, batch, [150, 9], SCALE), torch.float32)


@pytest.mark.parametrize(("impl", "device"), device_matrix([
    pytest.param(paged_prefill_attention_torch, id="torch"),
    pytest.param(paged_prefill_attention_triton, id="triton"),
]))
def test_chunked_prefill_equals_whole_prompt(device, impl):
    if impl is paged_prefill_attention_triton:
        skip_unless_triton_runs_on(device)
    # A prompt of 40 in one go, then the same prompt as a cached 27-token prefix + 13 new tokens.
    batch, query, _ = _setup([40], [40], 8, 2, 64, torch.float32, device)
    whole = _prefill(impl, batch, query, query_start_loc([40], device))
    tail = _prefill(impl, batch, query[27:], query_start_loc([13], device))
    torch.testing.assert_close(tail, whole[27:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_one_token_chunks_equal_decode(device):
    skip_unless_triton_runs_on(device)
    batch, query, qsl = _setup([1, 17, 33], [1, 1, 1], 16, 4, 64, torch.float32, device)
    prefill = _prefill(paged_prefill_attention_triton, batch, query, qsl)
    decode = paged_decode_attention_triton(query, batch.k_cache, batch.v_cache,
                                           batch.block_tables, batch.seq_lens, SCALE)
    torch.testing.assert_close(prefill, decode, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", [paged_prefill_attention_torch, paged_prefill_attention_triton],
                         ids=["torch", "triton"])
def test_bad_input_is_refused(impl):
    batch, query, qsl = _setup([5, 20], [2, 3], 16, 1, 16, torch.float32, "cpu")
    bad = [
        (qsl + 1, "query_start_loc must run from 0 to T=5"),
        (torch.tensor([0, 2, 4], dtype=torch.int32), "query_start_loc must run from 0 to T=5"),
        (torch.tensor([0, 2, 2, 5], dtype=torch.int32), "query_start_loc must be torch.int32"),
        (torch.tensor([0, 0, 5], dtype=torch.int32), "every query length must be in [1, seq_len]"),
        (torch.tensor([0, 6, 5], dtype=torch.int32), "every query length must be in [1, seq_len]"),
        (qsl.long(), "query_start_loc must be torch.int32"),
    ]
    for bad_qsl, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            _prefill(impl, batch, query, bad_qsl)
    batch.seq_lens[0] = 1  # shorter than its 2-token chunk
    with pytest.raises(ValueError, match=re.escape("every query length must be in [1, seq_len]")):
        _prefill(impl, batch, query, qsl)


def test_torch_twins_reuse_their_workspace_safely():
    """The torch twins gather K/V into a per-thread workspace that later calls reuse: a result
    never aliases it, and a workspace first grown under inference mode serves calls outside it
    (a fresh thread starts with no workspace)."""
    def run() -> None:
        small, query, qsl = _setup([5, 20], [2, 3], 16, 2, 64, torch.float32, "cpu")
        big, big_query, big_qsl = _setup([150, 40], [150, 1], 16, 2, 64, torch.float32, "cpu")
        with torch.inference_mode():
            first = _prefill(paged_prefill_attention_torch, small, query, qsl)
        kept = first.clone()
        decode = paged_decode_attention_torch(query[:2], small.k_cache, small.v_cache,
                                              small.block_tables, small.seq_lens, SCALE)
        _prefill(paged_prefill_attention_torch, big, big_query, big_qsl)  # grows the workspace
        assert torch.equal(first, kept)
        assert_close_to(decode, oracle_attention(query[:2], small, [1, 1], SCALE), torch.float32)
        assert_close_to(first, oracle_attention(query, small, [2, 3], SCALE), torch.float32)

    with ThreadPoolExecutor(1) as pool:
        pool.submit(run).result()


@pytest.mark.parametrize("cap", [0.0, 2.0])
def test_attend_takes_a_bool_mask_or_its_ready_fp32_form(cap):
    """The decode plan hands attend its mask as fp32 0 / -inf once per forward (SDPA converts
    a bool mask in every call): the same outputs as the bool mask, with a softcap too."""
    torch.manual_seed(0)
    q, keys, values = (torch.randn(3, 2, 4, 16) for _ in range(3))
    keys, values = (x.repeat(1, 1, 2, 1) for x in (keys, values))  # [3, 2, 8, 16]
    counted = torch.rand(3, 1, 4, 8) < 0.6
    counted[..., 0] = True  # every row counts a key
    ready = torch.where(counted, 0.0, float("-inf"))
    torch.testing.assert_close(attend(q, keys, values, ready, 0.25, cap),
                               attend(q, keys, values, counted, 0.25, cap), rtol=0, atol=0)
