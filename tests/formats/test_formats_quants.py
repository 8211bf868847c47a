"""vkflash.formats.quants against gguf.quants, the llama.cpp-exact decoder: decoding goes through
it, every encoder (gguf's and the quantizers it lacks) round-trips within its type's resolution,
and random_blocks gives valid blocks."""

from __future__ import annotations

import time

import gguf.quants
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from vkflash.errors import FormatError
from vkflash.formats import quantizers
from vkflash.formats.quants import BLOCK, SCALE_FIELDS, dequantize, quantize, random_blocks, row_bytes

TYPES = list(BLOCK)

REL_RMS_BOUND = {
    Q.F32: 0.0, Q.F16: 2.6e-4, Q.BF16: 2.1e-3,
    Q.Q8_0: 0.008, Q.Q4_0: 0.12, Q.Q4_1: 0.11, Q.Q5_0: 0.062, Q.Q5_1: 0.055,
    Q.Q2_K: 0.40, Q.Q3_K: 0.19, Q.Q4_K: 0.11, Q.Q5_K: 0.055, Q.Q6_K: 0.026,
    Q.IQ4_NL: 0.105, Q.IQ4_XS: 0.105,
}
"""Relative RMS error of quantize -> dequantize on `varied_rows` input, about 1.2x the typical
value measured for these round-to-nearest quantizers (one bit less would roughly double it)."""

RESOLUTION = {
    Q.F32: 0.0, Q.F16: 2.0**-11, Q.BF16: 2.0**-8,
    Q.Q8_0: 1 / 254, Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 15, Q.Q5_0: 1 / 16, Q.Q5_1: 1 / 31,
    Q.Q2_K: 1 / 3, Q.Q3_K: 1 / 4, Q.Q4_K: 1 / 15, Q.Q5_K: 1 / 31, Q.Q6_K: 1 / 32,
    Q.IQ4_NL: 14 / 127, Q.IQ4_XS: 14 / 127,
}
"""Largest round-to-nearest error of one value relative to the max |x| of its block (of 32 for
the float types): half a code step, or the gap a one-sided code range leaves (Q4_0, Q5_0, Q3_K
give the largest magnitude the code -2^(b-1) and its opposite only 2^(b-1)-1; the IQ4 book ends
at -127 and 113)."""

RESOLUTION_SLACK = 1.5
"""Measured worst cases reach 1.2x RESOLUTION where f16 super-scales and integer sub-scales round
(IQ4_XS); a misplaced code is off by a whole block range."""


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    """Bit-for-bit equality of two float32 arrays."""
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def oracle(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """gguf.quants' decoding of raw bytes, flattened."""
    return gguf.quants.dequantize(raw, qtype).reshape(-1)


def varied_rows(rng: np.random.Generator, rows: int, ne0: int) -> np.ndarray:
    """Gaussian rows whose magnitude changes by up to e^±2 every 16 values, so a sub-block
    scale applied to the wrong sub-block shows up as a large error."""
    gain = np.exp(rng.uniform(-2, 2, size=(rows, ne0 // 16, 1)))
    return (rng.standard_normal((rows, ne0 // 16, 16)) * gain).astype(np.float32).reshape(rows, ne0)


def rel_rms(y: np.ndarray, x: np.ndarray) -> float:
    """||y - x|| / ||x||."""
    return float(np.sqrt(np.mean((y - x) ** 2) / np.mean(x**2)))


def randomize_scales(raw: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    """Overwrite every f16 scale field with random finite f16 values of any sign and magnitude
    (normals, subnormals and zeros), keeping the random codes."""
    blocks = raw.reshape(-1, BLOCK[qtype][1])
    for off in SCALE_FIELDS[qtype]:
        h = rng.integers(0, 1 << 16, size=blocks.shape[0], dtype=np.uint16)
        h[(h & 0x7C00) == 0x7C00] &= 0xBFFF  # inf/NaN exponent -> a finite one
        h[rng.random(blocks.shape[0]) < 0.05] = 0
        blocks[:, off : off + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw


_EXPONENT = {Q.F32: (np.uint32, 0x7F800000, 0x40000000), Q.F16: (np.uint16, 0x7C00, 0x4000),
             Q.BF16: (np.uint16, 0x7F80, 0x4000)}
"""Per float type: storage word, exponent mask, top exponent bit."""


def random_finite_floats(qtype: Q, n: int, rng: np.random.Generator) -> np.ndarray:
    """Raw F32/F16/BF16 bytes with random bit patterns over the whole finite range."""
    dt, mask, top = _EXPONENT[qtype]
    u = rng.integers(0, np.iinfo(dt).max, size=n, dtype=dt, endpoint=True)
    u = np.where((u & mask) == mask, u & dt(~top & np.iinfo(dt).max), u)
    return u.astype(dt).view(np.uint8)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_dequantize_is_gguf(qtype: Q, rng: np.random.Generator) -> None:
    """Bytes of any valid pattern (random codes and scales, any finite float) decode as gguf does."""
    epb = BLOCK[qtype][0]
    n = epb * int(rng.integers(1, 300))
    if qtype in SCALE_FIELDS:
        raw = randomize_scales(random_blocks(qtype, n, rng), qtype, rng)
    else:
        raw = random_finite_floats(qtype, n, rng)
    assert raw.size == row_bytes(qtype, n)
    y = dequantize(raw, qtype, n)
    assert y.dtype == np.float32 and not np.may_share_memory(y, raw) and same_bits(y, oracle(raw, qtype))
    assert same_bits(dequantize(raw.tobytes(), qtype, n), y)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q8_0, Q.F32], ids=lambda q: q.name)
def test_dequantize_across_chunks(qtype: Q, rng: np.random.Generator) -> None:
    n = 256 * int(rng.integers(5000, 9000))
    raw = random_blocks(qtype, n, rng)
    if qtype in SCALE_FIELDS:
        raw = randomize_scales(raw, qtype, rng)
    assert same_bits(dequantize(raw, qtype, n), oracle(raw, qtype))


def test_own_quantizers_are_exactly_those_gguf_lacks() -> None:
    """vkflash encodes a type itself only where gguf.quants cannot: drop ours when gguf gains one."""
    x = np.zeros((2, 256), np.float32)
    for qtype in TYPES:
        if qtype in quantizers.QUANT:
            with pytest.raises(NotImplementedError):
                gguf.quants.quantize(x, qtype)
        else:
            gguf.quants.quantize(x, qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_quantize_roundtrip(qtype: Q, rng: np.random.Generator) -> None:
    """gguf decodes what quantize writes to within the type's resolution, value by value."""
    k = int(rng.integers(1, 4))  # rows of 256·k values, ~9–13k values in all: fewer make the RMS error heavy-tailed
    rows, ne0 = int(rng.integers(36, 52)) // k, 256 * k
    x = varied_rows(rng, rows, ne0)
    raw = quantize(x, qtype)
    assert raw.dtype == np.uint8 and raw.size == rows * row_bytes(qtype, ne0)
    y = oracle(raw, qtype).reshape(x.shape)
    err = rel_rms(y, x)
    assert err <= REL_RMS_BOUND[qtype], f"{qtype.name}: relative RMS error {err:.4g}"
    group = max(BLOCK[qtype][0], 32)
    worst = (np.abs(y - x).reshape(-1, group).max(axis=1) / np.abs(x).reshape(-1, group).max(axis=1)).max()
    assert worst <= RESOLUTION_SLACK * RESOLUTION[qtype], f"{qtype.name}: max error {worst:.4g} of the block max"


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_error_bound_catches_a_wrong_layout(qtype: Q, rng: np.random.Generator) -> None:
    """A decoder that mixes up halves of a block (nibble order, sub-block scales) must fail the
    bound: swap halves of each block (each pair for the float types) and look at the error."""
    x = varied_rows(rng, 8, 512)
    y = oracle(quantize(x, qtype), qtype)
    half = max(BLOCK[qtype][0] // 2, 1)
    wrong = y.reshape(-1, 2, half)[:, ::-1].reshape(x.shape)
    assert rel_rms(wrong, x) > max(2.5 * REL_RMS_BOUND[qtype], 0.5)


def test_error_bound_catches_a_wrong_codebook(rng: np.random.Generator) -> None:
    """Q4_0 and IQ4_NL blocks have the same size; decoding one as the other must fail the bound."""
    x = varied_rows(rng, 8, 256)
    for written, read in [(Q.Q4_0, Q.IQ4_NL), (Q.IQ4_NL, Q.Q4_0)]:
        y = oracle(quantize(x, written), read).reshape(x.shape)
        assert rel_rms(y, x) > 3 * REL_RMS_BOUND[read]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_quantize_zeros_and_ragged_rows(qtype: Q, rng: np.random.Generator) -> None:
    epb = BLOCK[qtype][0]
    ne0 = epb * int(rng.integers(1, 4)) if epb > 1 else int(rng.integers(1, 100))
    shape = (int(rng.integers(1, 4)), int(rng.integers(2, 6)), ne0)
    x = (rng.standard_normal(shape) * np.exp(rng.uniform(-2, 2, shape[:-1] + (1,)))).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero row must give exact zeros, not NaN
    y = oracle(quantize(x, qtype), qtype).reshape(shape)
    assert np.all(y[0, 0] == 0)
    assert rel_rms(y, x) <= 2 * REL_RMS_BOUND[qtype]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_random_blocks_are_small_and_normal(qtype: Q, rng: np.random.Generator) -> None:
    amax = 0.25
    n = BLOCK[qtype][0] * 64
    y = dequantize(random_blocks(qtype, n, rng, amax=amax), qtype, n)
    assert np.all(np.isfinite(y))
    assert amax / 8 < np.abs(y).max() <= 1.5 * amax
    assert np.unique(y).size >= 8 and y.std() > amax / 16  # random codes, not a constant fill
    raw = random_blocks(qtype, n, rng).reshape(-1, BLOCK[qtype][1])
    for off in SCALE_FIELDS.get(qtype, ()):
        d = np.abs(raw[:, off : off + 2].view(np.float16).astype(np.float32))
        assert np.all(d >= 2.0**-14), "scales must be normal f16 (GPUs may flush subnormals)"


def test_large_tensors_are_fast(rng: np.random.Generator) -> None:
    """Vectorised over blocks: 16M Q4_K elements decode, and 64M are generated, in about a
    second on a busy 2-core machine (a per-block Python loop would take minutes)."""
    n = 1 << 24
    t0 = time.perf_counter()
    raw = random_blocks(Q.Q4_K, 4 * n, rng)
    t1 = time.perf_counter()
    dequantize(raw[: row_bytes(Q.Q4_K, n)], Q.Q4_K, n)
    t2 = time.perf_counter()
    assert t1 - t0 < 3.0 and t2 - t1 < 3.0, f"random_blocks {t1 - t0:.2f} s, dequantize {t2 - t1:.2f} s"


@pytest.mark.parametrize("qtype", [Q.Q8_1, Q.IQ2_XXS, Q.I32, 999], ids=str)
def test_unsupported_types_raise(qtype: int) -> None:
    with pytest.raises(FormatError, match="unsupported tensor type"):
        row_bytes(qtype, 256)
    with pytest.raises(FormatError, match="unsupported tensor type"):
        dequantize(np.zeros(1024, np.uint8), qtype, 256)
    with pytest.raises(FormatError, match="unsupported tensor type"):
        quantize(np.zeros(256, np.float32), qtype)


def test_partial_blocks_and_wrong_sizes_raise() -> None:
    with pytest.raises(FormatError, match="multiple of 256"):
        row_bytes(Q.Q4_K, 300)
    with pytest.raises(FormatError, match="rows of a multiple of 32"):
        quantize(np.zeros((32, 48), np.float32), Q.Q8_0)
    with pytest.raises(FormatError, match="need 34 bytes"):
        dequantize(np.zeros(35, np.uint8), Q.Q8_0, 32)
