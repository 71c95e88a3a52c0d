"""The two bandwidths a GPU benchmark's figures are compared against: the device's copy bandwidth,
measured in the same run, and its datasheet figure, looked up by device name.

    copy = copy_bandwidth(device)                                  # bytes/s, read + written
    sheet = datasheet_bandwidth(torch.cuda.get_device_name(device))  # bytes/s, or None

The copy bandwidth is what a kernel that only streams memory can reach here (about 85-90% of the
datasheet on HBM parts); the datasheet is the marketing peak. An unknown device has no datasheet
figure: the benchmarks say so instead of guessing.
"""

import torch

# The copy: bytes copied per pass, passes timed (after WARMUP untimed ones).
COPY_BYTES, COPIES, WARMUP = 1 << 30, 20, 3
# Memory bandwidth from NVIDIA's datasheets, TB/s, by what the device name contains: the first
# entry whose every part is in the name wins, so the variants come before the plain name.
DATASHEET_TBPS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H100", "PCIe"), 2.0),
    (("H100", "NVL"), 3.9),
    (("H100",), 3.35),  # SXM5 80 GB: "NVIDIA H100 80GB HBM3"
    (("H200",), 4.8),  # SXM and NVL, 141 GB HBM3e
    (("GH200",), 4.0),  # 96 GB HBM3
    (("H20",), 4.0),
    (("A100", "80GB", "PCIe"), 1.935),
    (("A100", "80GB"), 2.039),  # SXM4
    (("A100",), 1.555),  # 40 GB, SXM4 and PCIe
    (("L40S",), 0.864),
    (("L40",), 0.864),
    (("A10G",), 0.6),
    (("A10",), 0.6),
    (("L4",), 0.3),
)


def datasheet_bandwidth(device_name: str) -> float | None:
    """The datasheet memory bandwidth of `device_name` in bytes/s; None for an unknown device."""
    words = device_name.upper().replace("-", " ").split()
    for parts, tbps in DATASHEET_TBPS:
        if all(part.upper() in words for part in parts):
            return tbps * 1e12
    return None


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy bandwidth in bytes/s: bytes read + written over CUDA-event time."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(WARMUP):
        dst.copy_(src)
    # torch leaves Event's constructor unannotated.
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    start.record()
    for _ in range(COPIES):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = float(start.elapsed_time(end)) * 1e-3 / COPIES
    del src, dst
    torch.cuda.empty_cache()
    return 2 * COPY_BYTES / seconds
