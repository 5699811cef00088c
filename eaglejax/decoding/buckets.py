"""Static shapes from lengths: rounding up to a few sizes so compiled programs are reused."""

from __future__ import annotations


def bucket(n: int, minimum: int = 16) -> int:
    """The next power of two >= n (at least `minimum`)."""
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def fine_bucket(n: int, minimum: int = 16) -> int:
    """The next size >= n among `minimum` times 1, 2, 3, 4, 6, 8, 12, 16, ... (powers of two
    and, from 3 x `minimum`, one and a half times them): past 2 x `minimum`, at most a third
    of it padding, against up to half with powers of two, for a few more programs."""
    power = bucket(n, minimum)
    between = 3 * power // 4
    return between if n <= between and between >= 3 * minimum else power


def fine_buckets(limit: int, minimum: int = 16) -> list[int]:
    """Every `fine_bucket` size below `limit`, in order."""
    sizes, n = [], minimum
    while n < limit:
        sizes.append(n)
        n = fine_bucket(n + 1, minimum)
    return sizes
