"""The pool tensor's layout, and the handle another process attaches to it with.

Layout (every kernel, runner and test uses exactly this one), block-major:

    kv: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

Block `b` is `kv[b]`: its K/V of every layer is one contiguous slab of bytes_per_block, so
copying or zeroing a block is one indexed op over dim 0, and a model's view of the pool is a
reinterpretation of the same bytes whatever its geometry (a page of the pool is a run of whole
blocks of every format: kvpool.proto, "Models and pages"). `kv[:, layer, 0]` holds one layer's
keys and `kv[:, layer, 1]` its values, each a strided [num_blocks, block_size, num_kv_heads,
head_dim] view; inside a block the token slot comes first and each slot holds its heads' vectors
("NHD"); slot `b * block_size + offset` of the block pool addresses `kv[b, layer, k_or_v,
offset]`.

The daemon creates the memory and its handle (`daemon/memory/kv_memory.py`) and sends the handle
in GetPoolInfo as a `PoolMemory` message (`to_proto`); a runner turns the message back into a
handle (`from_proto`) and maps it (`pagedkv.memory.attach`). No torch here: the daemon's
bookkeeping, the client and the planner may import this module without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.proto import kvpool_pb2 as pb

# The axes of the pool tensor, as PoolInfo.layout names them.
POOL_LAYOUT = "num_blocks,num_layers,2,block_size,num_kv_heads,head_dim"
# Dim of the pool tensor that indexes physical blocks.
BLOCK_DIM = 0


def pool_shape(*, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
               head_dim: int) -> tuple[int, ...]:
    """The pool tensor's shape, in POOL_LAYOUT order."""
    return (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)


@dataclass(frozen=True, slots=True)
class PoolMemoryHandle:
    """What a co-located process needs to attach to the pool memory; plain data only."""

    # "shm" (a /dev/shm file), "cuda_ipc" (a CUDA IPC handle), "cuda_vmm" (a CUDA VMM
    # allocation whose descriptor comes over the daemon's memory socket), or "" when the daemon
    # keeps bookkeeping only and has no memory to attach to.
    kind: str
    # The shm file's path; "" for CUDA.
    shm_path: str
    # The tensor's shape, in POOL_LAYOUT order.
    shape: tuple[int, ...]
    # Canonical dtype name ("float16", "bfloat16", "float32").
    dtype: str
    # CUDA device index; -1 for CPU.
    device_index: int
    # Pickled (rebuild function, args) from torch's reduce_tensor; b"" for shm.
    ipc_payload: bytes
    # The identity of the "cuda_vmm" descriptor the memory socket sends; "" for other kinds.
    memory_id: str = ""

    @classmethod
    def from_proto(cls, message: pb.PoolMemory) -> PoolMemoryHandle:
        return cls(message.kind, message.shm_path, tuple(message.shape), message.dtype,
                   message.device_index, message.ipc_payload, message.memory_id)

    def to_proto(self) -> pb.PoolMemory:
        return pb.PoolMemory(kind=self.kind, shm_path=self.shm_path, shape=self.shape,
                             dtype=self.dtype, device_index=self.device_index,
                             ipc_payload=self.ipc_payload, memory_id=self.memory_id)
