"""The pool device's memory now: `measure(device)`, the one measurement behind every pool size
(the daemon's kv_fraction and `LLM`'s sizing; pagedkv.vocab.pool_sizing does the arithmetic).

CUDA: the driver's free and total (creating this process's CUDA context, which is then counted
as in use). CPU: MemAvailable, and the free space of the folder the pool file goes in.
"""

import os

import torch

from pagedkv.vocab.pool_sizing import DeviceMemory


def pool_device(device: str) -> torch.device:
    """A cpu or cuda torch.device; ValueError for anything else."""
    try:
        target = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device must be cpu or cuda, got {device!r}") from exc
    if target.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    return target


def measure(device: str, shm_dir: str = "/dev/shm") -> DeviceMemory:
    """The memory of `device` ("cpu", "cuda" or "cuda:N") now; on CPU with the free space of
    `shm_dir`, where the daemon puts the pool file."""
    target = pool_device(device)
    if target.type == "cuda":
        free, total = torch.cuda.mem_get_info(target)
        return DeviceMemory(device, total=total, free=free)
    fs = os.statvfs(shm_dir)
    return DeviceMemory(device, total=0, free=available_ram(),
                        shm_free=fs.f_bavail * fs.f_frsize)


def available_ram() -> int:
    """MemAvailable from /proc/meminfo; free pages from sysconf where that file is missing."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file's "kB" are KiB
    except FileNotFoundError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
