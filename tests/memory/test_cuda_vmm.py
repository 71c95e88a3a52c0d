"""CUDA VMM memory outlives the process that created it: exported as a POSIX descriptor, the
allocation lives while the descriptor does, and another process maps the same bytes."""

import os
import subprocess
import sys

import pytest
import torch

from pagedkv.memory.cuda_vmm import VmmArena

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
NBYTES = 3 * 1024 * 1024 + 17  # not a multiple of the granularity: rounded up inside

# Run in a fresh process: import the descriptor argv[1], check the pattern, write its answer.
_CHILD = """
import sys
import torch
from pagedkv.memory.cuda_vmm import VmmArena
arena = VmmArena.import_fd(int(sys.argv[1]), int(sys.argv[2]), 0)
memory = arena.tensor()
expected = torch.arange(memory.numel(), device="cuda", dtype=torch.int64).remainder(251)
assert torch.equal(memory.to(torch.int64), expected), "the bytes differ"
memory[:4] = torch.tensor([7, 7, 7, 7], dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
arena.close()
"""


@pytest.mark.gpu
@cuda_only
def test_the_memory_lives_on_its_descriptor_and_maps_in_another_process() -> None:
    arena = VmmArena.create(NBYTES, 0)
    memory = arena.tensor()
    assert memory.shape == (NBYTES,) and memory.is_cuda
    memory.copy_(torch.arange(NBYTES, device="cuda").remainder(251).to(torch.uint8))
    torch.cuda.synchronize()
    fd = arena.export_fd()
    del memory
    arena.close()  # only the descriptor holds the allocation now
    try:
        subprocess.run([sys.executable, "-c", _CHILD, str(fd), str(NBYTES)], pass_fds=[fd],
                       check=True, timeout=120)
        again = VmmArena.import_fd(fd, NBYTES, 0)
    finally:
        os.close(fd)
    assert again.tensor()[:5].tolist() == [7, 7, 7, 7, 4]  # the other process's write
    again.close()
