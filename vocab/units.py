"""Byte sizes as people write them: "24GB", "15.2GB", "512MiB", "1048576".

Decimal units are powers of 1000 (GB = 10^9, as disk and GPU vendors use them) and binary
units powers of 1024 (GiB = 2^30). Units are case-insensitive; "B" or no unit means bytes.
"""

import re
from fractions import Fraction

_UNITS: dict[str, int] = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([a-z]*)")
# Units `format_bytes` may pick, largest first.
_DECIMAL = (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3))
_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def parse_bytes(text: str | int) -> int:
    """The number of bytes in `text`; ValueError for anything that is not a whole, >= 0 size."""
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a byte size cannot be negative: {text}")
        return text
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in _UNITS:
        raise ValueError(f"not a byte size: {text!r} (a number and one of B, KB, MB, GB, TB, "
                         "KiB, MiB, GiB, TiB)")
    # Fraction keeps "15.2GB" exact: 15.2 as a float times 10^9 is 15199999999.999998.
    value = Fraction(match.group(1)) * _UNITS[match.group(2)]
    if value.denominator != 1:
        raise ValueError(f"not a whole number of bytes: {text!r}")
    return int(value)


def format_bytes(num_bytes: int, binary: bool = False) -> str:
    """A short human form: "7.80 GB" (or "7.26 GiB" with binary=True); below 1 KB, "512 B"."""
    for name, size in _BINARY if binary else _DECIMAL:
        if abs(num_bytes) >= size:
            return f"{num_bytes / size:.2f} {name}"
    return f"{num_bytes} B"
