"""Bit-level helpers shared by the block codecs: f16 fields, nibbles, scale choice.

All work on a batch of blocks at once, shaped (n_blocks, ...), so no codec loops per block.
"""

from __future__ import annotations

import numpy as np


def f16_field(blocks: np.ndarray, offset: int) -> np.ndarray:
    """The f16 stored at byte `offset` of every block, as float32 of shape (n_blocks, 1)."""
    return blocks[:, offset : offset + 2].view(np.float16).astype(np.float32)


def to_f16(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round per-block values to f16: (the 2 bytes per block, the rounded value as float32)."""
    h = np.asarray(v, dtype=np.float32).astype(np.float16).reshape(-1, 1)
    return h.view(np.uint8), h.astype(np.float32)


def safe_inv(d: np.ndarray) -> np.ndarray:
    """1/d, with 0 where d is 0 (an all-zero block quantizes to zero codes)."""
    out = np.zeros_like(d, dtype=np.float32)
    np.divide(np.float32(1), d, out=out, where=d != 0)
    return out


def signed_absmax(x: np.ndarray) -> np.ndarray:
    """The entry of largest magnitude along the last axis, sign kept (keepdims)."""
    i = np.abs(x).argmax(axis=-1)[..., None]
    return np.take_along_axis(x, i, axis=-1)


def nibbles(qs: np.ndarray) -> np.ndarray:
    """Split bytes (..., n) into 2n codes: all low nibbles first, then all high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Inverse of `nibbles`: codes (..., 2n) in 0..15 -> bytes (..., n)."""
    n = q.shape[-1] // 2
    q = q.astype(np.uint8)
    return q[..., :n] | (q[..., n:] << 4)


def bits(words: np.ndarray, n: int) -> np.ndarray:
    """Bits 0..n-1 of each unsigned integer in `words` (..., 1) -> 0/1 array (..., n)."""
    shifts = np.arange(n, dtype=words.dtype)
    return (words >> shifts) & 1


def nearest_index(v: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of the ascending `table` for every value of `v`."""
    mid = (table[1:] + table[:-1]) / 2
    return np.searchsorted(mid, v).astype(np.uint8)
