"""How big the embedded daemon's KV pool is: the first rule that applies, of

1. `num_blocks` or `kv_cache_memory`, when given: exactly that;
2. CUDA, vLLM's `gpu_memory_utilization` (default 0.9): that share of the device's memory,
   minus what is in use now (other processes, this process's CUDA context), minus the weights
   the runner is about to load (the checkpoint's size at the served dtype), minus
   ACTIVATION_RESERVE for the forward's activations (vLLM profiles a forward to find that
   figure; a fixed reserve is simpler and errs on the safe side for the models pagedkv runs);
3. CPU: what the engine can ever hold, `max_num_seqs` sequences of `max_model_len` tokens each
   (default: the model's positions), in whole blocks of the model's K/V at the pool's dtype;
   and no more than `gpu_memory_utilization` (default CPU_KV_FRACTION) of the RAM available
   after the weights, CPU_KV_CAP (the default KV space of vLLM's CPU backend), and the free
   space of /dev/shm, where the pool file lives. The pool's pages are reserved when the daemon
   starts and the weights, the runner's activations, the clients and the rest of the machine
   share that RAM, so a small model gets a small pool: tiny-llama (1 KiB a token) with 8
   sequences of 256 tokens gets 2 MiB, not 4 GiB.

These are `LLM`'s choices; the arithmetic is pagedkv.vocab.pool_sizing's and the measurement
pagedkv.memory.device_memory's, the daemon's own. The daemon turns the byte budget into whole
blocks of the model's geometry (`--kv-memory`).
"""

from pagedkv.llm.config import LLMConfig
from pagedkv.llm.model_ref import ModelRef
from pagedkv.vocab.geometry import cache_dtype, dtype_bytes
from pagedkv.vocab.pool_sizing import DeviceMemory, kv_budget

# CUDA: memory kept for the forward's activations beyond the weights and the pool; the share of
# the device's memory pagedkv uses when gpu_memory_utilization is not given (vLLM's default).
ACTIVATION_RESERVE = 2**30
CUDA_UTILIZATION = 0.9
# CPU: the share of available RAM (after the weights) the pool may take, and its cap.
CPU_KV_FRACTION = 0.25
CPU_KV_CAP = 4 * 2**30
# Where the daemon puts a CPU pool (its default --shm-dir).
SHM_DIR = "/dev/shm"


def embedded_budget(memory: DeviceMemory, weights: int,
                    gpu_memory_utilization: float | None) -> int:
    """Bytes for the pool under rules 2 and 3 (3 without the engine's bound); ValueError, with
    the figures, when none are left."""
    try:
        if memory.on_cpu:
            return kv_budget(memory, gpu_memory_utilization or CPU_KV_FRACTION, weights=weights,
                             cap=CPU_KV_CAP)
        return kv_budget(memory, gpu_memory_utilization or CUDA_UTILIZATION, weights=weights,
                         reserve=ACTIVATION_RESERVE)
    except ValueError as exc:
        raise ValueError(f"{exc}; give kv_cache_memory or num_blocks") from exc


def engine_bound(config: LLMConfig, model: ModelRef, dtype: str) -> int | None:
    """Rule 3's bound: bytes of max_num_seqs sequences of max_model_len tokens in whole blocks;
    None when the model names no positions and max_model_len is not given."""
    max_model_len = config.max_model_len or model.max_positions()
    if max_model_len is None:
        return None
    block_size = config.started_block_size
    blocks_per_seq = -(-max_model_len // block_size)
    kv_dtype = cache_dtype(dtype, config.kv_cache_dtype)
    per_block = model.geometry().bytes_per_block(block_size, dtype_bytes(kv_dtype))
    return config.max_num_seqs * blocks_per_seq * per_block


def pool_size_args(config: LLMConfig, model: ModelRef, device: str, dtype: str) -> list[str]:
    """The daemon's flag that sizes its pool, for `model` in `dtype` on `device`."""
    if config.num_blocks is not None:
        return ["--num-blocks", str(config.num_blocks)]
    budget = config.kv_cache_bytes
    if budget is None:
        # Imported here: torch takes seconds to import, and rule 1 needs none of it.
        from pagedkv.memory.device_memory import measure

        memory = measure(device, SHM_DIR)
        budget = embedded_budget(memory, model.weights_bytes(dtype),
                                 config.gpu_memory_utilization)
        bound = engine_bound(config, model, dtype) if memory.on_cpu else None
        budget = budget if bound is None else min(budget, bound)
    return ["--kv-memory", str(budget)]
