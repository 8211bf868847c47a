"""256-element super-block codecs: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS.

A super-block holds 8 or 16 sub-blocks, each with a small integer scale (and min) relative to
one or two f16 super-scales d (dmin). Dequantizers follow ggml's float32 operation order
(x = (d*sc)*q - dmin*m) so they are bit-exact; quantizers use round-to-nearest at both levels.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.formats.quant_blocks import QK_K
from vkflash.formats.quant_pack import (
    f16_field,
    nearest_index,
    nibbles,
    pack_nibbles,
    safe_inv,
    signed_absmax,
    to_f16,
)
from vkflash.formats.quant_simple import KVALUES_IQ4NL

_SHIFT2 = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
_SHIFT8 = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)


# ---- code layouts ------------------------------------------------------------------------

def crumbs(qs: np.ndarray) -> np.ndarray:
    """2-bit codes of 64 bytes -> 256: element 128n + 32j + l is bits 2j..2j+1 of byte 32n + l."""
    nb = qs.shape[0]
    return ((qs.reshape(nb, 2, 1, 32) >> _SHIFT2) & 3).reshape(nb, QK_K)


def pack_crumbs(q: np.ndarray) -> np.ndarray:
    """Inverse of `crumbs`: 256 codes in 0..3 -> 64 bytes."""
    nb = q.shape[0]
    return (q.astype(np.uint8).reshape(nb, 2, 4, 32) << _SHIFT2).sum(axis=2, dtype=np.uint8).reshape(nb, 64)


def high_bits(qh: np.ndarray) -> np.ndarray:
    """One bit per element from 32 bytes: element i is bit i // 32 of byte i % 32."""
    nb = qh.shape[0]
    return ((qh.reshape(nb, 1, 32) >> _SHIFT8) & 1).reshape(nb, QK_K)


def pack_high_bits(h: np.ndarray) -> np.ndarray:
    """Inverse of `high_bits`: 256 bits -> 32 bytes."""
    nb = h.shape[0]
    return (h.astype(np.uint8).reshape(nb, 8, 32) << _SHIFT8).sum(axis=1, dtype=np.uint8)


def k4_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K low nibbles: element 64c + 32h + l is nibble h of byte 32c + l."""
    nb = qs.shape[0]
    return nibbles(qs.reshape(nb, QK_K // 64, 32)).reshape(nb, QK_K)


def pack_k4_nibbles(q: np.ndarray) -> np.ndarray:
    """Inverse of `k4_nibbles`."""
    nb = q.shape[0]
    return pack_nibbles(q.reshape(nb, QK_K // 64, 64)).reshape(nb, QK_K // 2)


def scale_min_k4(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack 12 bytes into eight 6-bit scales and eight 6-bit mins (Q4_K, Q5_K)."""
    a, b, c = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 63, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, mn


def pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Inverse of `scale_min_k4`: eight scales and eight mins in 0..63 -> 12 bytes."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    a = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    b = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    c = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([a, b, c], axis=-1)


def scales_q3k(s: np.ndarray) -> np.ndarray:
    """Sixteen signed 6-bit Q3_K scales from 12 bytes: low nibbles in 0..7, high crumbs in 8..11."""
    nb = s.shape[0]
    low = nibbles(s[:, :8])
    high = ((s[:, 8:12].reshape(nb, 1, 4) >> _SHIFT2.reshape(1, 4, 1)) & 3).reshape(nb, 16)
    return (low | (high << 4)).astype(np.int8) - np.int8(32)


def pack_scales_q3k(sc: np.ndarray) -> np.ndarray:
    """Inverse of `scales_q3k`: sixteen scales in -32..31 -> 12 bytes."""
    nb = sc.shape[0]
    v = (sc.astype(np.int16) + 32).astype(np.uint8)
    high = ((v >> 4).reshape(nb, 4, 4) << _SHIFT2.reshape(1, 4, 1)).sum(axis=1, dtype=np.uint8)
    return np.concatenate([pack_nibbles(v & 0x0F), high], axis=-1)


# ---- shared quantizer steps ----------------------------------------------------------------

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


# ---- Q2_K ----------------------------------------------------------------------------------

def deq_q2_k(b: np.ndarray) -> np.ndarray:
    """Q2_K: 16 sub-blocks of 16; x = (d*sc)*q - dmin*m, q 2-bit, sc/m 4-bit."""
    nb = b.shape[0]
    scm = b[:, 0:16]
    dl = (f16_field(b, 80) * (scm & 0x0F).astype(np.float32))[..., None]
    ml = (f16_field(b, 82) * (scm >> 4).astype(np.float32))[..., None]
    q = crumbs(b[:, 16:80]).reshape(nb, 16, 16).astype(np.float32)
    return (dl * q - ml).reshape(nb, QK_K)


def q_q2_k(x: np.ndarray) -> np.ndarray:
    """Q2_K quantizer (affine sub-blocks of 16)."""
    nb = x.shape[0]
    dh, mh, sc, m, q = _affine(x.reshape(nb, 16, 16), 3, 15)
    scm = sc.astype(np.uint8) | (m.astype(np.uint8) << 4)
    return np.concatenate([scm, pack_crumbs(q), dh, mh], axis=-1)


# ---- Q3_K ----------------------------------------------------------------------------------

def deq_q3_k(b: np.ndarray) -> np.ndarray:
    """Q3_K: 16 sub-blocks of 16; x = (d*sc)*(q - 4 + 4*hbit), sc signed 6-bit."""
    nb = b.shape[0]
    dl = (f16_field(b, 108) * scales_q3k(b[:, 96:108]).astype(np.float32))[..., None]
    q = crumbs(b[:, 32:96]).astype(np.int8) + (high_bits(b[:, 0:32]).astype(np.int8) << 2) - np.int8(4)
    return (dl * q.reshape(nb, 16, 16).astype(np.float32)).reshape(nb, QK_K)


def q_q3_k(x: np.ndarray) -> np.ndarray:
    """Q3_K quantizer (symmetric sub-blocks of 16)."""
    nb = x.shape[0]
    dh, sc, q = _symmetric(x.reshape(nb, 16, 16), -4, -32)
    u = (q + 4).astype(np.uint8)
    return np.concatenate([pack_high_bits(u >> 2), pack_crumbs(u & 3), pack_scales_q3k(sc), dh], axis=-1)


# ---- Q4_K and Q5_K -------------------------------------------------------------------------

def _deq_k45(b: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Shared tail of Q4_K/Q5_K: 8 sub-blocks of 32, x = (d*sc)*q - dmin*m."""
    nb = b.shape[0]
    sc, m = scale_min_k4(b[:, 4:16])
    dl = (f16_field(b, 0) * sc.astype(np.float32))[..., None]
    ml = (f16_field(b, 2) * m.astype(np.float32))[..., None]
    return (dl * q.reshape(nb, 8, 32).astype(np.float32) - ml).reshape(nb, QK_K)


def deq_q4_k(b: np.ndarray) -> np.ndarray:
    """Q4_K: 4-bit codes."""
    return _deq_k45(b, k4_nibbles(b[:, 16:144]))


def deq_q5_k(b: np.ndarray) -> np.ndarray:
    """Q5_K: 4-bit codes plus one high bit each."""
    return _deq_k45(b, k4_nibbles(b[:, 48:176]) | (high_bits(b[:, 16:48]) << 4))


def q_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K quantizer (affine sub-blocks of 32)."""
    nb = x.shape[0]
    dh, mh, sc, m, q = _affine(x.reshape(nb, 8, 32), 15, 63)
    return np.concatenate([dh, mh, pack_scale_min_k4(sc, m), pack_k4_nibbles(q)], axis=-1)


def q_q5_k(x: np.ndarray) -> np.ndarray:
    """Q5_K quantizer (affine sub-blocks of 32)."""
    nb = x.shape[0]
    dh, mh, sc, m, q = _affine(x.reshape(nb, 8, 32), 31, 63)
    u = q.astype(np.uint8)
    return np.concatenate(
        [dh, mh, pack_scale_min_k4(sc, m), pack_high_bits(u >> 4), pack_k4_nibbles(u & 0x0F)], axis=-1
    )


# ---- Q6_K ----------------------------------------------------------------------------------

def deq_q6_k(b: np.ndarray) -> np.ndarray:
    """Q6_K: 16 sub-blocks of 16; x = (d*sc)*(q - 32), sc int8, q 6-bit (nibble + crumb)."""
    nb = b.shape[0]
    low = nibbles(b[:, 0:128].reshape(nb, 2, 64)).reshape(nb, QK_K)
    q = (low | (crumbs(b[:, 128:192]) << 4)).astype(np.int8) - np.int8(32)
    dl = (f16_field(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32))[..., None]
    return (dl * q.reshape(nb, 16, 16).astype(np.float32)).reshape(nb, QK_K)


def q_q6_k(x: np.ndarray) -> np.ndarray:
    """Q6_K quantizer (symmetric sub-blocks of 16)."""
    nb = x.shape[0]
    dh, sc, q = _symmetric(x.reshape(nb, 16, 16), -32, -128)
    u = (q + 32).astype(np.uint8)
    ql = pack_nibbles((u & 0x0F).reshape(nb, 2, 128)).reshape(nb, 128)
    return np.concatenate([ql, pack_crumbs(u >> 4), sc.astype(np.int8).view(np.uint8), dh], axis=-1)


# ---- IQ4_XS --------------------------------------------------------------------------------

def deq_iq4_xs(b: np.ndarray) -> np.ndarray:
    """IQ4_XS: 8 sub-blocks of 32; x = (d*(ls-32)) * K[q], ls 6-bit, K the IQ4_NL book."""
    nb = b.shape[0]
    low = nibbles(b[:, 4:8].reshape(nb, 4, 1)).reshape(nb, 8)
    high = (b[:, 2:4].view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    ls = (low | (high.astype(np.uint8) << 4)).astype(np.int8) - np.int8(32)
    dl = (f16_field(b, 0) * ls.astype(np.float32))[..., None]
    q = nibbles(b[:, 8:136].reshape(nb, 8, 16))
    return (dl * KVALUES_IQ4NL[q]).reshape(nb, QK_K)


def q_iq4_xs(x: np.ndarray) -> np.ndarray:
    """IQ4_XS quantizer: per sub-block scale m/K[0], 6-bit relative to d, then nearest code."""
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


DEQUANT: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.Q2_K: deq_q2_k, Q.Q3_K: deq_q3_k, Q.Q4_K: deq_q4_k,
    Q.Q5_K: deq_q5_k, Q.Q6_K: deq_q6_k, Q.IQ4_XS: deq_iq4_xs,
}
QUANT: dict[Q, Callable[[np.ndarray], np.ndarray]] = {
    Q.Q2_K: q_q2_k, Q.Q3_K: q_q3_k, Q.Q4_K: q_q4_k,
    Q.Q5_K: q_q5_k, Q.Q6_K: q_q6_k, Q.IQ4_XS: q_iq4_xs,
}
