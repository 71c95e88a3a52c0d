"""The locks in requirements/ agree with pyproject.toml, and the venv is exactly its lock.

`make setup` installs one lock (requirements/cpu.txt or cuda.txt, chosen by TORCH_BACKEND) with
`--require-hashes --no-deps`, so what a fresh machine installs is what CI tested; the Dockerfile
installs requirements/image.txt (the runtime alone, CUDA build) the same way. These tests fail
when someone edits pyproject.toml's dependencies without `make lock`, when a lock names a package
without an exact version and a hash, and when the venv running them holds anything else.
"""

import importlib.metadata
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
LOCKS = {name: ROOT / "requirements" / f"{name}.txt" for name in ("cpu", "cuda", "image")}
# The extras each lock holds (besides the project's own dependencies).
EXTRAS = {"cpu": ("runtime", "test", "bench"), "cuda": ("runtime", "test", "bench"),
          "image": ("runtime",)}
# pip-compile's annotation of a package that pyproject.toml asks for by name.
FROM_PYPROJECT = "pagedkv (pyproject.toml)"


@dataclass
class Pin:
    """One package of a lock."""

    version: str
    hashes: list[str] = field(default_factory=list)
    # What asks for it, as pip-compile annotates it (`# via ...`).
    via: list[str] = field(default_factory=list)


def read_lock(path: Path) -> dict[str, Pin]:
    """The pins of a pip-compile lock, by canonical name; fails on a line it cannot read."""
    pins: dict[str, Pin] = {}
    current: Pin | None = None
    for line in path.read_text().splitlines():
        text = line.strip()
        if match := re.fullmatch(r"([A-Za-z0-9._-]+)==(\S+)( \\)?", text):
            current = pins.setdefault(canonicalize_name(match[1]), Pin(match[2]))
        elif match := re.fullmatch(r"--hash=sha256:([0-9a-f]{64})( \\)?", text):
            assert current is not None, f"{path.name}: a hash before any pin"
            current.hashes.append(match[1])
        elif match := re.fullmatch(r"#\s+(?:via\s+)?(.+)", text):
            # `# via X` on one line, or `# via` then `#   X` one per line.
            if current is not None and match[1] != "via":
                current.via.append(match[1].removeprefix("-r "))
        else:
            assert not text or text.startswith("#"), f"{path.name}: not a pin: {line!r}"
    return pins


def pyproject_requirements(extras: tuple[str, ...]) -> list[Requirement]:
    """The requirements pyproject.toml states: its dependencies and those of `extras`."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    texts = list(project["dependencies"])
    for extra in extras:
        texts += project["optional-dependencies"][extra]
    return [Requirement(text) for text in texts]


def test_the_full_locks_hold_every_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert set(EXTRAS["cpu"]) == set(EXTRAS["cuda"]) == set(project["optional-dependencies"])


@pytest.mark.parametrize("backend", list(LOCKS))
def test_every_pin_is_exact_and_hashed(backend: str) -> None:
    pins = read_lock(LOCKS[backend])
    assert len(pins) > 50
    unhashed = sorted(name for name, pin in pins.items() if not pin.hashes)
    assert not unhashed, f"{backend} lock: no hash for {unhashed}"


@pytest.mark.parametrize("backend", list(LOCKS))
def test_the_lock_satisfies_pyproject_and_asks_for_nothing_it_dropped(backend: str) -> None:
    """Each requirement of pyproject.toml is pinned at a version its range admits, and the
    packages the lock says pyproject.toml asks for are exactly those it asks for."""
    pins = read_lock(LOCKS[backend])
    wanted = pyproject_requirements(EXTRAS[backend])
    for requirement in wanted:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{backend} lock lacks {requirement}: run make lock"
        pinned = pins[name].version
        assert requirement.specifier.contains(pinned, prereleases=True), \
            f"{backend} lock pins {name}=={pinned}, outside {requirement}: run make lock"
    direct = {name for name, pin in pins.items() if FROM_PYPROJECT in pin.via}
    assert direct == {canonicalize_name(r.name) for r in wanted}, \
        f"{backend} lock was compiled from another pyproject.toml: run make lock"


def test_each_lock_has_its_torch_build() -> None:
    """cpu: PyTorch's CPU wheel and no nvidia-* package; cuda and image: PyPI's build with its
    CUDA libraries. The same torch release in all, so every machine tests one version."""
    cpu, cuda, image = (read_lock(LOCKS[name]) for name in ("cpu", "cuda", "image"))
    assert Version(cpu["torch"].version).local == "cpu"
    assert not [name for name in cpu if name.startswith("nvidia-")]
    for gpu in (cuda, image):
        assert Version(gpu["torch"].version).local is None
        assert Version(gpu["torch"].version).public == Version(cpu["torch"].version).public
        assert [name for name in gpu if name.startswith("nvidia-")]


def test_the_venv_holds_exactly_its_lock() -> None:
    """What `make setup` installed is the lock of the venv's backend, nothing more or less."""
    backend = "cpu" if torch.version.cuda is None else "cuda"
    pins = read_lock(LOCKS[backend])
    installed = {canonicalize_name(d.metadata["Name"]): d.version
                 for d in importlib.metadata.distributions()}
    installed.pop("pagedkv")
    assert installed == {name: pin.version for name, pin in pins.items()}, \
        f"the venv is not requirements/{backend}.txt: run make setup"


@pytest.mark.parametrize("other", ["cuda", "image"])
def test_the_locks_pin_one_version_of_each_package_they_share(other: str) -> None:
    """A CUDA machine and the image run what the CPU suite tested, Triton included (torch
    differs only in its build, checked above)."""
    cpu, theirs = read_lock(LOCKS["cpu"]), read_lock(LOCKS[other])
    differ = {name: (cpu[name].version, theirs[name].version)
              for name in cpu.keys() & theirs.keys()
              if name != "torch" and cpu[name].version != theirs[name].version}
    assert not differ, f"the locks disagree (cpu, {other}): {differ}: run make lock"
