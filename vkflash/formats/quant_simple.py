"""Float and 32-element block codecs: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL.

Each dequantizer maps blocks (n_blocks, bytes_per_block) uint8 -> (n_blocks, 32) float32 with
the same float32 operation order as ggml (so results are bit-exact); each quantizer is the
inverse with round-to-nearest codes.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.formats.quant_pack import (
    bits,
    f16_field,
    nearest_index,
    nibbles,
    pack_nibbles,
    safe_inv,
    signed_absmax,
    to_f16,
)

KVALUES_IQ4NL = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.float32
)
"""The non-linear 4-bit code book of IQ4_NL and IQ4_XS."""


# ---- floats: one element per "block" -------------------------------------------------------

def deq_f32(b: np.ndarray) -> np.ndarray:
    """F32: the bytes are the values."""
    return b.view(np.float32)


def deq_f16(b: np.ndarray) -> np.ndarray:
    """F16 widened to float32 (exact)."""
    return b.view(np.float16).astype(np.float32)


def deq_bf16(b: np.ndarray) -> np.ndarray:
    """BF16 is the upper half of a float32."""
    return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def q_f32(x: np.ndarray) -> np.ndarray:
    """F32: store as is."""
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint8)


def q_f16(x: np.ndarray) -> np.ndarray:
    """F16: IEEE round-to-nearest-even."""
    return x.astype(np.float16).view(np.uint8)


def q_bf16(x: np.ndarray) -> np.ndarray:
    """BF16 with round-to-nearest-even on the dropped 16 bits; NaN stays a quiet NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    quiet_nan = (u >> 16) | 0x40
    h = np.where((u & 0x7FFFFFFF) > 0x7F800000, quiet_nan, rounded)
    return h.astype(np.uint16).view(np.uint8)


# ---- block-32 formats ----------------------------------------------------------------------

def deq_q8_0(b: np.ndarray) -> np.ndarray:
    """Q8_0: x = d * q, q int8."""
    return b[:, 2:].view(np.int8).astype(np.float32) * f16_field(b, 0)


def q_q8_0(x: np.ndarray) -> np.ndarray:
    """Q8_0: d = max|x| / 127."""
    dh, d = to_f16(np.abs(x).max(axis=-1) / 127)
    q = np.clip(np.rint(x * safe_inv(d)), -127, 127).astype(np.int8)
    return np.concatenate([dh, q.view(np.uint8)], axis=-1)


def deq_q4_0(b: np.ndarray) -> np.ndarray:
    """Q4_0: x = d * (q - 8)."""
    q = nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
    return f16_field(b, 0) * q.astype(np.float32)


def q_q4_0(x: np.ndarray) -> np.ndarray:
    """Q4_0: d = -m/8 with m the signed largest-magnitude value (maps m to code 0)."""
    dh, d = to_f16(signed_absmax(x) / -8)
    q = np.clip(np.rint(x * safe_inv(d)) + 8, 0, 15)
    return np.concatenate([dh, pack_nibbles(q)], axis=-1)


def deq_q4_1(b: np.ndarray) -> np.ndarray:
    """Q4_1: x = d * q + m."""
    q = nibbles(b[:, 4:]).astype(np.float32)
    return f16_field(b, 0) * q + f16_field(b, 2)


def q_q4_1(x: np.ndarray) -> np.ndarray:
    """Q4_1: m = min x, d = (max - min) / 15."""
    mh, m = to_f16(x.min(axis=-1))
    dh, d = to_f16((x.max(axis=-1) - m[:, 0]) / 15)
    q = np.clip(np.rint((x - m) * safe_inv(d)), 0, 15)
    return np.concatenate([dh, mh, pack_nibbles(q)], axis=-1)


def _q5_codes(b: np.ndarray, qh_at: int) -> np.ndarray:
    """The 32 five-bit codes of a Q5_0/Q5_1 block: nibble | bit j of the u32 qh << 4."""
    qh = b[:, qh_at : qh_at + 4].view("<u4")
    return nibbles(b[:, qh_at + 4 :]) | (bits(qh, 32).astype(np.uint8) << 4)


def _q5_pack(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes (n, 32) in 0..31 -> (qh as 4 bytes, qs as 16 bytes)."""
    q = q.astype(np.uint32)
    qh = ((q >> 4) << np.arange(32, dtype=np.uint32)).sum(axis=-1, dtype=np.uint32)
    return qh.astype("<u4").reshape(-1, 1).view(np.uint8), pack_nibbles(q & 0x0F)


def deq_q5_0(b: np.ndarray) -> np.ndarray:
    """Q5_0: x = d * (q - 16)."""
    q = _q5_codes(b, 2).astype(np.int8) - np.int8(16)
    return f16_field(b, 0) * q.astype(np.float32)


def q_q5_0(x: np.ndarray) -> np.ndarray:
    """Q5_0: d = -m/16 with m the signed largest-magnitude value."""
    dh, d = to_f16(signed_absmax(x) / -16)
    q = np.clip(np.rint(x * safe_inv(d)) + 16, 0, 31)
    qh, qs = _q5_pack(q)
    return np.concatenate([dh, qh, qs], axis=-1)


def deq_q5_1(b: np.ndarray) -> np.ndarray:
    """Q5_1: x = d * q + m."""
    q = _q5_codes(b, 4).astype(np.float32)
    return f16_field(b, 0) * q + f16_field(b, 2)


def q_q5_1(x: np.ndarray) -> np.ndarray:
    """Q5_1: m = min x, d = (max - min) / 31."""
    mh, m = to_f16(x.min(axis=-1))
    dh, d = to_f16((x.max(axis=-1) - m[:, 0]) / 31)
    q = np.clip(np.rint((x - m) * safe_inv(d)), 0, 31)
    qh, qs = _q5_pack(q)
    return np.concatenate([dh, mh, qh, qs], axis=-1)


def deq_iq4_nl(b: np.ndarray) -> np.ndarray:
    """IQ4_NL: x = d * K[q] with the fixed non-linear code book K."""
    return f16_field(b, 0) * KVALUES_IQ4NL[nibbles(b[:, 2:])]


def q_iq4_nl(x: np.ndarray) -> np.ndarray:
    """IQ4_NL: d = m / K[0] maps the signed largest value to code 0; then nearest code."""
    dh, d = to_f16(signed_absmax(x) / KVALUES_IQ4NL[0])
    q = nearest_index(x * safe_inv(d), KVALUES_IQ4NL)
    return np.concatenate([dh, pack_nibbles(q)], axis=-1)


DEQUANT: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.F32: deq_f32, Q.F16: deq_f16, Q.BF16: deq_bf16,
    Q.Q8_0: deq_q8_0, Q.Q4_0: deq_q4_0, Q.Q4_1: deq_q4_1,
    Q.Q5_0: deq_q5_0, Q.Q5_1: deq_q5_1, Q.IQ4_NL: deq_iq4_nl,
}
QUANT: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.F32: q_f32, Q.F16: q_f16, Q.BF16: q_bf16,
    Q.Q8_0: q_q8_0, Q.Q4_0: q_q4_0, Q.Q4_1: q_q4_1,
    Q.Q5_0: q_q5_0, Q.Q5_1: q_q5_1, Q.IQ4_NL: q_iq4_nl,
}
