"""pagedkv.memory: the handle's wire form, and attaching to the pool from a real second process.

The daemon side (creating the memory, copies, zeroing, cleanup) is in
tests/daemon/memory/test_kv_memory.py.
"""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv.daemon.memory.kv_memory import KVPoolMemory
from pagedkv.memory import POOL_LAYOUT, PoolMemoryHandle, pool_shape
from pagedkv.memory.attach import attach_pool
from pagedkv.proto import kvpool_pb2 as pb
from pagedkv.vocab.geometry import ModelGeometry

# 3 layers, 2 KV heads, head_dim 4: small, yet every dim of the layout has a distinct size.
GEOMETRY = ModelGeometry("test", num_layers=3, num_kv_heads=2, head_dim=4, num_params=None,
                         default_dtype="float32")
NUM_BLOCKS, BLOCK_SIZE = 6, 5

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_layout_names_the_shape() -> None:
    shape = pool_shape(num_layers=3, num_blocks=6, block_size=5, num_kv_heads=2, head_dim=4)
    assert dict(zip(POOL_LAYOUT.split(","), shape, strict=True)) == {
        "num_layers": 3, "2": 2, "num_blocks": 6, "block_size": 5, "num_kv_heads": 2,
        "head_dim": 4}


def test_handle_survives_its_wire_form() -> None:
    handle = PoolMemoryHandle("cuda_ipc", "", (3, 2, 6, 5, 2, 4), "bfloat16", 1, b"\x80\x05x")
    wire = handle.to_proto().SerializeToString()
    assert PoolMemoryHandle.from_proto(pb.PoolMemory.FromString(wire)) == handle
    # A bookkeeping-only daemon sends no memory: an empty message, kind "".
    assert PoolMemoryHandle.from_proto(pb.PoolMemory()) == PoolMemoryHandle("", "", (), "", 0,
                                                                            b"")


def test_handle_imports_without_torch_and_the_runner_without_the_daemon() -> None:
    code = ("import sys; import pagedkv.memory; assert 'torch' not in sys.modules; "
            "import pagedkv.model_runner.runner; "
            "print(sorted(m for m in sys.modules if m.startswith('pagedkv.daemon')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


# Run in a second Python process: attach from the handle's wire form on stdin, check the
# creator's write (7s in block 1), then write 5s into the V half of block 2 for the creator.
CHILD = """
import sys, torch
from pagedkv.memory import PoolMemoryHandle
from pagedkv.memory.attach import attach_pool
from pagedkv.proto import kvpool_pb2 as pb
kv = attach_pool(PoolMemoryHandle.from_proto(pb.PoolMemory.FromString(sys.stdin.buffer.read())))
assert bool((kv[1] == 7).all()), "the creator's write is not visible"
assert not kv[2].any(), "block 2 should still be zero"
kv[2, :, 1] = 5
if kv.is_cuda:
    torch.cuda.synchronize()
print(tuple(kv.shape), kv.dtype, kv.device.type)
"""


def check_shared_with_another_process(memory: KVPoolMemory) -> None:
    memory.kv[1] = 7
    if memory.kv.is_cuda:
        torch.cuda.synchronize()
    wire = memory.handle().to_proto().SerializeToString()
    child = subprocess.run([sys.executable, "-c", CHILD], input=wire, capture_output=True,
                           timeout=120)
    assert child.returncode == 0, child.stderr.decode()
    assert child.stdout.decode().split("\n")[0] == (
        f"{tuple(memory.kv.shape)} {memory.kv.dtype} {memory.kv.device.type}")
    assert bool((memory.kv[2, :, 1] == 5).all()), "the second process's write is not visible"
    assert not memory.kv[2, :, 0].any(), "the K half of block 2 was not written"
    assert not memory.kv[3:].any()


def test_second_process_attaches_shm() -> None:
    with KVPoolMemory.create(GEOMETRY, NUM_BLOCKS, BLOCK_SIZE, "bfloat16") as memory:
        check_shared_with_another_process(memory)


@pytest.mark.gpu
@cuda_only
def test_second_process_attaches_cuda_ipc() -> None:
    with KVPoolMemory.create(GEOMETRY, NUM_BLOCKS, BLOCK_SIZE, "bfloat16",
                             device="cuda") as memory:
        handle = memory.handle()
        assert (handle.kind, handle.shm_path, handle.device_index) == ("cuda_ipc", "", 0)
        assert memory.kv.is_cuda and not memory.kv.any()
        check_shared_with_another_process(memory)


def test_attach_refuses_a_missing_or_resized_file_and_no_memory(tmp_path: Path) -> None:
    with KVPoolMemory.create(GEOMETRY, NUM_BLOCKS, BLOCK_SIZE, "float32",
                             shm_dir=str(tmp_path)) as memory:
        handle = memory.handle()
    missing = tmp_path / "pagedkv-1-00.kv"
    with pytest.raises(ValueError, match="no pool file at"):
        attach_pool(PoolMemoryHandle("shm", str(missing), handle.shape, "float32", -1, b""))
    assert not missing.exists(), "attach must not create a pool file"
    missing.write_bytes(b"\0" * 100)
    with pytest.raises(ValueError, match="holds 100 bytes, handle says 5760"):
        attach_pool(PoolMemoryHandle("shm", str(missing), handle.shape, "float32", -1, b""))
    with pytest.raises(ValueError, match="unknown dtype 'Tensor'"):
        attach_pool(PoolMemoryHandle("shm", str(missing), handle.shape, "Tensor", -1, b""))
    with pytest.raises(ValueError, match="unknown pool memory kind"):
        attach_pool(PoolMemoryHandle("tcp", "", handle.shape, "float32", -1, b""))
    with pytest.raises(ValueError, match=r"no pool memory \(bookkeeping only\)"):
        attach_pool(PoolMemoryHandle.from_proto(pb.PoolMemory()))


def test_ipc_payload_may_only_name_torch(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payload = pickle.dumps((os.system, (f"touch {marker}",)))
    with pytest.raises(pickle.UnpicklingError, match=r"posix\.system, not torch"):
        attach_pool(PoolMemoryHandle("cuda_ipc", "", (1,), "float32", 0, payload))
    assert not marker.exists()
    wrong_shape = pickle.dumps((torch.Tensor, ([1.0, 2.0, 3.0],)))
    with pytest.raises(ValueError, match=r"IPC payload is \(3,\) torch.float32, handle says"):
        attach_pool(PoolMemoryHandle("cuda_ipc", "", (2,), "float32", 0, wrong_shape))
    not_a_tensor = pickle.dumps((torch.device, ("cpu",)))
    with pytest.raises(ValueError, match="rebuilt a device, not a tensor"):
        attach_pool(PoolMemoryHandle("cuda_ipc", "", (2,), "float32", 0, not_a_tensor))


def test_an_ipc_payload_is_the_arena_viewed_in_the_handles_format() -> None:
    """A CUDA handle carries the arena's uint8 allocation; attach views its bytes in the
    handle's shape and dtype (a CPU tensor stands in for the rebuilt allocation here)."""
    arena = pickle.dumps((torch.ByteTensor, (list(range(8)),)))
    view = attach_pool(PoolMemoryHandle("cuda_ipc", "", (2, 2), "float16", 0, arena))
    assert view.shape == (2, 2) and view.dtype == torch.float16
    assert view.flatten().view(torch.uint8).tolist() == list(range(8))
    with pytest.raises(ValueError, match=r"IPC payload is \(8,\) torch.uint8, handle says 16"):
        attach_pool(PoolMemoryHandle("cuda_ipc", "", (2, 2), "float32", 0, arena))


def test_a_cuda_vmm_pool_needs_the_daemons_unix_runner_socket() -> None:
    handle = PoolMemoryHandle("cuda_vmm", "", (1,), "float32", 0, b"", "5eed")
    with pytest.raises(ValueError, match="'' is not a unix socket"):
        attach_pool(handle)
    with pytest.raises(ValueError, match="'localhost:50051' is not a unix socket"):
        attach_pool(handle, "localhost:50051")
