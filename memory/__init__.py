"""pagedkv.memory: the pool memory's layout and handle, shared by the daemon and its runners.

`handle` is plain data and imports only the protobuf code; `attach` (torch) maps the memory a
handle describes: `attach_pool(PoolMemoryHandle.from_proto(info.memory))`; `dtypes` (torch) is
the one torch dtype from a dtype name, `device_memory` (torch) the one measurement of the
device's memory that pools are sized from.
"""

from pagedkv.memory.handle import BLOCK_DIM, POOL_LAYOUT, PoolMemoryHandle, pool_shape

__all__ = ["BLOCK_DIM", "POOL_LAYOUT", "PoolMemoryHandle", "pool_shape"]
