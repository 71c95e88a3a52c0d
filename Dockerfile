# syntax=docker/dockerfile:1
#
# The pagedkv image: pagedkvd, `pagedkv runner` and `pagedkv serve` for ops/kubernetes (one image,
# three containers; each container's command picks the process). Build with `make image`: the
# name and tag are in ops/image.env. tests/ops/test_image.py lints this file with hadolint and
# checks it against the manifests and the systemd units; no container engine runs in `make test`.
#
# Two stages, in the pattern of vLLM's docker/Dockerfile (a build image, then a slimmer final one):
#   builder  a standalone CPython 3.11 (uv's managed Python) and a venv at /opt/pagedkv/venv with
#            requirements/image.txt (the runtime extra, CUDA build: no test tools) installed
#            exactly (hashes checked, no resolution), then pagedkv;
#   runtime  NVIDIA's CUDA *base* image (cudart and the forward-compat driver libraries only) with
#            that Python and that venv copied in. The CUDA user-space libraries come as nvidia-*
#            wheels with PyPI's torch (in the lock); the host brings the driver through the
#            NVIDIA container toolkit.
# The venv's path is the systemd units' (/opt/pagedkv/venv/bin/pagedkvd ...), so the units'
# command lines are the image's too.

# CUDA 13.0: the version of PyPI's torch 2.13.0 wheel (it requires cuda-toolkit==13.0.3); the
# toolkit on the host refuses to start the container on a driver too old for it.
# TODO: pin by digest once resolved where a registry is reachable
# (`docker buildx imagetools inspect nvidia/cuda:13.0.2-base-ubuntu24.04`), as NAME:TAG@sha256:...
ARG CUDA_BASE_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04
# uv, for the managed Python and the install. TODO: pin by digest, as above.
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.8
# requirements/image.txt is compiled for CPython 3.11 on linux x86_64. A pinned uv always picks
# the same 3.11.x build.
ARG PYTHON_VERSION=3.11

FROM ${UV_IMAGE} AS uv

# ---------------------------------------------------------------------------------- builder
FROM ${CUDA_BASE_IMAGE} AS builder
ARG PYTHON_VERSION

COPY --from=uv /uv /usr/local/bin/uv

# No cache to leave behind (the stage is thrown away, but nothing here relies on that), Python
# from uv only (never the base image's), bytecode compiled now: the containers' root file
# systems are read-only, so Python could not write __pycache__ at run time.
ENV UV_NO_CACHE=1 \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-managed \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy

# gcc and the C library's headers build pagedkv's C extensions (setup.py: plain C against the
# Python headers, which uv's Python brings). The builder is thrown away; the final stage installs
# its own gcc for Triton (see there). Pinning breaks when Ubuntu's archive moves on.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

RUN uv python install --no-cache "${PYTHON_VERSION}" \
    && uv venv --no-cache --python "${PYTHON_VERSION}" /opt/pagedkv/venv

WORKDIR /src

# The lock first, alone: its layer is rebuilt only when the lock changes. Exactly the lock:
# every requirement pinned with its hashes (--require-hashes), nothing resolved (--no-deps).
COPY requirements/image.txt requirements/image.txt
RUN uv pip install --no-cache --python /opt/pagedkv/venv/bin/python \
        --require-hashes --no-deps -r requirements/image.txt

# Then pagedkv itself, not editable, built with the lock's setuptools (--no-build-isolation; its C
# extensions with the gcc above), and its dependencies are the lock's (--no-deps). .dockerignore lets in only what the build reads.
COPY . .
RUN uv pip install --no-cache --python /opt/pagedkv/venv/bin/python \
        --no-deps --no-build-isolation . \
    && /opt/pagedkv/venv/bin/pagedkv --help >/dev/null \
    && /opt/pagedkv/venv/bin/pagedkvd --help >/dev/null \
    && /opt/pagedkv/venv/bin/pagedkv runner --help >/dev/null \
    && /opt/pagedkv/venv/bin/pagedkv serve --help >/dev/null

# ---------------------------------------------------------------------------------- runtime
FROM ${CUDA_BASE_IMAGE} AS runtime
ARG CUDA_BASE_IMAGE
# Given by `make image`: pyproject's version (the image tag) and the git commit.
ARG VERSION=unknown
ARG REVISION=unknown

LABEL org.opencontainers.image.title="pagedkv" \
      org.opencontainers.image.description="Paged KV-cache memory daemon (pagedkvd), model runner (pagedkv runner) and OpenAI-compatible server (pagedkv serve)" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${CUDA_BASE_IMAGE}"

# The one compiler in the image, on purpose: Triton (the runner's attention kernels on CUDA)
# builds its CUDA launcher module (triton/backends/nvidia/driver.c) with the C compiler it finds
# on PATH the first time a kernel runs in a fresh TRITON_CACHE_DIR, and fails with "Failed to
# find C compiler" without one (the failure images on NVIDIA's runtime or base images hit). So:
# gcc and the C library's headers, nothing else of a toolchain (no g++, make, build-essential).
# ca-certificates: the standalone Python's TLS uses the system's CA store.
# Ubuntu's archive keeps only each package's current version: pinning them breaks the build
# when it moves on; the base image's tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
        gcc libc6-dev ca-certificates \
    && rm -rf /var/lib/apt/lists/*

# The pods' user (statefulset.yaml: runAsUser, runAsGroup and fsGroup 10001), with a passwd
# entry so that HOME and `id` resolve. The folders the manifests and the units use:
#   /run/pagedkv   the unix sockets (a shared emptyDir in a pod), the daemon's user's
#   /home/pagedkv  HOME when nothing sets it (the pods set HOME=/tmp)
#   /etc/pagedkv   pagedkv.toml (the ConfigMap in a pod): readable, not writable, by the user
#   /models        the model folder (a read-only volume in a pod), the same
RUN groupadd --gid 10001 pagedkv \
    && useradd --uid 10001 --gid 10001 --no-log-init --no-create-home \
        --home-dir /home/pagedkv --shell /usr/sbin/nologin pagedkv \
    && install -d -o 10001 -g 10001 -m 0750 /run/pagedkv /home/pagedkv \
    && install -d -o 0 -g 10001 -m 0750 /etc/pagedkv /models

# The interpreter and the venv, at the paths the venv was made with, owned by root: the
# service's user cannot change its own code.
COPY --from=builder /opt/python /opt/python
COPY --from=builder /opt/pagedkv/venv /opt/pagedkv/venv

ENV VIRTUAL_ENV=/opt/pagedkv/venv \
    PATH=/opt/pagedkv/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1

USER 10001:10001
WORKDIR /home/pagedkv

# The server's HTTP, the daemon's and the runner's /metrics, the daemon's KV events and replays.
EXPOSE 8000 9464 9465 5557 5558

# Which process this container is, and so which endpoint says it is healthy, is its command's
# choice; Kubernetes probes each (statefulset.yaml).
HEALTHCHECK NONE

# `pagedkv SUBCOMMAND ...`, as the manifests' containers run it (command: ["pagedkv"]):
#   docker run IMAGE daemon --config /etc/pagedkv/pagedkv.toml
#   docker run IMAGE runner --model /models/current --daemon unix:///run/pagedkv/...
#   docker run IMAGE serve --model /models/current ...
# pagedkvd (the daemon's own name, as in pagedkvd.service) is on PATH too.
ENTRYPOINT ["pagedkv"]
CMD ["--help"]
