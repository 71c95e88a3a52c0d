"""The compiled SHA-256 (`_rows_sha256.c`): the same digests as hashlib at every length
across the padding's edges, on its own and inside the compiled key loops, and the pool's
keys hashed with it where the CPU has SHA instructions."""

import hashlib
import random

import numpy as np
import pytest

from pagedkv.daemon.core import _rows
from pagedkv.daemon.core.content_keys import ContentKeys

native = pytest.mark.skipif(not _rows.SHA256_NATIVE, reason="this CPU has no SHA instructions")


@native
def test_it_digests_as_hashlib_at_every_length() -> None:
    rng = random.Random(0)
    # 0..200 crosses the one- and two-block paddings (55/56, 119/120 bytes); then longer ones.
    for n in [*range(201), 1000, 4096, 65_537]:
        data = rng.randbytes(n)
        assert _rows.sha256(data) == hashlib.sha256(data).digest(), n
    assert _rows.sha256(memoryview(b"abc")) == hashlib.sha256(b"abc").digest()


@native
def test_the_key_loops_hash_parent_then_ids_as_hashlib() -> None:
    """chain_keys feeds the parent and the ids as two pieces: parents of several lengths put
    the seam at every offset of a 64-byte block."""
    rng = np.random.default_rng(0)
    for parent_len in (0, 1, 16, 32, 63, 64, 65):
        parent = bytes(range(parent_len))
        for bs in (1, 3, 16):
            tokens = rng.integers(-2**40, 2**40, (4, bs), dtype=np.int64)
            keys = _rows.chain_keys(parent, tokens, bs, _rows.sha256)
            expected, before = [], parent
            for row in tokens:
                before = hashlib.sha256(before + row.tobytes()).digest()
                expected.append(before)
            assert keys == expected, (parent_len, bs)


def test_the_pool_keys_with_it_where_the_cpu_can() -> None:
    keys = ContentKeys("sha256")
    assert keys.digest(b"x") == hashlib.sha256(b"x").digest()
    assert (keys.digest is _rows.sha256) == _rows.SHA256_NATIVE


@pytest.mark.skipif(_rows.SHA256_NATIVE, reason="this CPU has SHA instructions")
def test_without_sha_instructions_it_refuses() -> None:
    with pytest.raises(RuntimeError, match="SHA extensions"):
        _rows.sha256(b"x")


def test_a_pool_on_a_cpu_without_sha_instructions_makes_the_same_keys(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The hashlib path (what a CPU without SHA instructions runs, forced here) and this CPU's
    give byte-identical roots, blocks and chains, so images and KV events move between them."""
    tokens = np.random.default_rng(1).integers(0, 50_000, (5, 16), dtype=np.int64)
    here = ContentKeys("sha256")
    monkeypatch.setattr(_rows, "SHA256_NATIVE", False)
    elsewhere = ContentKeys("sha256")
    assert elsewhere.digest is not _rows.sha256
    root = here.root(b"tenant")
    assert elsewhere.root(b"tenant") == root
    assert elsewhere.block(root, tokens[0].tobytes()) == here.block(root, tokens[0].tobytes())
    assert elsewhere.chain(root, tokens) == here.chain(root, tokens)
