"""Map the daemon's pool memory into this process: `attach_pool(handle)` -> the pool tensor in
the handle's shape and dtype: one model format's view of the arena (a runner maps its own).

Every view spans the whole arena, so both backings map all of it and reinterpret it: CPU pools
are a /dev/shm file mapped with `torch.from_file(shared=True)`; CUDA pools come as the arena's
pickled CUDA IPC handle (a uint8 tensor), unpickled with nothing but torch's own globals
allowed, or ("cuda_vmm", kept across daemon restarts) as a VMM allocation whose descriptor the
daemon's memory socket hands over (memory/memory_socket.py) and the runner imports. Each is
checked against the handle's shape and dtype before the tensor is returned.
"""

import io
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedkv.memory.cuda_vmm import VmmArena
from pagedkv.memory.dtypes import torch_dtype
from pagedkv.memory.handle import PoolMemoryHandle
from pagedkv.memory.memory_socket import receive_memory_fd, runner_socket_of


class _TorchOnlyUnpickler(pickle.Unpickler):
    """Unpickles an IPC payload, refusing any global outside torch (no os.system gadgets)."""

    def find_class(self, module: str, name: str) -> Any:
        if module != "torch" and not module.startswith("torch."):
            raise pickle.UnpicklingError(f"IPC payload refers to {module}.{name}, not torch")
        return super().find_class(module, name)


def attach_pool(handle: PoolMemoryHandle, daemon_target: str = "") -> torch.Tensor:
    """A tensor over the pool memory of `handle`, in another process than its creator.
    `daemon_target`: the daemon's runner socket this process connected to ("unix://..."),
    beside which a "cuda_vmm" pool's descriptor is handed over (required for that kind)."""
    if handle.kind == "shm":
        return _attach_shm(handle)
    if handle.kind == "cuda_ipc":
        return _attach_cuda_ipc(handle)
    if handle.kind == "cuda_vmm":
        return _attach_cuda_vmm(handle, daemon_target)
    if not handle.kind:
        raise ValueError("the daemon has no pool memory (bookkeeping only)")
    raise ValueError(f"unknown pool memory kind {handle.kind!r}")


def _attach_shm(handle: PoolMemoryHandle) -> torch.Tensor:
    """Map the /dev/shm file, once its size matches the handle's shape and dtype."""
    dtype = torch_dtype(handle.dtype)
    numel = int(np.prod(handle.shape))
    path = Path(handle.shm_path)
    # Checked first: from_file(shared=True) would silently create a missing file.
    if not path.is_file():
        raise ValueError(f"no pool file at {path}")
    size = path.stat().st_size
    if size != numel * dtype.itemsize:
        raise ValueError(f"pool file {path} holds {size} bytes, handle says "
                         f"{numel * dtype.itemsize}")
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype).view(handle.shape)


def _attach_cuda_ipc(handle: PoolMemoryHandle) -> torch.Tensor:
    """Open the arena from its IPC payload, allowing only torch's own globals, and view its bytes
    in the handle's shape and dtype."""
    dtype = torch_dtype(handle.dtype)
    rebuild, args = _TorchOnlyUnpickler(io.BytesIO(handle.ipc_payload)).load()
    arena = rebuild(*args)
    if not isinstance(arena, torch.Tensor):
        raise ValueError(f"IPC payload rebuilt a {type(arena).__name__}, not a tensor")
    nbytes = int(np.prod(handle.shape)) * dtype.itemsize
    if arena.dtype != torch.uint8 or arena.dim() != 1 or arena.numel() != nbytes:
        raise ValueError(f"IPC payload is {tuple(arena.shape)} {arena.dtype}, handle says "
                         f"{nbytes} bytes as {handle.shape} {dtype}")
    return arena.view(dtype).view(handle.shape)



def _attach_cuda_vmm(handle: PoolMemoryHandle, daemon_target: str) -> torch.Tensor:
    """Take the allocation's descriptor from the daemon's memory socket, import and map it,
    and view its bytes in the handle's shape and dtype. The mapping is released once no view
    of it is left; the descriptor is closed once imported (the runner's pool keeper takes its
    own from the daemon when it keeps one)."""
    runner_socket = runner_socket_of(daemon_target)
    dtype = torch_dtype(handle.dtype)
    nbytes = int(np.prod(handle.shape)) * dtype.itemsize
    fd = receive_memory_fd(runner_socket, handle.memory_id)
    try:
        arena = VmmArena.import_fd(fd, nbytes, handle.device_index)
    finally:
        os.close(fd)
    return arena.owned_tensor().view(dtype).view(handle.shape)
