"""The one check that token ids a caller gives are in the model's vocabulary, for the client
engine and the `LLM` (the runner checks again, with its own refusal, before a forward)."""

from collections.abc import Sequence


def check_vocabulary(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    """ValueError naming `what` ("prompt", "prompt 3:") and the first few ids outside
    [0, vocab_size)."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} token ids must be in [0, {vocab_size}) (the model's "
                         f"vocabulary), got {bad[:5]}")
