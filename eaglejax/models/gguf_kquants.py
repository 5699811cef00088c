"""The bytes of GGUF K-quant super-blocks (Q4_K, Q6_K: 256 weights of one row) decoded into
the parts `models.gguf_blocks` keeps: the stored values q, the integer sub-block scales (and
Q4_K's integer minimums), and the float16 super-block scales, none of them widened.

Q4_K, 144 bytes: float16 d and dmin, 12 bytes of 6-bit scales sc and minimums m for its 8
sub-blocks of 32, then 128 bytes of 4-bit q (bytes 32c..32c+31 hold sub-block 2c in their
low nibbles and 2c + 1 in their high ones); w = (d sc) q - (dmin m).
Q6_K, 210 bytes: 128 bytes of the low 4 bits of q (half h, byte j < 64: value 128h + j in
the low nibble, 128h + 64 + j in the high one), 64 bytes of their high 2 bits (half h, byte
j < 32: value 128h + 32s + j at bits 2s), 16 int8 scales sc of sub-blocks of 16, float16 d;
w = (d sc) (q - 32). (llama.cpp's ggml-common.h; the `gguf` package's `quants.py`.)
"""

from __future__ import annotations

import numpy as np

SUPER = 256  # weights of one super-block


def _half(a: np.ndarray) -> np.ndarray:
    """Two bytes [..., 2] read as the float16 they store: [...]."""
    return np.ascontiguousarray(a).view(np.float16)[..., 0]


def q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks uint8 [N, K/256, 144] -> values uint8 [N, K] (0..15), scales and
    minimums uint8 [N, K/32] (0..63), supers float16 [N, K/256, 2] (d, dmin)."""
    n, count = blocks.shape[:2]
    supers = np.stack([_half(blocks[..., 0:2]), _half(blocks[..., 2:4])], axis=-1)
    low, high, both = (blocks[..., 4 + 4 * i:8 + 4 * i] for i in range(3))
    # sub-blocks 0-3: the low 6 bits of `low` (scales) and `high` (minimums); 4-7: 4 bits of
    # `both` (low nibble scales, high nibble minimums) under the top 2 bits of low / high
    scales = np.concatenate([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)], axis=-1)
    q = blocks[..., 16:].reshape(n, count, 4, 1, 32)
    q = np.concatenate([q & 0x0F, q >> 4], axis=-2)  # [N, K/256, 4 pairs, 2, 32]
    return (q.reshape(n, count * SUPER), scales.reshape(n, -1), mins.reshape(n, -1),
            supers)


def q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K super-blocks uint8 [N, K/256, 210] -> values uint8 [N, K] (0..63), scales int8
    [N, K/16], supers float16 [N, K/256, 1] (d)."""
    n, count = blocks.shape[:2]
    low = blocks[..., :128].reshape(n, count, 2, 1, 64)
    low = np.concatenate([low & 0x0F, low >> 4], axis=-2)  # [N, K/256, 2 halves, 2, 64]
    high = blocks[..., 128:192].reshape(n, count, 2, 1, 32)
    high = np.concatenate([(high >> s) & 0x03 for s in (0, 2, 4, 6)], axis=-2)
    q = low.reshape(n, count, SUPER) | (high.reshape(n, count, SUPER) << 4)
    scales = np.ascontiguousarray(blocks[..., 192:208]).view(np.int8)
    return q.reshape(n, count * SUPER), scales.reshape(n, -1), _half(blocks[..., 208:210])[..., None]
