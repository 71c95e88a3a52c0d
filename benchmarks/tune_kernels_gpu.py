"""Tune the Triton kernels' launch options on this device and write the table the launchers read
(model_runner/kernels/tuned_configs.json): `make tune-gpu`.

    python benchmarks/tune_kernels_gpu.py              # every key of the table (about 40 min)
    python benchmarks/tune_kernels_gpu.py --quick      # decode and prefill at D=128, GROUP 4,
                                                       # bf16: compare with the committed table
    python benchmarks/tune_kernels_gpu.py --defaults   # no device: the launchers' defaults,
                                                       # "tuned_on": null (the committed table)

For each key (kernel, HEAD_DIM, GROUP, dtype, cache dtype) of tuned_configs.table_keys, it times
every candidate (num_warps x num_stages; one that does not compile, e.g. too much shared memory,
is skipped) on one problem of that shape, through the real launcher with the candidate made the
active table's entry, and keeps the fastest, unless it beats the launcher's default by less than
MIN_GAIN (noise). A candidate whose output differs from the default's beyond TOLERANCE is refused.
Figures, one per line as `name: value unit`: each key's best against the default
(`tune_speedup_<key>`), whether it differs from the committed table (`tune_differs_<key>`), and
the count (`tune_differs_total`). --quick writes nothing unless --out names a file.

Without CUDA (and without --defaults) it fails: exit 1, the reason on one line of stderr.
"""

import argparse
import sys
from collections.abc import Callable
from itertools import product
from pathlib import Path

import torch

from pagedkv.memory.cuda_driver import why_no_cuda
from pagedkv.model_runner.kernels.attention_backend import TRITON_BACKEND
from pagedkv.model_runner.kernels.paged_decode import default_options
from pagedkv.model_runner.kernels.paged_prefill import DEFAULT_OPTIONS
from pagedkv.model_runner.kernels.triton_env import triton
from pagedkv.model_runner.kernels.tuned_configs import (
    TABLE_PATH,
    ConfigKey,
    LaunchOptions,
    TunedTable,
    load_table,
    table_keys,
    using,
)

PROG = "tune-gpu"
# Candidates per kernel: (num_warps, num_stages).
CANDIDATES = {"decode": list(product((2, 4, 8), (1, 2, 3, 4))),
              "prefill": list(product((4, 8), (1, 2, 3)))}
# The problem each key is timed on: KV heads, tokens per block; decode: batch x context;
# prefill: batch x context, the last `chunk` tokens new (a chunk after a cached prefix).
KV_HEADS, BLOCK_SIZE = 8, 16
DECODE_SHAPE = (64, 4096)
PREFILL_SHAPE = (4, 2048, 512)
# A candidate replaces the default only if it is at least this much faster.
MIN_GAIN = 0.03
# Largest |candidate - default| / (1 + |default|): the same sums in another order.
TOLERANCE = 2e-2
# --quick's keys.
QUICK_KEYS = [ConfigKey(kernel, 128, 4, "bfloat16", "bfloat16") for kernel in ("decode",
                                                                              "prefill")]


def default_of(key: ConfigKey) -> LaunchOptions:
    """The launcher's options for `key` without a table entry."""
    if key.kernel == "decode":
        return default_options(key.head_dim, getattr(torch, key.dtype))
    return DEFAULT_OPTIONS


def defaults_table(path: Path) -> TunedTable:
    """Every key with its launcher's default, marked untuned."""
    return TunedTable(path, None, None, {key: default_of(key) for key in table_keys()})


def problem(key: ConfigKey, device: torch.device) -> Callable[[], torch.Tensor]:
    """A launch of `key`'s kernel on random data of the tuning shape (tables in random order)."""
    dtype, kv_dtype = getattr(torch, key.dtype), getattr(torch, key.kv_dtype)
    batch, context = DECODE_SHAPE if key.kernel == "decode" else PREFILL_SHAPE[:2]
    blocks = triton.cdiv(context, BLOCK_SIZE)
    pool = torch.randn(batch * blocks, 2, BLOCK_SIZE, KV_HEADS, key.head_dim, device=device,
                       dtype=dtype).to(kv_dtype)
    k_cache, v_cache = pool[:, 0], pool[:, 1]
    tables = torch.randperm(batch * blocks, device=device).int().view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    rows = batch if key.kernel == "decode" else batch * PREFILL_SHAPE[2]
    query = torch.randn(rows, KV_HEADS * key.group, key.head_dim, dtype=dtype, device=device)
    scale = key.head_dim**-0.5
    if key.kernel == "decode":
        return lambda: TRITON_BACKEND.paged_decode_attention(
            query, k_cache, v_cache, tables, lens, scale, check_values=False)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=device) * PREFILL_SHAPE[2]
    return lambda: TRITON_BACKEND.paged_prefill_attention(
        query, k_cache, v_cache, tables, lens, starts, scale, check_values=False)


def median_ms(fn: Callable[[], object]) -> float:
    return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def tune_key(key: ConfigKey, base: TunedTable, device: torch.device) -> tuple[LaunchOptions,
                                                                               float]:
    """(the fastest options for `key`, its speedup over the default)."""
    run, default = problem(key, device), default_of(key)
    with using(base.with_options(key, default)):
        expected = run().float()
        default_ms = median_ms(run)
    best, best_ms = default, default_ms
    for warps, stages in CANDIDATES[key.kernel]:
        options = LaunchOptions(warps, stages)
        try:
            with using(base.with_options(key, options)):
                error = ((run().float() - expected).abs() / (1 + expected.abs())).max().item()
                ms = median_ms(run) if error <= TOLERANCE else float("inf")
        except (triton.runtime.errors.OutOfResources, RuntimeError) as exc:
            print(f"# {key_name(key)} warps={warps} stages={stages}: skipped ({exc})")
            continue
        if ms < best_ms * (1 - MIN_GAIN):
            best, best_ms = options, ms
    return best, default_ms / best_ms


def key_name(key: ConfigKey) -> str:
    return f"{key.kernel}_d{key.head_dim}_g{key.group}_{key.dtype}_{key.kv_dtype}"


def tune(keys: list[ConfigKey], committed: TunedTable, device: torch.device) -> TunedTable:
    """`committed` with each of `keys` tuned on `device`; prints each key's figures."""
    name = torch.cuda.get_device_name(device)
    fp8 = torch.cuda.get_device_capability(device) >= (8, 9)
    tuned = TunedTable(committed.path, name, triton.__version__, dict(committed.configs))
    differs = 0
    for key in keys:
        if key.kv_dtype.startswith("float8") and not fp8:
            print(f"# {key_name(key)}: skipped (fp8 needs sm_89 or later)")
            continue
        options, speedup = tune_key(key, tuned, device)
        tuned = tuned.with_options(key, options)
        changed = committed.configs.get(key) != options
        differs += changed
        print(f"tune_speedup_{key_name(key)}: {speedup:.3f} ratio")
        print(f"tune_warps_{key_name(key)}: {options.num_warps} warps")
        print(f"tune_stages_{key_name(key)}: {options.num_stages} stages")
        print(f"tune_differs_{key_name(key)}: {int(changed)} bool", flush=True)
        torch.cuda.empty_cache()
    print(f"tune_differs_total: {differs} count")
    return tuned


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true",
                        help="only decode and prefill at D=128, GROUP 4, bf16; writes nothing "
                             "unless --out is given")
    parser.add_argument("--defaults", action="store_true",
                        help="write the launchers' defaults, untuned (no device needed)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"where to write the table (default: {TABLE_PATH.name} next to "
                             "the kernels, except with --quick)")
    args = parser.parse_args(argv)
    out = args.out if args.out is not None or args.quick else TABLE_PATH
    if args.defaults:
        Path(out).write_text(defaults_table(out).to_json())
        return 0
    missing = why_no_cuda()
    if missing is not None:
        print(f"{PROG}: {missing}", file=sys.stderr)
        return 1
    committed = load_table(TABLE_PATH)
    tuned = tune(QUICK_KEYS if args.quick else table_keys(), committed, torch.device("cuda"))
    if out is not None:
        Path(out).write_text(tuned.to_json())
        print(f"# wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
