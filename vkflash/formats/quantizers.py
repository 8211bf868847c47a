"""The quantizers gguf.quants lacks: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL and IQ4_XS.

Each maps float32 blocks (n_blocks, elements_per_block) to their bytes (n_blocks, bytes_per_block)
with round-to-nearest codes and scales, vectorised over blocks. They exist so tests and tools can
write files of these types; gguf.quants decodes them (tests/formats checks every one against it).
A K-quant super-block of 256 holds 8 or 16 sub-blocks, each with a small integer scale (and min)
relative to one or two f16 super-scales d (dmin): x ≈ (d*sc)*q - dmin*m.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import QK_K
from gguf import GGMLQuantizationType as Q
from gguf.quants import IQ4_NL

KVALUES_IQ4NL = np.array(IQ4_NL.kvalues, dtype=np.float32)
"""The non-linear 4-bit code book of IQ4_NL and IQ4_XS (ascending)."""

_SHIFT2 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
_SHIFT8 = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)


# ---- scalar steps --------------------------------------------------------------------------

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


def nearest_index(v: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Index of the nearest entry of the ascending `table` for every value of `v`."""
    mid = (table[1:] + table[:-1]) / 2
    return np.searchsorted(mid, v).astype(np.uint8)


# ---- code layouts --------------------------------------------------------------------------

def pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Codes (..., 2n) in 0..15 -> bytes (..., n): the first n in the low nibbles, the rest high."""
    n = q.shape[-1] // 2
    q = q.astype(np.uint8)
    return q[..., :n] | (q[..., n:] << 4)


def pack_crumbs(q: np.ndarray) -> np.ndarray:
    """256 codes in 0..3 -> 64 bytes: element 128n + 32j + l goes to bits 2j..2j+1 of byte 32n + l."""
    nb = q.shape[0]
    return (q.astype(np.uint8).reshape(nb, 2, 4, 32) << _SHIFT2).sum(axis=2, dtype=np.uint8).reshape(nb, 64)


def pack_high_bits(h: np.ndarray) -> np.ndarray:
    """256 bits -> 32 bytes: element i goes to bit i // 32 of byte i % 32."""
    nb = h.shape[0]
    return (h.astype(np.uint8).reshape(nb, 8, 32) << _SHIFT8).sum(axis=1, dtype=np.uint8)


def pack_k4_nibbles(q: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K low nibbles: element 64c + 32h + l goes to nibble h of byte 32c + l."""
    nb = q.shape[0]
    return pack_nibbles(q.reshape(nb, QK_K // 64, 64)).reshape(nb, QK_K // 2)


def pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and eight 6-bit mins -> the 12 bytes of Q4_K/Q5_K."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    a = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    b = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    c = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([a, b, c], axis=-1)


def pack_scales_q3k(sc: np.ndarray) -> np.ndarray:
    """Sixteen Q3_K scales in -32..31 -> 12 bytes: low nibbles in bytes 0..7, high crumbs in 8..11."""
    nb = sc.shape[0]
    v = (sc.astype(np.int16) + 32).astype(np.uint8)
    high = ((v >> 4).reshape(nb, 4, 4) << _SHIFT2.reshape(1, 4, 1)).sum(axis=1, dtype=np.uint8)
    return np.concatenate([pack_nibbles(v & 0x0F), high], axis=-1)


# ---- shared fits ---------------------------------------------------------------------------

def _affine(x: np.ndarray, nmax: int, smax: int) -> tuple[np.ndarray, ...]:
    """Fit x ≈ (d*sc)*q - dmin*m per sub-block (x shaped (nb, S, n)); q in 0..nmax, sc/m in 0..smax.

    Returns (d bytes, dmin bytes, sc, m, q).
    """
    lo = np.minimum(x.min(axis=-1), 0)
    s = (x.max(axis=-1) - lo) / nmax
    dh, d = to_f16(s.max(axis=-1) / smax)
    mh, dmin = to_f16((-lo).max(axis=-1) / smax)
    sc = np.clip(np.rint(s * safe_inv(d)), 0, smax)
    m = np.clip(np.rint(-lo * safe_inv(dmin)), 0, smax)
    scale, offset = (d * sc)[..., None], (dmin * m)[..., None]
    q = np.clip(np.rint((x + offset) * safe_inv(scale)), 0, nmax)
    return dh, mh, sc, m, q.reshape(x.shape[0], -1)


def _symmetric(x: np.ndarray, qlo: int, slo: int) -> tuple[np.ndarray, ...]:
    """Fit x ≈ (d*sc)*q per sub-block (x shaped (nb, S, n)); q in qlo..-qlo-1, sc in slo..-slo-1.

    Largest magnitudes map to the negative end, as in ggml. Returns (d bytes, sc, q).
    """
    s = signed_absmax(x)[..., 0] / qlo
    dh, d = to_f16(signed_absmax(s)[:, 0] / slo)
    sc = np.clip(np.rint(s * safe_inv(d)), slo, -slo - 1)
    q = np.clip(np.rint(x * safe_inv((d * sc)[..., None])), qlo, -qlo - 1)
    return dh, sc, q.reshape(x.shape[0], -1)


# ---- quantizers ----------------------------------------------------------------------------

def q_q2_k(x: np.ndarray) -> np.ndarray:
    """Q2_K: 16 affine sub-blocks of 16, q 2-bit, sc/m 4-bit."""
    nb = x.shape[0]
    dh, mh, sc, m, q = _affine(x.reshape(nb, 16, 16), 3, 15)
    scm = sc.astype(np.uint8) | (m.astype(np.uint8) << 4)
    return np.concatenate([scm, pack_crumbs(q), dh, mh], axis=-1)


def q_q3_k(x: np.ndarray) -> np.ndarray:
    """Q3_K: 16 symmetric sub-blocks of 16, q = 2 low bits + 1 high bit - 4, sc signed 6-bit."""
    nb = x.shape[0]
    dh, sc, q = _symmetric(x.reshape(nb, 16, 16), -4, -32)
    u = (q + 4).astype(np.uint8)
    return np.concatenate([pack_high_bits(u >> 2), pack_crumbs(u & 3), pack_scales_q3k(sc), dh], axis=-1)


def q_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K: 8 affine sub-blocks of 32, q 4-bit, sc/m 6-bit."""
    nb = x.shape[0]
    dh, mh, sc, m, q = _affine(x.reshape(nb, 8, 32), 15, 63)
    return np.concatenate([dh, mh, pack_scale_min_k4(sc, m), pack_k4_nibbles(q)], axis=-1)


def q_q5_k(x: np.ndarray) -> np.ndarray:
    """Q5_K: as Q4_K with one more (high) bit per code."""
    nb = x.shape[0]
    dh, mh, sc, m, q = _affine(x.reshape(nb, 8, 32), 31, 63)
    u = q.astype(np.uint8)
    return np.concatenate(
        [dh, mh, pack_scale_min_k4(sc, m), pack_high_bits(u >> 4), pack_k4_nibbles(u & 0x0F)], axis=-1
    )


def q_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K: 16 symmetric sub-blocks of 16, q 6-bit (nibble + crumb) - 32, sc int8."""
    nb = x.shape[0]
    dh, sc, q = _symmetric(x.reshape(nb, 16, 16), -32, -128)
    u = (q + 32).astype(np.uint8)
    ql = pack_nibbles((u & 0x0F).reshape(nb, 2, 128)).reshape(nb, 128)
    return np.concatenate([ql, pack_crumbs(u >> 4), sc.astype(np.int8).view(np.uint8), dh], axis=-1)


def q_iq4_nl(x: np.ndarray) -> np.ndarray:
    """IQ4_NL: d = m / K[0] maps the signed largest value to code 0; then the nearest code of K."""
    dh, d = to_f16(signed_absmax(x) / KVALUES_IQ4NL[0])
    q = nearest_index(x * safe_inv(d), KVALUES_IQ4NL)
    return np.concatenate([dh, pack_nibbles(q)], axis=-1)


def q_iq4_xs(x: np.ndarray) -> np.ndarray:
    """IQ4_XS: per sub-block of 32 a scale m/K[0], stored 6-bit relative to d; then nearest code."""
    nb = x.shape[0]
    xs = x.reshape(nb, 8, 32)
    s = signed_absmax(xs)[..., 0] / KVALUES_IQ4NL[0]
    dh, d = to_f16(signed_absmax(s)[:, 0] / -32)
    ls = np.clip(np.rint(s * safe_inv(d)), -32, 31)
    q = nearest_index(xs * safe_inv((d * ls)[..., None]), KVALUES_IQ4NL)
    u = (ls + 32).astype(np.uint16)
    high = ((u >> 4) << np.arange(0, 16, 2, dtype=np.uint16)).sum(axis=-1, dtype=np.uint16)
    low = pack_nibbles((u & 0x0F).astype(np.uint8).reshape(nb, 4, 2)).reshape(nb, 4)
    return np.concatenate(
        [dh, high.astype("<u2").reshape(nb, 1).view(np.uint8), low, pack_nibbles(q).reshape(nb, 128)], axis=-1
    )


QUANT: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.Q2_K: q_q2_k, Q.Q3_K: q_q3_k, Q.Q4_K: q_q4_k, Q.Q5_K: q_q5_k, Q.Q6_K: q_q6_k,
    Q.IQ4_NL: q_iq4_nl, Q.IQ4_XS: q_iq4_xs,
}
"""qtype -> quantizer of blocks (n_blocks, elements_per_block) float32 -> (n_blocks, bytes) uint8."""
