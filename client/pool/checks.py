"""Argument checks shared by the client's parameter dataclasses: a ValueError naming the field."""

import math
from collections.abc import Iterable


def check_int(name: str, value: object) -> None:
    # bool is an int subclass: `top_k=True` is a mistake, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")


def check_float(name: str, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")


def token_ids(name: str, values: Iterable[object]) -> tuple[int, ...]:
    """Token ids (ints >= 0) as a tuple: any iterable from an untyped caller is accepted, and a
    tuple keeps the dataclass hashable and frozen."""
    ids: list[int] = []
    for token_id in values:
        check_int(name, token_id)
        assert isinstance(token_id, int)  # for mypy: check_int raised otherwise
        if token_id < 0:
            raise ValueError(f"{name} must be >= 0, got {token_id}")
        ids.append(token_id)
    return tuple(ids)
