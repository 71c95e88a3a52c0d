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

The daemon turns a byte budget into whole blocks of the model's geometry (`--kv-memory`).
"""

import os
from dataclasses import dataclass

from pagedkv.llm.config import LLMConfig
from pagedkv.vocab.units import format_bytes

# CUDA: memory kept for the forward's activations beyond the weights and the pool.
ACTIVATION_RESERVE = 2**30
# CPU: the share of available RAM (after the weights) the pool may take, and its cap.
CPU_KV_FRACTION = 0.25
CPU_KV_CAP = 4 * 2**30
# Where the daemon puts a CPU pool (its default --shm-dir).
SHM_DIR = "/dev/shm"


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The device's memory just before the daemon starts, in bytes."""

    # "cpu" or "cuda[:N]".
    device: str
    # CUDA: the device's memory (unused on CPU).
    total: int
    # CUDA: free now; CPU: MemAvailable (RAM the kernel can hand out without swapping).
    free: int
    # CPU: free space of SHM_DIR (unused on CUDA).
    shm_free: int = 0


def kv_budget(memory: DeviceMemory, weights: int, gpu_memory_utilization: float) -> int:
    """Bytes for the pool under rules 2 and 3; ValueError, with the figures, when none are
    left."""
    if memory.device.startswith("cuda"):
        in_use = memory.total - memory.free
        budget = int(gpu_memory_utilization * memory.total) - in_use - weights - ACTIVATION_RESERVE
        figures = (f"{gpu_memory_utilization} x {format_bytes(memory.total)} - in use "
                   f"{format_bytes(in_use)} - weights {format_bytes(weights)} - activations "
                   f"{format_bytes(ACTIVATION_RESERVE)}")
    else:
        budget = min(int(CPU_KV_FRACTION * (memory.free - weights)), CPU_KV_CAP, memory.shm_free)
        figures = (f"min({CPU_KV_FRACTION} x (available RAM {format_bytes(memory.free)} - "
                   f"weights {format_bytes(weights)}), {format_bytes(CPU_KV_CAP)}, "
                   f"free in {SHM_DIR} {format_bytes(memory.shm_free)})")
    if budget <= 0:
        raise ValueError(f"no memory left for the KV cache on {memory.device}: {figures} = "
                         f"{format_bytes(budget)}; give kv_cache_memory or num_blocks")
    return budget


def measure(device: str) -> DeviceMemory:
    """The device's memory now (imports torch for CUDA; creates this process's CUDA context,
    which is then counted as in use)."""
    if device.startswith("cuda"):
        import torch

        free, total = torch.cuda.mem_get_info(torch.device(device))
        return DeviceMemory(device, total=total, free=free)
    from pagedkv.daemon.memory.kv_memory import available_ram

    shm = os.statvfs(SHM_DIR)
    return DeviceMemory(device, total=0, free=available_ram(),
                        shm_free=shm.f_bavail * shm.f_frsize)


def pool_size_args(config: LLMConfig, device: str, weights: int) -> list[str]:
    """The daemon's flag that sizes its pool."""
    if config.num_blocks is not None:
        return ["--num-blocks", str(config.num_blocks)]
    budget = config.kv_cache_bytes
    if budget is None:
        budget = kv_budget(measure(device), weights, config.gpu_memory_utilization)
    return ["--kv-memory", str(budget)]
