"""Sliding-window attention and logit soft-capping in paged decode and prefill.

The float64 oracle (kernel_utils.oracle_attention) is written from transformers' definitions: a
query at position p sees keys at positions in (p - W, p], and scores become c * tanh(score / c)
before the mask. Torch twins are checked against it, and Triton (interpreted on CPU) against
both. Windows of 1, the block size, 70 (more than one 64-position tile) and 200 are shorter
than, equal to and longer than the ragged contexts; softcap 1.5 bends the ~N(0, 1) scores of
random queries hard, so a kernel that skipped it would fail. Pools are NaN outside the owned
slots, so reading past a sequence, or a window start that is off by one, shows.
"""

import itertools
import re

import pytest
import torch

from pagedkv.model_runner.kernels.paged_decode import (
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    split_plan,
)
from pagedkv.model_runner.kernels.paged_prefill import (
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
    param_id,
    query_start_loc,
    ragged_lengths,
    random_tokens,
    skip_unless_triton_runs_on,
)

SCALE = 0.125
BLOCK_SIZE = 16
WINDOWS = [1, BLOCK_SIZE, 70, 200]
SOFTCAPS = [None, 1.5]
# Contexts around block and tile boundaries: 1, 15, 16, 17, 53 and 150 (three 64-position tiles).
SEQ_LENS = [*ragged_lengths(BLOCK_SIZE), 150]
# Prefill chunks of those contexts: whole prompts, a cached prefix, unaligned chunks.
Q_LENS = [1, 15, 3, 17, 20, 100]
# (window, softcap) cases of the Triton tests; under the interpreter (device_matrix), a window of
# one position with the softcap (the 150-position context's earlier tiles are skipped) and a
# window of 70 without it (longer than a tile, and than the shorter contexts). The softcap
# without a window runs in test_large_scores_saturate_the_softcap_without_nan.
WINDOW_SOFTCAP = list(itertools.product(WINDOWS, SOFTCAPS))
WINDOW_SOFTCAP_CPU = [(1, 1.5), (70, None)]


def _setup(seq_lens: list[int], num_queries: int, group: int, dtype: torch.dtype, device: str,
           head_dim: int = 64) -> tuple[PagedBatch, torch.Tensor]:
    batch = make_paged_batch(seq_lens, BLOCK_SIZE, 2, head_dim, dtype, device)
    return batch, random_tokens(num_queries, 2 * group, head_dim, dtype, device)


def _decode(impl, batch: PagedBatch, query: torch.Tensor, window: int | None,
            softcap: float | None, num_splits: int | None = None) -> torch.Tensor:
    return impl(query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, SCALE,
                num_splits, sliding_window=window, softcap=softcap)


def _prefill(impl, batch: PagedBatch, query: torch.Tensor, q_lens: list[int], window: int | None,
             softcap: float | None) -> torch.Tensor:
    return impl(query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens,
                query_start_loc(q_lens, str(query.device)), SCALE, sliding_window=window,
                softcap=softcap)


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=param_id)
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("window", WINDOWS)
def test_torch_matches_float64_oracle(window, softcap, dtype, group):
    batch, query = _setup(SEQ_LENS, sum(Q_LENS), group, dtype, "cpu")
    prefill = _prefill(paged_prefill_attention_torch, batch, query, Q_LENS, window, softcap)
    expected = oracle_attention(query, batch, Q_LENS, SCALE, window, softcap or 0.0)
    assert_close_to(prefill, expected, dtype)
    decode = _decode(paged_decode_attention_torch, batch, query[:len(SEQ_LENS)], window, softcap)
    expected = oracle_attention(query[:len(SEQ_LENS)], batch, [1] * len(SEQ_LENS), SCALE, window,
                                softcap or 0.0)
    assert_close_to(decode, expected, dtype)


def test_the_oracle_sees_both_variants():
    """The window and the softcap each change the answer of these cases (so they are tested)."""
    batch, query = _setup(SEQ_LENS, sum(Q_LENS), 1, torch.float32, "cpu")
    plain = oracle_attention(query, batch, Q_LENS, SCALE)
    assert not torch.allclose(oracle_attention(query, batch, Q_LENS, SCALE, 70), plain)
    assert not torch.allclose(oracle_attention(query, batch, Q_LENS, SCALE, 0, 1.5), plain)
    assert torch.equal(oracle_attention(query, batch, Q_LENS, SCALE, 150), plain)


@pytest.mark.parametrize(("window", "softcap", "device"),
                         device_matrix(WINDOW_SOFTCAP, cpu=WINDOW_SOFTCAP_CPU))
def test_triton_decode_matches_torch_and_oracle(device, window, softcap):
    skip_unless_triton_runs_on(device)
    batch, query = _setup(SEQ_LENS, len(SEQ_LENS), 4, torch.float32, device)
    out = _decode(paged_decode_attention_triton, batch, query, window, softcap)
    assert_close_to(out, _decode(paged_decode_attention_torch, batch, query, window, softcap),
                    torch.float32)
    expected = oracle_attention(query, batch, [1] * len(SEQ_LENS), SCALE, window, softcap or 0.0)
    assert_close_to(out, expected, torch.float32)


# Under the interpreter (device_matrix): the default plan (one split without SMs) and 3 (the
# window's two tiles, merged; 8 asks for more and gets the same two).
@pytest.mark.parametrize(("num_splits", "device"), device_matrix([None, 1, 3, 8], cpu=[None, 3]))
def test_split_k_covers_only_the_window(device, num_splits):
    skip_unless_triton_runs_on(device)
    """700 positions (11 tiles) under a 61-position window that starts on the last position of
    tile 9: the splits share tiles 9 and 10 only, and the 5-token sequence leaves its second
    split empty, which must weigh nothing in the merge."""
    batch, query = _setup([700, 5], 2, 4, torch.bfloat16, device)
    out = _decode(paged_decode_attention_triton, batch, query, 61, 1.5, num_splits)
    assert_close_to(out, _decode(paged_decode_attention_torch, batch, query, 61, 1.5),
                    torch.bfloat16)
    assert_close_to(out, oracle_attention(query, batch, [1, 1], SCALE, 61, 1.5), torch.bfloat16)


def test_split_plan_counts_the_tiles_a_window_reaches():
    cpu = torch.device("cpu")
    assert split_plan(8, 1, 700, cpu, 100) == (3, 1)  # 100 positions touch at most 3 tiles
    assert split_plan(8, 1, 700, cpu, 65) == (2, 1)
    assert split_plan(8, 1, 700, cpu, 64) == (2, 1)  # unaligned, 64 positions span two tiles
    assert split_plan(8, 1, 100, cpu, 4096) == (2, 1)  # a window longer than the table


@pytest.mark.parametrize(("window", "softcap", "device"),
                         device_matrix(WINDOW_SOFTCAP, cpu=WINDOW_SOFTCAP_CPU))
def test_triton_prefill_matches_torch_and_oracle(device, window, softcap):
    skip_unless_triton_runs_on(device)
    batch, query = _setup(SEQ_LENS, sum(Q_LENS), 1, torch.float32, device)
    out = _prefill(paged_prefill_attention_triton, batch, query, Q_LENS, window, softcap)
    assert_close_to(out, _prefill(paged_prefill_attention_torch, batch, query, Q_LENS, window,
                                  softcap), torch.float32)
    expected = oracle_attention(query, batch, Q_LENS, SCALE, window, softcap or 0.0)
    assert_close_to(out, expected, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
def test_triton_prefill_rows_whose_window_starts_in_a_later_tile(device):
    skip_unless_triton_runs_on(device)
    """150 new tokens after a 30-token prefix, window 32: the second 64-row program's first row
    (position 94) sees from position 63, the last of tile 0, while its last rows see tile 1
    only, so they count nothing in the first tile walked (their softmax state must stay
    empty, not NaN)."""
    batch, query = _setup([180, 9], 159, 2, torch.float16, device, head_dim=80)
    out = _prefill(paged_prefill_attention_triton, batch, query, [150, 9], 32, 1.5)
    assert_close_to(out, oracle_attention(query, batch, [150, 9], SCALE, 32, 1.5),
                    torch.float16)


@pytest.mark.parametrize("device", DEVICES)
def test_large_scores_saturate_the_softcap_without_nan(device):
    skip_unless_triton_runs_on(device)
    """Scores of +-hundreds (scale 20) put tanh deep in saturation."""
    batch, query = _setup([40, 3], 2, 2, torch.float32, device)
    args = (query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, 20.0)
    out = paged_decode_attention_triton(*args, softcap=5.0)
    assert_close_to(out, paged_decode_attention_torch(*args, softcap=5.0), torch.float32)
    assert_close_to(out, oracle_attention(query, batch, [1, 1], 20.0, 0, 5.0), torch.float32)


@pytest.mark.parametrize("impl", [paged_decode_attention_torch, paged_decode_attention_triton,
                                  paged_prefill_attention_torch, paged_prefill_attention_triton],
                         ids=["decode-torch", "decode-triton", "prefill-torch", "prefill-triton"])
def test_bad_window_or_softcap_is_refused(impl):
    if impl in (paged_decode_attention_triton, paged_prefill_attention_triton):
        skip_unless_triton_runs_on("cpu")
    batch, query = _setup([5, 20], 2, 1, torch.float32, "cpu")
    args = [query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens]
    if impl in (paged_prefill_attention_torch, paged_prefill_attention_triton):
        args.append(query_start_loc([1, 1], "cpu"))
    bad = [
        ({"sliding_window": -1}, "sliding_window must be None or an int >= 0, got -1"),
        ({"sliding_window": 2.5}, "sliding_window must be None or an int >= 0, got 2.5"),
        ({"softcap": -1.0}, "softcap must be None or a finite float >= 0, got -1.0"),
        ({"softcap": float("nan")}, "softcap must be None or a finite float >= 0, got nan"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=re.escape(message)):
            impl(*args, SCALE, **kwargs)
    off = impl(*args, SCALE, sliding_window=0, softcap=0.0)  # 0 turns either off
    torch.testing.assert_close(off, impl(*args, SCALE), atol=0, rtol=0)
