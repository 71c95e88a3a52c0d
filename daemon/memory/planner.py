"""Capacity planning: how many KV blocks, tokens and sequences fit on a device.

    KV budget        = device memory - weights - reserve (CUDA context, activations)
    num_blocks       = floor(KV budget / bytes_per_block)
                       (pagedkv.vocab.pool_sizing's rule, with nothing in use and a share of 1)
    token_capacity   = num_blocks x block_size
    paged_seqs       = floor(num_blocks / ceil(seq_len / block_size))
    contiguous_seqs  = floor(KV budget / (max_model_len x bytes_per_token))
    host_tier_blocks = floor(host memory / bytes_per_block)   (the daemon's host_tier_memory)
    host_tier_tokens = host_tier_blocks x block_size

Paged sequences hold only the blocks their tokens need; contiguous ones each reserve a slab
for the longest allowed sequence, which is the waste paging removes. Run as `pagedkv plan`
(the CLI calls `add_plan_arguments` and `run_plan`) or `python -m pagedkv.daemon.memory.planner`.
This module never imports torch: planning must work on a machine without it.
"""

import argparse
import sys
from dataclasses import dataclass

from pagedkv.vocab.blocks import blocks_for
from pagedkv.vocab.geometry import (
    KV_CACHE_DTYPES,
    ModelGeometry,
    cache_dtype,
    dtype_bytes,
    model_dtype,
    resolve_geometry,
)
from pagedkv.vocab.pool_sizing import DeviceMemory, kv_budget
from pagedkv.vocab.units import format_bytes, parse_bytes


@dataclass(frozen=True, slots=True)
class Plan:
    """The figures of one capacity plan; every size is in bytes."""

    # K and V of one token, all layers.
    bytes_per_token: int
    # One physical block of block_size tokens.
    bytes_per_block: int
    # Token slots per block.
    block_size: int
    # Weights' memory: as given, or num_params x dtype bytes.
    weights_memory: int
    # Memory left for the KV pool after weights and reserve.
    kv_budget: int
    # Blocks the KV budget holds.
    num_blocks: int
    # Token slots in those blocks.
    token_capacity: int
    # Length of the sequences being counted, and the longest one the server admits.
    seq_len: int
    max_model_len: int
    # Blocks one sequence of seq_len takes under paging.
    blocks_per_seq: int
    # Sequences of seq_len that fit when each takes only the blocks it needs.
    paged_seqs: int
    # Sequences that fit when each reserves max_model_len contiguous slots.
    contiguous_seqs: int
    # The host tier of the host memory given (0 bytes: none): blocks, and their tokens.
    host_tier_memory: int = 0
    host_tier_blocks: int = 0


def plan(geometry: ModelGeometry, device_memory: int, weights_memory: int | None, reserve: int,
         block_size: int, dtype_bytes: int, seq_len: int, max_model_len: int,
         host_memory: int = 0, kv_dtype_bytes: int = 0) -> Plan:
    """Plan a pool (and its host tier of `host_memory` bytes) for weights of `dtype_bytes` an
    element and K/V of `kv_dtype_bytes` (0: the weights'; 1 under kv_cache_dtype fp8);
    ValueError when the inputs are inconsistent or leave no room for KV."""
    for name, value in (("block_size", block_size), ("dtype_bytes", dtype_bytes),
                        ("seq_len", seq_len), ("max_model_len", max_model_len)):
        if value <= 0:
            raise ValueError(f"{name} must be positive, got {value}")
    if host_memory < 0:
        raise ValueError(f"host_memory must be 0 or positive, got {host_memory}")
    if kv_dtype_bytes < 0:
        raise ValueError(f"kv_dtype_bytes must be 0 (the weights') or positive, got "
                         f"{kv_dtype_bytes}")
    if seq_len > max_model_len:
        raise ValueError(f"seq_len {seq_len} exceeds max_model_len {max_model_len}")
    if weights_memory is None:
        if geometry.num_params is None:
            raise ValueError(f"the parameter count of {geometry.name!r} is unknown: "
                             "give the weights' memory")
        weights_memory = round(geometry.num_params * dtype_bytes)
    # The pool sizing's accelerator rule, for a device with nothing in use yet, all of it
    # planned for.
    device = DeviceMemory("the planned device", total=device_memory, free=device_memory)
    budget = kv_budget(device, share=1, weights=weights_memory, reserve=reserve)
    per_token = geometry.bytes_per_token(kv_dtype_bytes or dtype_bytes)
    per_block = geometry.bytes_per_block(block_size, kv_dtype_bytes or dtype_bytes)
    num_blocks = budget // per_block
    blocks_per_seq = blocks_for(seq_len, block_size)
    return Plan(bytes_per_token=per_token, bytes_per_block=per_block, block_size=block_size,
                weights_memory=weights_memory, kv_budget=budget, num_blocks=num_blocks,
                token_capacity=num_blocks * block_size, seq_len=seq_len,
                max_model_len=max_model_len, blocks_per_seq=blocks_per_seq,
                paged_seqs=num_blocks // blocks_per_seq,
                contiguous_seqs=budget // (max_model_len * per_token),
                host_tier_memory=host_memory, host_tier_blocks=host_memory // per_block)


def format_plan(p: Plan, title: str = "") -> str:
    """One `name: value unit` line per figure, then `title` and a short table for people."""
    figures = [
        ("bytes_per_token", p.bytes_per_token, "B"),
        ("bytes_per_block", p.bytes_per_block, "B"),
        ("weights_memory", p.weights_memory, "B"),
        ("kv_budget", p.kv_budget, "B"),
        ("num_blocks", p.num_blocks, "blocks"),
        ("token_capacity", p.token_capacity, "tokens"),
        ("blocks_per_seq", p.blocks_per_seq, "blocks"),
        ("paged_seqs", p.paged_seqs, "seqs"),
        ("contiguous_seqs", p.contiguous_seqs, "seqs"),
    ]
    if p.host_tier_memory:
        figures += [("host_tier_blocks", p.host_tier_blocks, "blocks"),
                    ("host_tier_tokens", p.host_tier_blocks * p.block_size, "tokens")]
    lines = [f"{name}: {value} {unit}" for name, value, unit in figures]
    paged_slab = p.blocks_per_seq * p.bytes_per_block
    contiguous_slab = p.max_model_len * p.bytes_per_token
    lines += [
        "",
        *([title] if title else []),
        f"KV budget {format_bytes(p.kv_budget)} = {p.num_blocks} blocks x {p.block_size} tokens"
        f" = {p.token_capacity} tokens",
        f"{'sequences of ' + str(p.seq_len) + ' tokens':<28}{'memory each':>14}{'fit':>8}",
        f"{'paged':<28}{format_bytes(paged_slab):>14}{p.paged_seqs:>8}",
        f"{'contiguous (' + str(p.max_model_len) + ' reserved)':<28}"
        f"{format_bytes(contiguous_slab):>14}{p.contiguous_seqs:>8}",
    ]
    if p.host_tier_memory:
        lines.append(f"host tier {format_bytes(p.host_tier_memory)} = {p.host_tier_blocks} "
                     f"blocks = {p.host_tier_blocks * p.block_size} tokens of evicted prefixes "
                     f"({p.host_tier_blocks / max(p.num_blocks, 1):.1f}x the pool)")
    return "\n".join(lines)


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `pagedkv plan`."""
    parser.add_argument("--model", required=True,
                        help="a built-in model name (e.g. qwen2.5-7b) or a local config.json path")
    parser.add_argument("--device-memory", required=True,
                        help="device memory, e.g. 24GB (GB = 10^9, GiB = 2^30)")
    parser.add_argument("--weights-memory", default=None,
                        help="weights' memory; default: parameter count x dtype bytes")
    parser.add_argument("--reserve", default="0",
                        help="memory kept back for the runtime (CUDA context, activations)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument("--dtype", default=None, help="the model's dtype; default: its config's")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the KV cache's: auto (the dtype's) or fp8 (e4m3, one byte)")
    parser.add_argument("--seq-len", type=int, default=256,
                        help="length of the sequences to count")
    parser.add_argument("--max-model-len", type=int, default=2048,
                        help="longest sequence; what a contiguous cache reserves per sequence")
    parser.add_argument("--host-memory", default="0",
                        help="host memory for the host tier (the daemon's host_tier_memory), "
                             "e.g. 64GiB; default 0: none")


def run_plan(args: argparse.Namespace) -> int:
    """Print the plan for parsed `pagedkv plan` arguments; 0 on success, 2 on bad input."""
    try:
        geometry = resolve_geometry(args.model)
        dtype = model_dtype(args.dtype or geometry.default_dtype)
        kv_dtype = cache_dtype(dtype, args.kv_cache_dtype)
        weights = None if args.weights_memory is None else parse_bytes(args.weights_memory)
        result = plan(geometry, device_memory=parse_bytes(args.device_memory),
                      weights_memory=weights, reserve=parse_bytes(args.reserve),
                      block_size=args.block_size, dtype_bytes=dtype_bytes(dtype),
                      seq_len=args.seq_len, max_model_len=args.max_model_len,
                      host_memory=parse_bytes(args.host_memory),
                      kv_dtype_bytes=dtype_bytes(kv_dtype))
    except ValueError as exc:
        print(f"pagedkv plan: error: {exc}", file=sys.stderr)
        return 2
    print(format_plan(result, title=f"{geometry.name}: {geometry.num_layers} layers, "
                      f"{geometry.num_kv_heads} KV heads, head_dim {geometry.head_dim}, {dtype}, "
                      f"KV {kv_dtype}"))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point for tests and `python -m pagedkv.daemon.memory.planner`."""
    parser = argparse.ArgumentParser(prog="pagedkv plan", description="KV pool capacity plan")
    add_plan_arguments(parser)
    return run_plan(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
