"""The direction of dependencies, read from every import line of the source folders.

The house has rooms (docs/ARCHITECTURE.md, "Folders"): the shared vocabulary at the bottom, then
the pool memory and the process plumbing, the daemon's core, memory, service, gRPC edge and
process, and the contiguous baseline it is measured against, which only the daemon's process
builds; the typed clients, then the scheduler engine; the runner's kernels, model, engine and
process; the offline `LLM`, the demo and the `pagedkv` command on top. A room may import only
itself and the rooms this table allows, so a change to a room below never needs one above, and
nothing below reaches up. Imports inside functions count; relative imports are refused (an
absolute name is what this test, and a newcomer, can read).
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE_FOLDERS = ("vocab", "proto", "memory", "process", "daemon", "client", "model_runner",
                  "llm", "server", "demo", "cli")

# What each room may import of pagedkv besides itself (rooms are module-name prefixes; the
# longest prefix that names a module is its room).
BASE = {"vocab", "proto"}
DAEMON_CORE = BASE | {"daemon.core"}
DAEMON_MEMORY = DAEMON_CORE | {"memory", "process", "daemon.memory"}
DAEMON_EVENTS = DAEMON_MEMORY | {"daemon.events"}
DAEMON_SERVICE = DAEMON_EVENTS | {"daemon.service"}
DAEMON_EDGE = DAEMON_SERVICE | {"daemon.edge"}
# The contiguous baseline (demo/contiguous) sits on the core, beside the demo that plots it; the
# daemon's process is the one room above it that may build it (`pagedkvd --allocator contiguous`).
BASELINE = DAEMON_CORE | {"demo.contiguous"}
DAEMON_PROCESS = DAEMON_EDGE | {"daemon.process", "demo.contiguous"}
CLIENT_POOL = BASE | {"client.pool"}
CLIENT_ENGINE = CLIENT_POOL | {"client.engine"}
RUNNER_KERNELS = BASE | {"memory", "model_runner.kernels"}
RUNNER_MODEL = RUNNER_KERNELS | {"process", "client", "client.pool", "client.engine",
                                 "model_runner.runner", "model_runner.models",
                                 "model_runner.decode_graphs"}
RUNNER_ENGINE = RUNNER_MODEL | {"model_runner.engine"}
RUNNER_PROCESS = RUNNER_ENGINE | {"model_runner.process", "model_runner"}
EVERYTHING_BELOW_THE_TOP = RUNNER_PROCESS | DAEMON_PROCESS | CLIENT_ENGINE | {
    "daemon", "client", "llm"}
ALLOWED: dict[str, set[str]] = {
    "vocab": set(),
    "proto": {"proto"},
    "memory": BASE | {"memory"},
    "process": BASE | {"process"},
    "daemon": DAEMON_PROCESS | {"daemon"},
    "daemon.core": DAEMON_CORE,
    "demo.contiguous": BASELINE,
    "daemon.memory": DAEMON_MEMORY,
    "daemon.events": DAEMON_EVENTS,
    "daemon.service": DAEMON_SERVICE,
    "daemon.edge": DAEMON_EDGE,
    "daemon.process": DAEMON_PROCESS,
    "daemon.__main__": DAEMON_PROCESS,
    "client": CLIENT_ENGINE | {"client"},
    "client.pool": CLIENT_POOL,
    "client.engine": CLIENT_ENGINE,
    "model_runner": RUNNER_PROCESS,
    "model_runner.kernels": RUNNER_KERNELS,
    "model_runner.runner": RUNNER_MODEL,
    "model_runner.models": RUNNER_MODEL,
    "model_runner.decode_graphs": RUNNER_MODEL,
    "model_runner.engine": RUNNER_ENGINE,
    "model_runner.process": RUNNER_PROCESS,
    "llm": EVERYTHING_BELOW_THE_TOP,
    "demo": EVERYTHING_BELOW_THE_TOP | {"demo"},
    "server": EVERYTHING_BELOW_THE_TOP | {"server"},
    "cli": EVERYTHING_BELOW_THE_TOP | {"server", "cli"},
}
# The vocabulary is imported by every process, the client's included: no heavy dependencies.
VOCAB_FORBIDDEN_THIRD_PARTY = {"torch", "numpy", "grpc", "transformers", "triton", "google"}


def module_name(path: Path) -> str:
    """tests' view of setuptools' mapping: folder X is pagedkv.X."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def room_of(module: str) -> str:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in ALLOWED:
            return ".".join(parts[:n])
    raise AssertionError(f"{module} is in no room of ALLOWED: add its folder to the table")


def imports_of(source: str, label: str) -> list[tuple[int, str]]:
    """(line, module) for every import in the file, nested ones included."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, label)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{label}:{node.lineno}: relative import; write pagedkv.X"
            assert node.module is not None
            # `from pagedkv.x import y` may name a submodule y: count it as one.
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def source_files() -> list[Path]:
    files = [p for folder in SOURCE_FOLDERS if (ROOT / folder).is_dir()
             for p in sorted((ROOT / folder).rglob("*.py"))]
    return [p for p in files if "_pb2" not in p.name and p.name != "generate.py"]


def violations(source: str, module: str, label: str) -> list[str]:
    room = room_of(module)
    allowed = ALLOWED[room] | {room}
    found = []
    for line, name in imports_of(source, label):
        top = name.split(".")[0]
        if room == "vocab" and top in VOCAB_FORBIDDEN_THIRD_PARTY:
            found.append(f"{label}:{line}: vocab imports {top}")
        if top != "pagedkv":
            continue
        target = name.removeprefix("pagedkv.")
        try:
            target_room = room_of(target)
        except AssertionError:
            target_room = target.split(".")[0]  # a name imported from a package's __init__
        if target_room not in allowed:
            found.append(f"{label}:{line}: {room} imports {target}")
    return found


def test_every_source_file_is_in_a_room() -> None:
    files = source_files()
    assert len(files) > 100
    for path in files:
        room_of(module_name(path))


@pytest.mark.parametrize("folder", SOURCE_FOLDERS)
def test_imports_point_down(folder: str) -> None:
    found = [v for p in source_files() if p.relative_to(ROOT).parts[0] == folder
             for v in violations(p.read_text(), module_name(p), str(p.relative_to(ROOT)))]
    assert not found, "imports against the layering:\n" + "\n".join(found)


def test_the_rule_catches_upward_and_heavy_imports() -> None:
    """The check itself can fail: a client module importing the daemon, the vocabulary
    importing torch, and anything importing the demo are reported."""
    upward = "import os\n\ndef f():\n    from pagedkv.daemon.core.block_pool import BlockPool\n"
    assert violations(upward, "client.pool.probe", "probe.py") == [
        "probe.py:4: client.pool imports daemon.core.block_pool.BlockPool"]
    assert violations("import torch\n", "vocab.probe", "probe.py") == [
        "probe.py:1: vocab imports torch"]
    assert violations("from pagedkv.demo import runs\n", "llm.probe", "probe.py") == [
        "probe.py:1: llm imports demo.runs"]
    assert violations("from pagedkv.client import PoolClient\n", "daemon.edge.probe", "p") == [
        "p:1: daemon.edge imports client.PoolClient"]
    assert violations("from pagedkv.demo.contiguous import CANNOT\n", "daemon.service.p", "p") == [
        "p:1: daemon.service imports demo.contiguous.CANNOT"]
