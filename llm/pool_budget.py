"""How big the embedded daemon's KV pool is: the first rule that applies, of

1. `num_blocks` or `kv_cache_memory`, when given: exactly that;
2. CUDA, vLLM's `gpu_memory_utilization`: that share of the device's memory, minus what is in
   use now (other processes, this process's CUDA context), minus the weights the runner is about
   to load (the checkpoint's size at the served dtype), minus ACTIVATION_RESERVE for the
   forward's activations (vLLM profiles a forward to find that figure; a fixed reserve is
   simpler and errs on the safe side for the models pagedkv runs);
3. CPU: CPU_KV_FRACTION of the RAM available after the weights, at most CPU_KV_CAP (the default
   KV space of vLLM's CPU backend), and no more than the free space of /dev/shm, where the pool
   file lives. gpu_memory_utilization does not apply: the weights, the runner's activations,
   the clients and the rest of the machine share that RAM, and the pool's pages are reserved
   when the daemon starts.

These are `LLM`'s choices; the arithmetic is pagedkv.vocab.pool_sizing's and the measurement
pagedkv.memory.device_memory's, the daemon's own. The daemon turns the byte budget into whole
blocks of the model's geometry (`--kv-memory`).
"""

from pagedkv.llm.config import LLMConfig
from pagedkv.vocab.pool_sizing import DeviceMemory, kv_budget

# CUDA: memory kept for the forward's activations beyond the weights and the pool.
ACTIVATION_RESERVE = 2**30
# CPU: the share of available RAM (after the weights) the pool may take, and its cap.
CPU_KV_FRACTION = 0.25
CPU_KV_CAP = 4 * 2**30
# Where the daemon puts a CPU pool (its default --shm-dir).
SHM_DIR = "/dev/shm"


def embedded_budget(memory: DeviceMemory, weights: int, gpu_memory_utilization: float) -> int:
    """Bytes for the pool under rules 2 and 3; ValueError, with the figures, when none are
    left."""
    try:
        if memory.on_cpu:
            return kv_budget(memory, CPU_KV_FRACTION, weights=weights, cap=CPU_KV_CAP)
        return kv_budget(memory, gpu_memory_utilization, weights=weights,
                         reserve=ACTIVATION_RESERVE)
    except ValueError as exc:
        raise ValueError(f"{exc}; give kv_cache_memory or num_blocks") from exc


def pool_size_args(config: LLMConfig, device: str, weights: int) -> list[str]:
    """The daemon's flag that sizes its pool."""
    if config.num_blocks is not None:
        return ["--num-blocks", str(config.num_blocks)]
    budget = config.kv_cache_bytes
    if budget is None:
        # Imported here: torch takes seconds to import, and rule 1 needs none of it.
        from pagedkv.memory.device_memory import measure

        budget = embedded_budget(measure(device, SHM_DIR), weights,
                                 config.gpu_memory_utilization)
    return ["--kv-memory", str(budget)]
