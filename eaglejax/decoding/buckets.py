"""Static shapes from lengths: rounding up to powers of two so compiled programs are reused."""

from __future__ import annotations


def bucket(n: int, minimum: int = 16) -> int:
    """The next power of two >= n (at least `minimum`)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())
