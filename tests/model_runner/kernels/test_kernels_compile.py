"""The Triton kernels compile for a Hopper GPU (sm_90), checked on a machine without one.

The interpreter runs the kernels' Python, not Triton's compiler, so a construct the compiler
rejects (a dot shape, a constexpr rule, a loop form) or a tile that needs more shared memory than
an H100/H200 block may use would pass every CPU test. Triton compiles ahead of time without a
device: this module, run as a script with TRITON_INTERPRET=0, compiles every kernel to a cubin
for sm_90 in the configurations the launchers use and prints each kernel's shared memory.
"""

import os
import subprocess
import sys
from typing import Any

# Shared memory one block may use on sm_90 (227 KiB, opt-in maximum).
SM90_MAX_SHARED = 227 * 1024


def test_kernels_compile_for_sm90():
    env = os.environ | {"TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    shared = [int(line.rsplit(" ", 2)[-2]) for line in done.stdout.splitlines()]
    assert len(shared) == 7, done.stdout
    assert max(shared) <= SM90_MAX_SHARED, done.stdout


def _compile_all() -> None:
    """Compile each kernel for sm_90 and print `name: shared_bytes bytes`."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from pagedkv.model_runner.kernels import paged_decode, paged_prefill, store_kv
    from pagedkv.model_runner.kernels.triton_env import is_interpreted, tl, triton

    assert not is_interpreted(store_kv._store_kv_kernel), "run with TRITON_INTERPRET=0"

    def build(name: str, fn: Any, pointers: dict[str, str], constexprs: dict[str, object],
              num_warps: int = 4) -> None:
        # Every argument that is neither a pointer nor a constexpr is an int32 stride/count/window,
        # except the fp32 score scales.
        signature = {arg: "constexpr" if arg in constexprs else pointers.get(arg, "i32")
                     for arg in fn.arg_names}
        signature |= {arg: "fp32" for arg in signature if arg in ("qk_scale", "cap_log2")}
        source = ASTSource(fn, signature, constexprs=constexprs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": num_warps, "num_stages": 2})
        print(f"{name}: {kernel.metadata.shared} bytes")

    # bf16 with a sliding window and a softcap (Gemma2's layers), fp32 with neither; each dot's
    # operands in the cache's dtype (dot_dtype on a GPU).
    for dtype, dot, variant in (("bf16", tl.bfloat16, True), ("fp32", tl.float32, False)):
        cache = {"K_cache": f"*{dtype}", "V_cache": f"*{dtype}", "Q": f"*{dtype}",
                 "Block_tables": "*i32", "Seq_lens": "*i32"}
        shape = {"BLOCK_SIZE": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128,
                 "DOT_DTYPE": dot, "WINDOWED": variant, "SOFTCAP": variant}
        build(f"decode_{dtype}", paged_decode._decode_split_kernel,
              cache | {"Partial": "*fp32", "Lse": "*fp32"},
              shape | {"GROUP": 4, "GROUP_PAD": 16, "TILE_N": paged_decode.TILE_N,
                       "STORE_LSE": True})
        build(f"prefill_{dtype}", paged_prefill._prefill_kernel,
              cache | {"Query_start_loc": "*i32", "Out": f"*{dtype}"},
              shape | {"GROUP": 4, "BLOCK_M": paged_prefill.BLOCK_M,
                       "TILE_N": paged_prefill.TILE_N}, num_warps=8)
    build("decode_fp16_d64_group1", paged_decode._decode_split_kernel,
          {"K_cache": "*fp16", "V_cache": "*fp16", "Q": "*fp16", "Block_tables": "*i32",
           "Seq_lens": "*i32", "Partial": "*fp16", "Lse": "*fp32"},
          {"BLOCK_SIZE": 32, "HEAD_DIM": 64, "HEAD_DIM_PAD": 64, "DOT_DTYPE": tl.float16,
           "GROUP": 1, "GROUP_PAD": 16, "TILE_N": paged_decode.TILE_N, "STORE_LSE": False,
           "WINDOWED": True, "SOFTCAP": False})
    build("decode_merge", paged_decode._decode_merge_kernel,
          {"Partial": "*fp32", "Lse": "*fp32", "Out": "*bf16"},
          {"HEAD_DIM": 128, "HEAD_DIM_PAD": 128})
    build("store_kv", store_kv._store_kv_kernel,
          {"Key": "*bf16", "Value": "*bf16", "K_cache": "*bf16", "V_cache": "*bf16",
           "Slot_mapping": "*i64"},
          {"NUM_KV_HEADS": 8, "HEADS_PAD": 8, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128,
           "BLOCK_SIZE": 16})


if __name__ == "__main__":
    _compile_all()
