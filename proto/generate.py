"""Regenerate the committed gRPC code from the .proto files, or check that it is up to date.

    python proto/generate.py          # rewrite proto/{kvpool,runner}_pb2*.py(i)
    python proto/generate.py --check  # exit 1 if the committed files differ from a fresh run

Uses the pinned grpcio-tools (`python -m grpc_tools.protoc`) and mypy-protobuf's plugins for the
`.pyi` stubs. protoc sees the file under the virtual path `pagedkv/proto/kvpool.proto`, so the
generated imports resolve inside the package (`from pagedkv.proto import kvpool_pb2`). Output
goes to a temporary directory first; only finished files are copied next to the .proto.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
PROTO_FILES = ("kvpool.proto", "runner.proto")
# The import path the package exposes the generated modules under.
VIRTUAL_DIR = "pagedkv/proto"
GENERATED = tuple(f"{Path(proto).stem}{suffix}" for proto in PROTO_FILES
                  for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", "_pb2_grpc.pyi"))


def _plugin(name: str) -> str:
    """Path of a protoc plugin installed next to this interpreter (the project's venv)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise SystemExit(f"{name} not found next to {sys.executable}: install mypy-protobuf")
    return str(path)


def generate(out_dir: Path) -> None:
    """Run protoc once, writing the generated files into out_dir/pagedkv/proto/."""
    command = [
        sys.executable, "-m", "grpc_tools.protoc",
        f"-I{VIRTUAL_DIR}={PROTO_DIR}",
        f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
        f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        f"--mypy_grpc_out={out_dir}",
        *(f"{VIRTUAL_DIR}/{proto}" for proto in PROTO_FILES),
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SystemExit(f"protoc failed ({result.returncode}):\n{result.stderr}")


def stale_files(fresh_dir: Path) -> list[str]:
    """Names of the committed generated files that differ from (or lack) a fresh output."""
    stale = []
    for name in GENERATED:
        committed = PROTO_DIR / name
        fresh = (fresh_dir / name).read_bytes()
        if not committed.exists() or committed.read_bytes() != fresh:
            stale.append(name)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if the committed generated files are out of date")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pagedkv-proto-") as tmp:
        generate(Path(tmp))
        fresh_dir = Path(tmp) / VIRTUAL_DIR
        stale = stale_files(fresh_dir)
        if args.check:
            if stale:
                print(f"generated files out of date: {', '.join(stale)}; "
                      "run `make proto` and commit the result", file=sys.stderr)
                return 1
            print("generated files up to date")
            return 0
        for name in GENERATED:
            shutil.copyfile(fresh_dir / name, PROTO_DIR / name)
        print(f"wrote {', '.join(GENERATED)} ({len(stale)} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
