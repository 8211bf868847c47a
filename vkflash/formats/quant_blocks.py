"""Block geometry of the supported GGML tensor types.

One table every layer shares: which types vkflash handles, their elements and bytes per block
(gguf's GGML_QUANT_SIZES), and where each block keeps its f16 scale fields (used by random_blocks
and by the GPU layer's shader layouts).
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

from vkflash.errors import FormatError

SCALE_FIELDS: dict[Q, tuple[int, ...]] = {
    Q.Q4_0: (0,),
    Q.Q4_1: (0, 2),
    Q.Q5_0: (0,),
    Q.Q5_1: (0, 2),
    Q.Q8_0: (0,),
    Q.Q2_K: (80, 82),
    Q.Q3_K: (108,),
    Q.Q4_K: (0, 2),
    Q.Q5_K: (0, 2),
    Q.Q6_K: (208,),
    Q.IQ4_NL: (0,),
    Q.IQ4_XS: (0,),
}
"""The supported block-quantized types: qtype -> byte offsets of the f16 fields (d, then m/dmin
where present) in each block."""

FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)

BLOCK: dict[Q, tuple[int, int]] = {q: GGML_QUANT_SIZES[q] for q in (*FLOAT_TYPES, *SCALE_FIELDS)}
"""The supported types: qtype -> (elements_per_block, bytes_per_block)."""


def qtype_name(qtype: int) -> str:
    """A readable name for a ggml type id, known or not (for error messages)."""
    try:
        return f"{Q(qtype).name} (id {int(qtype)})"
    except ValueError:
        return f"unknown type id {int(qtype)}"


def as_qtype(qtype: int) -> Q:
    """Check that `qtype` is a type this module supports and return it as the enum."""
    try:
        q = Q(qtype)
    except ValueError:
        raise FormatError(f"unsupported tensor type: {qtype_name(qtype)}") from None
    if q not in BLOCK:
        raise FormatError(f"unsupported tensor type: {qtype_name(qtype)}")
    return q


def row_bytes(qtype: int, n: int) -> int:
    """Bytes taken by `n` consecutive elements of `qtype`; n must be whole blocks."""
    epb, bpb = BLOCK[as_qtype(qtype)]
    if n % epb:
        raise FormatError(f"{Q(qtype).name} needs a multiple of {epb} elements, got {n}")
    return n // epb * bpb
