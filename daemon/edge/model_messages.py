"""kvpool.proto's model messages <-> the service's models (RegisterModel, SetModelState,
ModelInfo in GetPoolInfo and GetStats).

Only runners may register a model or change its state (the runner socket: `trusted_caller`);
anyone else gets PERMISSION_DENIED before the request is looked at. A model's view of the pool
memory (ModelInfo.memory) goes to runners only, as PoolInfo.memory does.
"""

from pagedkv.daemon.service.errors import PermissionDenied
from pagedkv.daemon.service.models import KvShape, ModelFigures, checked_shape
from pagedkv.daemon.service.tenants import trusted_caller
from pagedkv.proto import kvpool_pb2 as pb


def check_runner(rpc: str) -> None:
    """PERMISSION_DENIED unless the caller came over the runner socket."""
    if not trusted_caller():
        raise PermissionDenied(f"{rpc} is for runners only: call it on the daemon's runner "
                               "socket (runner_socket)")


def register_shape(request: pb.RegisterModelRequest) -> KvShape:
    """The geometry a RegisterModel names, checked (INVALID_ARGUMENT naming the field)."""
    return checked_shape(request.num_layers, request.num_kv_heads, request.head_dim,
                         request.dtype)


def model_info(figures: ModelFigures, *, with_memory: bool) -> pb.ModelInfo:
    """One model's ModelInfo; its memory view `with_memory` (runners) when the pool has one."""
    model = figures.model
    fmt = model.format
    shape = fmt.shape
    info = pb.ModelInfo(
        name=model.name, num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, dtype=shape.dtype, bytes_per_block=fmt.bytes_per_block,
        blocks_per_page=fmt.blocks_per_page, num_blocks=fmt.pool.num_blocks,
        runner_target=model.runner_target, asleep=model.asleep,
        min_memory=model.policy.min_memory, max_memory=model.policy.max_memory,
        used_blocks=figures.used_blocks, cached_blocks=figures.cached_blocks,
        format_pages=figures.format_pages)
    if with_memory and fmt.memory is not None:
        handle = fmt.memory.handle()
        if handle.kind:
            info.memory.CopyFrom(handle.to_proto())
    return info
