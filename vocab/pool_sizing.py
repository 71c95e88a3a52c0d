"""How big a KV pool is: a byte budget from the device's memory, then whole blocks.

One rule sizes every pool, the daemon's (`kv_fraction`), `LLM`'s embedded one and the
planner's:

    accelerator:  budget = share x total - in use - weights - reserve
    CPU:          budget = min(share x (available - weights - reserve), free in the shm dir)
    with a cap:   budget = min(budget, cap)
    num_blocks    = budget // bytes_per_block   (at least one)

On an accelerator `share` is of the whole device, as vLLM's gpu_memory_utilization, so memory
other processes (and this one's CUDA context) use counts against it: 0.9 of an 80 GB card with
16 GB in use leaves 56 GB. On CPU, `available` is MemAvailable (RAM the kernel can hand out
without swapping, which already leaves out what is in use), and the pool's file lives in a
tmpfs that is often capped (64 MB in a default Docker container). The daemon's kv_fraction is
`share` alone; `LLM` subtracts the weights its runner is about to load, and more
(pagedkv.llm.pool_budget); the planner takes a device with nothing in use and a share of 1.

Torch-free: the measurement is pagedkv.memory.device_memory's.
"""

from dataclasses import dataclass

from pagedkv.vocab.units import format_bytes


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """A device's memory at one moment, in bytes."""

    # "cpu" picks the CPU rule; anything else ("cuda", "cuda:1", a planned device) the
    # accelerator's.
    device: str
    # Accelerator: the device's memory (unused on CPU).
    total: int
    # Accelerator: free now; CPU: MemAvailable.
    free: int
    # CPU: free space of the folder the pool file goes in (unused on an accelerator).
    shm_free: int = 0

    @property
    def on_cpu(self) -> bool:
        return self.device.partition(":")[0] == "cpu"


def kv_budget(memory: DeviceMemory, share: float, weights: int = 0, reserve: int = 0,
              cap: int | None = None) -> int:
    """Bytes for the pool by the rule above; ValueError, with the figures, when none are left."""
    if not 0 < share <= 1:
        raise ValueError(f"fraction must be in (0, 1], got {share}")
    if memory.on_cpu:
        budget = min(int(share * (memory.free - weights - reserve)), memory.shm_free)
        figures = (f"min({share} x (available RAM {format_bytes(memory.free)} - weights "
                   f"{format_bytes(weights)} - reserve {format_bytes(reserve)}), free shm "
                   f"{format_bytes(memory.shm_free)})")
    else:
        in_use = memory.total - memory.free
        budget = int(share * memory.total) - in_use - weights - reserve
        figures = (f"{share} x {format_bytes(memory.total)} - in use {format_bytes(in_use)} - "
                   f"weights {format_bytes(weights)} - reserve {format_bytes(reserve)}")
    if cap is not None:
        budget = min(budget, cap)
        figures = f"min({figures}, cap {format_bytes(cap)})"
    if budget <= 0:
        raise ValueError(f"no memory left for the KV cache on {memory.device}: {figures} = "
                         f"{format_bytes(budget)}")
    return budget


def num_blocks_for_bytes(budget: int, bytes_per_block: int) -> int:
    """Whole blocks in `budget` bytes; ValueError when not even one fits."""
    if bytes_per_block <= 0:
        raise ValueError(f"bytes_per_block must be positive, got {bytes_per_block}")
    if budget < bytes_per_block:
        raise ValueError(f"{format_bytes(budget)} cannot hold one block of "
                         f"{format_bytes(bytes_per_block)}")
    return budget // bytes_per_block
