"""The dots' operand dtype (paged_tile.dot_dtype): fp16/bf16 caches feed tl.dot natively (fp32
accumulator), fp32 caches exactly; bf16 keeps fp32 operands under the interpreter, whose numpy
tl.dot multiplies bf16's raw bits as integers.

fp16 is right in the interpreter (numpy upcasts fp16 operands to the fp32 accumulator exactly),
so its native path runs here: P rounded to fp16 before P @ V, l_i summed from the same rounded
P. Against the fp32 torch twin and the float64 oracle that path stays within
kernel_utils.TOLERANCE[float16] = (atol 2e-3, rtol 2e-3), the tolerance of a result rounded to
fp16 once. bf16's native path is checked by compiling it for sm_90 (test_kernels_compile.py).
"""

import pytest
import torch

from pagedkv.model_runner.kernels import paged_decode
from pagedkv.model_runner.kernels.paged_decode import (
    paged_decode_attention_torch,
    paged_decode_attention_triton,
)
from pagedkv.model_runner.kernels.paged_prefill import (
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
)
from pagedkv.model_runner.kernels.paged_tile import dot_dtype
from pagedkv.model_runner.kernels.triton_env import is_interpreted, tl

from kernel_utils import (
    assert_close_to,
    make_paged_batch,
    oracle_attention,
    query_start_loc,
    random_tokens,
    skip_unless_triton_runs_on,
)

SCALE = 0.125


def test_dot_dtype_is_native_where_tl_dot_computes_it():
    interpreted = paged_decode._decode_split_kernel
    compiled = object()  # anything that is not an InterpretedFunction: a compiled kernel
    for kernel in (interpreted, compiled):
        assert dot_dtype(torch.float32, kernel) == tl.float32
        assert dot_dtype(torch.float16, kernel) == tl.float16
    assert dot_dtype(torch.bfloat16, compiled) == tl.bfloat16
    if is_interpreted(interpreted):  # a machine without CUDA
        assert dot_dtype(torch.bfloat16, interpreted) == tl.float32


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_fp16_takes_native_operands_in_the_interpreter(kernel):
    skip_unless_triton_runs_on("cpu")
    # Contexts across several 64-position tiles (rescaled state) and a GQA group of 2.
    seq_lens, q_lens = [150, 17], ([1, 1] if kernel == "decode" else [40, 17])
    batch = make_paged_batch(seq_lens, 16, 2, 64, torch.float16, "cpu")
    query = random_tokens(sum(q_lens), 4, 64, torch.float16, "cpu")
    caches = (batch.k_cache, batch.v_cache, batch.block_tables, batch.seq_lens)
    if kernel == "decode":
        out = paged_decode_attention_triton(query, *caches, SCALE)
        twin = paged_decode_attention_torch(query, *caches, SCALE)
    else:
        qsl = query_start_loc(q_lens, "cpu")
        out = paged_prefill_attention_triton(query, *caches, qsl, SCALE)
        twin = paged_prefill_attention_torch(query, *caches, qsl, SCALE)
    assert_close_to(out, twin, torch.float16)
    assert_close_to(out, oracle_attention(query, batch, q_lens, SCALE), torch.float16)
