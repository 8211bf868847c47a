"""The q8_0 bytes vkflash's caches store, in NumPy: the oracle of kv_append / kv_requant (tests in
tests/gpu and tests/engine import it; tests/ is on the path through its conftest)."""

from __future__ import annotations

import numpy as np


def kv_q8_0(x: np.ndarray) -> np.ndarray:
    """q8_0 bytes of float32 x rounded as shaders/kv_append.comp does (per 32-block d = f16(max|x|/127),
    q = roundEven(x/d)); differs from ggml's (and gguf.quants') encoder, which divides by the unrounded d."""
    b = x.astype(np.float32).reshape(-1, 32)
    d = (np.abs(b).max(axis=-1, keepdims=True) / np.float32(127)).astype(np.float16)
    df = d.astype(np.float32)
    inv = np.divide(np.float32(1), df, out=np.zeros_like(df), where=df != 0)
    q = np.clip(np.rint(b * inv), -127, 127).astype(np.int8)
    return np.concatenate([d.view(np.uint8), q.view(np.uint8)], axis=-1).reshape(-1)
