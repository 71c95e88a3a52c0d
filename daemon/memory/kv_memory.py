"""The KV pool's memory: one tensor, allocated once at start, shared with co-located runners.

The tensor has the one layout of `pagedkv.memory.handle` ([num_blocks, num_layers, 2,
block_size, num_kv_heads, head_dim]); physical block `b` of every layer is `kv[b]`, one
contiguous slab, so copying or zeroing a block is one indexed op over BLOCK_DIM.

Two backings, chosen by the device:
- CPU: a file in /dev/shm (tmpfs) sized exactly and reserved up front with posix_fallocate, so
  a too-small /dev/shm fails at start instead of with SIGBUS later; mapped with
  `torch.from_file(shared=True)`. Whoever may open the file reads and writes every tenant's
  K/V: it is the daemon's user's alone (0o600), or its runner group's too (0o660), never
  every user's. Its name carries the owner's pid so that a restarted daemon
  can remove what a crashed one left (`cleanup_stale_files`).
- CUDA: a device tensor, plus a CUDA IPC handle (`reduce_tensor`) pickled once into bytes.
  The daemon keeps the tensor alive for as long as runners may be attached.

A runner in another process attaches with `pagedkv.memory.attach.attach_pool(handle)`. Sizes
are validated before anything is written: bad ids change nothing.
"""

from __future__ import annotations

import os
import pickle
import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import overload

import numpy as np
import numpy.typing as npt
import torch
from torch.multiprocessing.reductions import reduce_tensor

from pagedkv.daemon.memory.shm_holders import reserve_failure
from pagedkv.memory import BLOCK_DIM, PoolMemoryHandle, pool_shape
from pagedkv.memory.device_memory import pool_device
from pagedkv.memory.dtypes import torch_dtype
from pagedkv.vocab.geometry import ModelGeometry, canonical_dtype

# Block ids as the block pool hands them out: a list, or an int64 array on the batch path.
BlockIds = Sequence[int] | npt.NDArray[np.int64]


class KVPoolMemory:
    """Owns the pool tensor; create with `KVPoolMemory.create`, release with `close`."""

    def __init__(self, kv: torch.Tensor, handle: PoolMemoryHandle, pool_id: str) -> None:
        self._kv: torch.Tensor | None = kv
        self._handle = handle
        # Random id of this pool instance; also part of the shm file name.
        self.pool_id = pool_id

    @classmethod
    def create(cls, geometry: ModelGeometry, num_blocks: int, block_size: int,
               dtype: str | torch.dtype, device: str = "cpu", shm_dir: str = "/dev/shm",
               name_prefix: str = "pagedkv", mode: int = 0o600,
               group: int | None = None) -> KVPoolMemory:
        """Allocate a zeroed pool; `mode` is the shm file's (0o660 to share with `group`, the
        runners' gid: the file's group is the daemon's own without it)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} "
                             f"and {block_size}")
        if mode & ~0o777:
            raise ValueError(f"mode must be permission bits only, got {oct(mode)}")
        if mode & 0o007:  # any local user could read and write every tenant's K/V
            raise ValueError(f"mode {oct(mode)} gives every user access to the pool")
        name = canonical_dtype(str(dtype))
        shape = pool_shape(num_layers=geometry.num_layers, num_blocks=num_blocks,
                           block_size=block_size, num_kv_heads=geometry.num_kv_heads,
                           head_dim=geometry.head_dim)
        pool_id = secrets.token_hex(8)
        target = pool_device(device)
        if target.type == "cpu":
            path = Path(shm_dir) / f"{name_prefix}-{os.getpid()}-{pool_id}.kv"
            kv = _create_shm(path, shape, name, mode, group)
            return cls(kv, PoolMemoryHandle("shm", str(path), shape, name, -1, b""), pool_id)
        # Zeroed, not empty: the caching allocator may hand back another tensor's data.
        kv = torch.zeros(shape, dtype=torch_dtype(name), device=target)
        # torch leaves reduce_tensor unannotated; it returns (rebuild function, args).
        payload = pickle.dumps(reduce_tensor(kv))  # type: ignore[no-untyped-call]
        handle = PoolMemoryHandle("cuda_ipc", "", shape, name, kv.get_device(), payload)
        return cls(kv, handle, pool_id)

    @property
    def kv(self) -> torch.Tensor:
        """The pool tensor, in POOL_LAYOUT order."""
        if self._kv is None:
            raise ValueError(f"pool memory {self.pool_id} is closed")
        return self._kv

    @property
    def num_blocks(self) -> int:
        return self._handle.shape[BLOCK_DIM]

    @property
    def block_size(self) -> int:
        return self._handle.shape[3]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def handle(self) -> PoolMemoryHandle:
        return self._handle

    @overload
    def copy_blocks(self, pairs: Sequence[tuple[int, int]], /) -> None: ...
    @overload
    def copy_blocks(self, src: BlockIds, dst: BlockIds, /) -> None: ...

    def copy_blocks(self, src: BlockIds | Sequence[tuple[int, int]],
                    dst: BlockIds | None = None, /) -> None:
        """kv[dst[i]] = kv[src[i]] for all i, every layer, K and V, in one op.

        Takes (src, dst) pairs, e.g. `[(c.src, c.dst) for c in update.copies]`, or two id lists.
        All sources are gathered before any destination is written, so a destination that is
        also a source (a chain a -> b, b -> c) gets the source's data from before the call.
        Destinations must be distinct; ids must be in range. Nothing to copy is a no-op.
        """
        if dst is None:
            pairs = np.asarray(src)
            if pairs.size and (pairs.ndim != 2 or pairs.shape[1] != 2):
                raise ValueError(f"expected (src, dst) pairs, got {pairs.tolist()}")
            pairs = pairs.reshape(-1, 2)
            src_ids, dst_ids = self._block_index(pairs[:, 0]), self._block_index(pairs[:, 1])
        else:
            src_ids, dst_ids = self._block_index(src), self._block_index(dst)
        if src_ids.numel() != dst_ids.numel():
            raise ValueError(f"{src_ids.numel()} sources but {dst_ids.numel()} destinations")
        if len(set(dst_ids.tolist())) != dst_ids.numel():
            raise ValueError("a block is the destination of more than one copy")
        if src_ids.numel():
            kv = self.kv
            kv.index_copy_(BLOCK_DIM, dst_ids.to(kv.device),
                           kv.index_select(BLOCK_DIM, src_ids.to(kv.device)))

    def zero_blocks(self, ids: BlockIds) -> None:
        """Fill the given blocks with zeros in every layer, K and V."""
        index = self._block_index(ids)
        if index.numel():
            self.kv.index_fill_(BLOCK_DIM, index.to(self.kv.device), 0)

    def synchronize(self) -> None:
        """Wait until every copy and zeroing issued so far is complete in memory. On CUDA they
        are asynchronous kernels; once the device is synchronized, a runner in another process
        that reads the blocks sees their new data. CPU work is complete when its call returns."""
        if self.kv.is_cuda:
            torch.cuda.synchronize(self.kv.device)

    def _block_index(self, ids: npt.ArrayLike) -> torch.Tensor:
        """Ids as a 1-D int64 CPU tensor, checked against the pool before any write."""
        array = np.asarray(ids)
        if array.size and (array.ndim != 1 or not np.issubdtype(array.dtype, np.integer)):
            raise ValueError(f"expected a list of integer block ids, got {array.tolist()}")
        index = torch.from_numpy(array.astype(np.int64).reshape(-1))
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.num_blocks):
            raise ValueError(f"block ids must be in [0, {self.num_blocks}), got {index.tolist()}")
        return index

    def close(self) -> None:
        """Drop the tensor and unlink the shm file; idempotent.

        The memory itself is freed once no process maps it any more (attached runners keep
        their mapping); CUDA memory returns to torch's caching allocator.
        """
        self._kv = None
        if self._handle.shm_path:
            Path(self._handle.shm_path).unlink(missing_ok=True)

    def __enter__(self) -> KVPoolMemory:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _create_shm(path: Path, shape: tuple[int, ...], dtype: str, mode: int,
                group: int | None) -> torch.Tensor:
    """Create the shm file exclusively (the owner's alone until it has its group), reserve its
    pages, and map it."""
    numel = int(np.prod(shape))
    nbytes = numel * torch_dtype(dtype).itemsize
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    if group is not None:
        try:
            os.fchown(fd, -1, group)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise PermissionError(exc.errno, f"cannot give the pool file {path} to group "
                                             f"{group} (runner_group): {exc.strerror}; the "
                                             "daemon's user must be a member") from exc
    try:
        os.fchmod(fd, mode)  # the umask may have cleared bits that `mode` asks for
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        path.unlink(missing_ok=True)
        raise OSError(exc.errno, reserve_failure(path, nbytes, exc)) from exc
    finally:
        os.close(fd)
    return torch.from_file(str(path), shared=True, size=numel, dtype=torch_dtype(dtype)).view(shape)


def cleanup_stale_files(shm_dir: str = "/dev/shm", name_prefix: str = "pagedkv") -> list[Path]:
    """Remove pool files whose owner pid is dead (left by a crash); returns what was removed.

    A dead daemon's pid reused by an unrelated process keeps its file until a later cleanup:
    a leak at worst, whereas a live daemon's pool is never deleted.
    """
    pattern = re.compile(rf"{re.escape(name_prefix)}-(\d+)-[0-9a-f]+\.kv")
    removed = []
    for path in Path(shm_dir).iterdir():
        match = pattern.fullmatch(path.name)
        if match and not _pid_alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    return True

