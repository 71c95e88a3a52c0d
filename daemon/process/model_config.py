"""The [models.NAME] tables of the daemon's TOML file: each model's memory policy.

    [models.qwen-7b]
    min_memory = "4GiB"    # reserved: other formats never take the pool below it
    max_memory = "12GiB"   # a cap: a call that would take the model past it is refused

Every error names the key (`models.qwen-7b.max_memory: ...`), so a bad table stops the daemon
at start; daemon/service/models.py and pages.py say what the figures mean at run time. A table
may name a model no runner has registered yet: it applies once one does.
"""

from collections.abc import Mapping
from typing import Any

from pagedkv.daemon.service.models import MODEL_NAME, ModelPolicy
from pagedkv.vocab.units import parse_bytes

# Keys of a [models.NAME] table.
MODEL_KEYS = ("min_memory", "max_memory")


def parse_models(raw: Any) -> tuple[tuple[str, ModelPolicy], ...]:
    """The [models.NAME] tables of a TOML file; ValueError or TypeError if malformed."""
    if not isinstance(raw, Mapping):
        raise TypeError("expected [models.NAME] tables")
    return tuple((name, _parse_model(name, table)) for name, table in raw.items())


def _parse_model(name: str, table: Any) -> ModelPolicy:
    if not MODEL_NAME.match(name):
        raise ValueError(f"models.{name}: a model name is 1 to 128 letters, digits or '._-/:'")
    if not isinstance(table, Mapping):
        raise TypeError(f"models.{name}: expected a table")
    unknown = sorted(set(table) - set(MODEL_KEYS))
    if unknown:
        raise ValueError(f"models.{name}: unknown key(s) {', '.join(unknown)}; known: "
                         f"{', '.join(MODEL_KEYS)}")
    low, high = (_bytes(table, name, key) for key in MODEL_KEYS)
    if high and low > high:
        raise ValueError(f"models.{name}: min_memory ({low}) is above max_memory ({high})")
    return ModelPolicy(min_memory=low, max_memory=high)


def _bytes(table: Mapping[str, Any], name: str, key: str) -> int:
    value = table.get(key, 0)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"models.{name}.{key}: expected bytes as an integer or a string like "
                        f"\"4GiB\", got {value!r}")
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise ValueError(f"models.{name}.{key}: {exc}") from exc
