"""The README's commands run as written, top to bottom: its ```sh and ```python blocks, in their
order, as one shell session in a fresh folder (the repository's .venv linked in), the Python
blocks through `.venv/bin/python`.

Two things differ from a reader's terminal, both named here: the fixed ports (8000 for the
server, 9464 for the daemon's metrics) become free ones, so parallel tests never collide; and
the blocks that are only `make` lines (`make demo` / `make test`, `make bench`) are left out:
they are CI itself and the benchmarks, run elsewhere. Whatever the session started in the
background is stopped at its end, and the test fails if any command fails (`set -e`).
"""

import re
import subprocess
import sys
from pathlib import Path

from pagedkv.process.launch import free_tcp_port

from pagedkvd_process import short_tmp_dir

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```(sh|python)\n(.*?)```", README.read_text(), flags=re.DOTALL)
# The README's fixed ports, each replaced by a free one.
PORTS = ("8000", "9464")
# Ends the here-document of a Python block (a line no block holds).
PYTHON_END = "README_PYTHON_END"


def is_make_only(block: str) -> bool:
    """A block whose every command is `make ...` (comments and continuations aside)."""
    commands = [line for line in block.splitlines() if line.strip() and not line.startswith(" ")]
    return bool(commands) and all(line.startswith("make ") for line in commands)


def session_script(blocks: list[tuple[str, str]]) -> str:
    """One bash script: each block in order, a marker line before each."""
    lines = ["set -eo pipefail", "trap 'kill $(jobs -p) 2>/dev/null; wait' EXIT"]
    for index, (kind, block) in enumerate(blocks):
        # On a line of its own even after output with no final newline (curl's).
        lines.append(f"printf '\\n### block {index} ({kind})\\n'")
        if kind == "python":
            assert PYTHON_END not in block
            lines.append(f".venv/bin/python - <<'{PYTHON_END}'\n{block}{PYTHON_END}")
        else:
            lines.append(block)
    return "\n".join(lines) + "\n"


def test_the_readme_has_commands_and_examples() -> None:
    kinds = [kind for kind, block in BLOCKS if not is_make_only(block)]
    assert kinds.count("sh") >= 4 and kinds.count("python") >= 4
    assert all(port in README.read_text() for port in PORTS)


def test_the_readme_runs_top_to_bottom() -> None:
    blocks = [(kind, block) for kind, block in BLOCKS if not is_make_only(block)]
    script = session_script(blocks)
    for port in PORTS:
        script = script.replace(port, str(free_tcp_port()))
    with short_tmp_dir() as folder:
        (folder / ".venv").symlink_to(Path(sys.prefix))
        done = subprocess.run(["bash", "-c", script], cwd=folder, capture_output=True,
                              text=True, timeout=480)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    # Every block ran, and every Python example printed something after its marker.
    outputs = re.split(r"^### block \d+ \(\w+\)\n", done.stdout, flags=re.MULTILINE)[1:]
    assert len(outputs) == len(blocks), done.stdout[-4000:]
    for (kind, block), output in zip(blocks, outputs, strict=True):
        if kind == "python":
            assert output.strip(), f"this example printed nothing:\n{block}"
