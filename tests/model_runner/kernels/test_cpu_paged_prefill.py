"""The CPU backend's C prefill (cpu_paged) against the torch twin, and its trust boundary.

Pools come from kernel_utils: scattered blocks, NaN in every slot no sequence owns and -1 past
each table row's used blocks, so a read outside a sequence's context leaks NaN. Each case mixes
whole prompts (q_len = seq_len), chunks after an earlier context (a chunked prefill or a cached
prefix, at and off block boundaries) and single-row chunks, over contexts 1..300. Bad values
(block ids, lengths, query offsets) must raise ValueError naming them and leave the pool as it
was.
"""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv.model_runner.kernels.attention_backend import CPU_BACKEND
from pagedkv.model_runner.kernels.cpu_paged import paged_prefill_attention_cpu
from pagedkv.model_runner.kernels.paged_prefill import paged_prefill_attention_torch

from kernel_utils import (
    PagedBatch,
    assert_close_to,
    make_paged_batch,
    query_start_loc,
    random_tokens,
)

SCALE = 0.125
FP8 = torch.float8_e4m3fn
# (seq_len, q_len) with block size 16: whole prompts, chunks after an earlier context (aligned,
# unaligned, spanning blocks), single rows (a decode row in a prefill batch), up to 300.
CHUNKS = [(1, 1), (15, 15), (16, 16), (17, 17), (40, 7), (131, 131), (300, 45), (48, 16),
          (37, 1), (300, 300), (90, 33)]


def _batch(chunks: list[tuple[int, int]], group: int, head_dim: int, dtype: torch.dtype,
           block_size: int = 16) -> tuple[PagedBatch, torch.Tensor, torch.Tensor]:
    seq_lens, q_lens = (list(column) for column in zip(*chunks, strict=True))
    batch = make_paged_batch(seq_lens, block_size, 2, head_dim, dtype, "cpu")
    query = random_tokens(sum(q_lens), 2 * group, head_dim, dtype, "cpu")
    return batch, query, query_start_loc(q_lens, "cpu")


def _prefill_both(batch: PagedBatch, query: torch.Tensor, qsl: torch.Tensor,
                  **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    args = (query, batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens, qsl, SCALE)
    return (paged_prefill_attention_cpu(*args, **kwargs),
            paged_prefill_attention_torch(*args, **kwargs))


@pytest.mark.parametrize(("group", "dtype"), list(itertools.product(
    [1, 2, 4], [torch.float32, torch.float16, torch.bfloat16])))
def test_prefill_matches_the_twin(group, dtype):
    batch, query, qsl = _batch(CHUNKS, group, 64, dtype)
    out, expected = _prefill_both(batch, query, qsl)
    assert out.dtype == dtype and out.shape == query.shape
    assert_close_to(out, expected, dtype)


@pytest.mark.parametrize(("window", "softcap"), [(20, None), (None, 1.5), (33, 2.0), (1, None),
                                                 (400, None), (16, None)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_window_and_softcap_match_the_twin(window, softcap, dtype):
    batch, query, qsl = _batch(CHUNKS, 2, 64, dtype)
    out, expected = _prefill_both(batch, query, qsl, sliding_window=window, softcap=softcap)
    assert_close_to(out, expected, dtype)


@pytest.mark.parametrize("head_dim", [20, 36, 80, 128])  # lane tails, one chain, four chains
def test_prefill_head_dims_and_block_sizes(head_dim):
    batch, query, qsl = _batch([(5, 5), (37, 12), (70, 70)], 2, head_dim, torch.float32,
                               block_size=8)
    assert_close_to(*_prefill_both(batch, query, qsl, sliding_window=21), torch.float32)


@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_prefill_over_an_fp8_cache_matches_the_twin(query_dtype):
    batch, query, qsl = _batch(CHUNKS, 2, 64, torch.float32)
    batch.pool = batch.pool.to(FP8)  # NaN stays NaN in e4m3
    query = query.to(query_dtype)
    out, expected = _prefill_both(batch, query, qsl, sliding_window=50, softcap=3.0)
    assert out.dtype == query_dtype
    assert_close_to(out, expected, query_dtype)


def test_prefill_of_no_tokens_and_max_q_len():
    batch, query, qsl = _batch([(20, 5), (40, 9)], 1, 32, torch.float32)
    empty = paged_prefill_attention_cpu(query[:0], batch.k_cache, batch.v_cache,
                                        batch.block_tables[:0], batch.seq_lens[:0], qsl[:1],
                                        SCALE)
    assert empty.shape == (0, 2, 32)
    assert_close_to(*_prefill_both(batch, query, qsl, max_q_len=9), torch.float32)
    with pytest.raises(ValueError, match="max_q_len=8 is shorter than the longest chunk"):
        _prefill_both(batch, query, qsl, max_q_len=8)


def test_the_cpu_backend_prefills_in_c():
    assert CPU_BACKEND.paged_prefill_attention is paged_prefill_attention_cpu


def _refused(batch: PagedBatch, query: torch.Tensor, qsl: torch.Tensor, message: str) -> None:
    """The C prefill raises `message` (check_values=False: the C checks alone) and the pool is
    unchanged, NaN included."""
    before = batch.pool.clone()
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention_cpu(query, batch.k_cache, batch.v_cache, batch.block_tables,
                                    batch.seq_lens, qsl, SCALE, check_values=False)
    assert torch.equal(batch.pool.isnan(), before.isnan())
    assert torch.equal(batch.pool.nan_to_num(), before.nan_to_num())


# (row, value written at column 1 of that row, error); the pool has 7 blocks.
@pytest.mark.parametrize(("row", "value", "message"), [
    (0, 7, r"block_tables\[0, 1\] = 7: a block in use must be in \[0, 7\)"),
    (1, -1, r"block_tables\[1, 1\] = -1"),
    (1, 2**31 - 1, r"block_tables\[1, 1\] = 2147483647")])
def test_prefill_refuses_a_block_outside_the_pool(row, value, message):
    batch, query, qsl = _batch([(20, 20), (20, 4)], 1, 32, torch.float32)
    batch.block_tables[row, 1] = value
    _refused(batch, query, qsl, message)


@pytest.mark.parametrize(("length", "message"), [
    (49, r"seq_lens\[1\] = 49: must be in \[1, 48\]"), (0, r"seq_lens\[1\] = 0"),
    (-5, r"seq_lens\[1\] = -5")])
def test_prefill_refuses_a_length_the_table_cannot_hold(length, message):
    batch, query, qsl = _batch([(20, 20), (20, 4)], 1, 32, torch.float32)  # table: 3 blocks
    batch.seq_lens[1] = length
    _refused(batch, query, qsl, message)


# query_start_loc of chunks (20, 4) over seq_lens (20, 20): T = 24.
@pytest.mark.parametrize(("starts", "message"), [
    ([1, 20, 24], r"query_start_loc must run from 0 to T=24, got 1 to 24"),
    ([0, 20, 23], r"query_start_loc must run from 0 to T=24, got 0 to 23"),
    ([0, 0, 24], r"query_start_loc\[0:2\] gives a chunk of 0 rows: must be in \[1, "
                 r"seq_lens\[0\] = 20\]"),
    ([0, 21, 24], r"query_start_loc\[0:2\] gives a chunk of 21 rows"),
    ([0, 24, 24], r"query_start_loc\[0:2\] gives a chunk of 24 rows"),
    ([0, -2**31, 24], r"query_start_loc\[0:2\] gives a chunk of -2147483648 rows"),
    ([0, 2, 24], r"query_start_loc\[1:3\] gives a chunk of 22 rows: must be in \[1, "
                 r"seq_lens\[1\] = 20\]")])
def test_prefill_refuses_bad_query_offsets(starts, message):
    batch, query, _ = _batch([(20, 20), (20, 4)], 1, 32, torch.float32)
    _refused(batch, query, torch.tensor(starts, dtype=torch.int32), message)


def test_prefill_reads_no_table_entry_past_a_sequence():
    batch, query, qsl = _batch([(20, 20), (20, 3)], 1, 32, torch.float32)
    batch.block_tables[:, 2] = 2**31 - 1  # column 2 of a 2-block sequence is never used
    assert_close_to(*_prefill_both(batch, query, qsl, check_values=False), torch.float32)


def _pytest_under(setting: str, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest of this folder's `args` in a fresh process with PAGEDKV_CPU_KERNELS=setting."""
    env = {**os.environ, "PAGEDKV_CPU_KERNELS": setting}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                          cwd=Path(__file__).parent, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


@pytest.mark.skipif(os.environ.get("PAGEDKV_CPU_KERNELS") == "portable",
                    reason="already the portable copy")
def test_the_portable_copy_matches_the_twin():
    # both files' parity tests, decode included, on the loops' portable copy
    run = _pytest_under("portable", "test_cpu_paged.py", "test_cpu_paged_prefill.py", "-k",
                        "match or head_dims or vectorized")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "deselected" in run.stdout


def test_an_unknown_kernel_setting_is_refused_at_import():
    run = subprocess.run(
        [sys.executable, "-c", "import pagedkv.model_runner.kernels._cpu_paged"],
        env={**os.environ, "PAGEDKV_CPU_KERNELS": "avx512"}, capture_output=True, text=True,
        timeout=60, check=False)
    assert run.returncode != 0
    assert "ValueError: PAGEDKV_CPU_KERNELS=avx512: expected 'auto' or 'portable'" in run.stderr
