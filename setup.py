"""The C parts of pagedkv, built by `pip install` (and so by `make setup`) with the system's C
compiler; everything else is in pyproject.toml.

Each extension is plain C against Python's own API (no numpy or torch headers): it reads the
arrays it is given through the buffer protocol or as raw addresses its Python caller checked, so
it compiles in a second, with nothing but gcc and the Python headers, and does not depend on the
ABI of any installed package.
"""

from setuptools import Extension, setup

# -O3 for the loops' vectorization; no -march: the image runs on whatever x86-64 it lands on
# (a kernel that wants AVX2 asks for it per function, with a portable fallback).
COMPILE_ARGS = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Werror"]

setup(ext_modules=[
    # The block pool's per-row loops (daemon/core/): a decode step's append over every row.
    # One file per concept (daemon/core/_rows.h lists them); hidden visibility: the files share
    # helpers, and only PyInit__rows leaves the shared object.
    Extension("pagedkv.daemon.core._rows",
              [f"daemon/core/_rows_{part}.c"
               for part in ("arrays", "tables", "step", "commit", "keys", "sha256", "free",
                            "module")],
              depends=["daemon/core/_rows.h"],
              extra_compile_args=[*COMPILE_ARGS, "-fvisibility=hidden"]),
    # Paged attention and store_kv over the pool on the CPU (model_runner/kernels/): store_kv
    # and the module in _cpu_paged.c, decode and prefill in _cpu_paged_attention.c; hidden
    # visibility, as _rows.
    Extension("pagedkv.model_runner.kernels._cpu_paged",
              [f"model_runner/kernels/_cpu_paged{part}.c" for part in ("", "_attention")],
              depends=["model_runner/kernels/_cpu_paged.h"],
              extra_compile_args=[*COMPILE_ARGS, "-fvisibility=hidden"]),
])
