"""GGML tensor encodings in NumPy: dequantize, quantize and random valid blocks.

gguf.quants (llama.cpp-exact) is the one decoder, and the encoder of the float and 32-element
types; the K-quants and IQ4 types, which it cannot encode, use vkflash.formats.quantizers. Both
directions run in bounded chunks of blocks, so large tensors cost a few passes over memory and
bounded temporaries.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import gguf.quants
import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.errors import FormatError
from vkflash.formats import quantizers
from vkflash.formats.quant_blocks import BLOCK, FLOAT_TYPES, SCALE_FIELDS, as_qtype, row_bytes

__all__ = ["BLOCK", "SCALE_FIELDS", "row_bytes", "dequantize", "quantize", "random_blocks"]

_CHUNK_ELEMENTS = 1 << 18
"""Elements handled per vectorised step (bounds the temporaries, keeps them cache-friendly)."""

_CODE_SPAN: dict[Q, tuple[float, ...]] = {
    Q.Q8_0: (128,),
    Q.Q4_0: (8,),
    Q.Q5_0: (16,),
    Q.Q4_1: (7.5, -1),
    Q.Q5_1: (15.5, -1),
    Q.Q2_K: (45, 15),
    Q.Q3_K: (128,),
    Q.Q4_K: (63 * 15, 63),
    Q.Q5_K: (63 * 31, 63),
    Q.Q6_K: (128 * 32,),
    Q.IQ4_NL: (127,),
    Q.IQ4_XS: (32 * 127,),
}
"""Per f16 field of SCALE_FIELDS: how many units of that field the largest code combination
spans (sign = sign of the field); random_blocks sets field = amax / span."""

_F16_MIN_NORMAL = 2.0**-14


def _blockwise(fn: Callable[[np.ndarray], np.ndarray], src: np.ndarray, dst: np.ndarray, epb: int) -> None:
    """dst[s] = fn(src[s] flattened) for consecutive block ranges s of about _CHUNK_ELEMENTS
    elements (src and dst hold one row per block)."""
    step = max(1, _CHUNK_ELEMENTS // epb)
    for i in range(0, src.shape[0], step):
        s = slice(i, i + step)
        dst[s] = fn(src[s].reshape(-1)).reshape(dst[s].shape)


def dequantize(raw: np.ndarray | bytes, qtype: int, n_elements: int) -> np.ndarray:
    """Decode `n_elements` values of type `qtype` from `raw` bytes into a new float32 1-D array."""
    q = as_qtype(qtype)
    epb, bpb = BLOCK[q]
    nbytes = row_bytes(q, n_elements)
    data = np.frombuffer(raw, dtype=np.uint8) if isinstance(raw, (bytes, bytearray, memoryview)) else raw
    data = np.asarray(data).reshape(-1)
    if data.dtype != np.uint8 or data.size != nbytes:
        raise FormatError(
            f"{q.name}: {n_elements} elements need {nbytes} bytes, got {data.size} of {data.dtype}"
        )
    if n_elements <= _CHUNK_ELEMENTS:  # one step: take gguf's array as it is (a view for F32: copy it)
        y = gguf.quants.dequantize(data, q)
        return y.copy() if np.may_share_memory(y, data) else y
    out = np.empty((n_elements // epb, epb), dtype=np.float32)
    _blockwise(lambda b: gguf.quants.dequantize(b, q), data.reshape(-1, bpb), out, epb)
    return out.reshape(-1)


def _encode(q: Q, x: np.ndarray) -> np.ndarray:
    """Whole blocks of float32 values (flat) as the bytes of type `q`."""
    if q in quantizers.QUANT:
        return quantizers.QUANT[q](x.reshape(-1, BLOCK[q][0]))
    return np.ascontiguousarray(gguf.quants.quantize(x, q)).view(np.uint8)


def quantize(x: np.ndarray, qtype: int) -> np.ndarray:
    """Encode float values as `qtype` blocks (round-to-nearest); returns the raw uint8 bytes.

    Rows (the last axis) must be whole blocks, since a block never spans two rows.
    """
    q = as_qtype(qtype)
    epb, bpb = BLOCK[q]
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 0 or x.shape[-1] % epb:
        raise FormatError(f"{q.name} needs rows of a multiple of {epb} elements, got shape {x.shape}")
    out = np.empty((x.size // epb, bpb), dtype=np.uint8)
    _blockwise(lambda b: _encode(q, b), x.reshape(-1, epb), out, epb)
    return out.reshape(-1)


def _scale_value(amax: float, span: float) -> np.float16:
    """A normal power-of-two f16 near amax/|span|, with the sign of span."""
    mag = max(2.0 ** math.floor(math.log2(amax / abs(span))), _F16_MIN_NORMAL)
    return np.float16(math.copysign(mag, span))


def random_blocks(qtype: int, n_elements: int, rng: np.random.Generator, amax: float = 0.25) -> np.ndarray:
    """Raw bytes of valid `qtype` blocks: random codes with fixed small f16 scales.

    Decoded values stay within about ±amax (float types: normal with std amax/4). Fast enough
    for hundreds of MB: one random byte fill, then the f16 scale fields are overwritten.
    """
    q = as_qtype(qtype)
    epb, bpb = BLOCK[q]
    nbytes = row_bytes(q, n_elements)
    if q in FLOAT_TYPES:
        return quantize(rng.standard_normal(n_elements, dtype=np.float32) * np.float32(amax / 4), q)
    raw = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    blocks = raw.reshape(-1, bpb)
    for offset, span in zip(SCALE_FIELDS[q], _CODE_SPAN[q], strict=True):
        blocks[:, offset : offset + 2] = np.array([_scale_value(amax, span)]).view(np.uint8)
    return raw
