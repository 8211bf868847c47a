"""Embedding row gather (MODEL.md §5.1 E1): y[t] = table[ids[t]], decoding quantized rows on the fly.

Token ids are int32 in a buffer (a recorded graph replays with new ids). Table types: F32, F16,
Q8_0, Q4_K, Q6_K, decoded by the element decoders of shaders/common/quant.glsl. An id outside
[0, V) gives a NaN row rather than an out-of-bounds read.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gguf import GGMLQuantizationType as Q

from vkflash.formats.quant_blocks import BLOCK, row_bytes
from vkflash.gpu.interface import PushConstants, SpecConstants, u32
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.views import F32, Rows, grid
from vkflash.gpu.registry import Kernel, kernel

if TYPE_CHECKING:
    from vkflash.gpu.graph import Graph


@dataclass(frozen=True)
class EmbedPush(PushConstants):
    """embed.comp's push constants: row length, tokens, the table (rows, row bytes, word offset), ids and y."""

    d: u32
    n_tokens: u32
    n_vocab: u32
    row_bytes: u32
    table_off: u32
    ids_off: u32
    y_off: u32
    y_stride: u32


@dataclass(frozen=True)
class EmbedSpec(SpecConstants):
    """embed.comp's table type (GGML type id)."""

    table_type: u32


KERNELS = [Kernel("embed", "embed.comp", 3, push=EmbedPush, spec=EmbedSpec)]
TABLE_TYPES = (Q.F32, Q.F16, Q.Q8_0, Q.Q4_K, Q.Q6_K)
MAX_GROUPS_X = 256  # per token row; the grid-stride loop covers longer rows
MAX_GROUPS_Y = 65535  # tokens; more tokens loop


def embed(g: "Graph", table: Buffer, qtype: int, n_vocab: int, ids: Buffer, n_tokens: int, y: Rows,
          table_off: int = 0, ids_off: int = 0, name: str = "embed") -> None:
    """y[t] = dequant(table row ids[ids_off + t]) for t < n_tokens; d = y.n_cols.

    The table is V rows of d elements of `qtype` starting at byte `table_off` (4-aligned).
    """
    if qtype not in TABLE_TYPES:
        raise ValueError(f"{name}: table type {qtype} not supported (only {', '.join(t.name for t in TABLE_TYPES)})")
    qt = Q(qtype)
    d = y.n_cols
    if d % BLOCK[qt][0]:
        raise ValueError(f"{name}: row length {d} is not whole {qt.name} blocks of {BLOCK[qt][0]}")
    if n_vocab < 1 or n_tokens < 1 or y.n_rows != n_tokens:
        raise ValueError(f"{name}: V={n_vocab}, {n_tokens} tokens, output of {y.n_rows} rows")
    rb = row_bytes(qt, d)
    if table_off < 0 or table_off % 4 or table_off + n_vocab * rb > table.nbytes:
        raise ValueError(f"{name}: {n_vocab} rows of {rb} B at byte {table_off} (must be 4-aligned) do not fit "
                         f"{table.name or 'the table'!r} of {table.nbytes} B")
    if ids_off < 0 or 4 * (ids_off + n_tokens) > ids.nbytes:
        raise ValueError(f"{name}: {n_tokens} ids at {ids_off} overflow {ids.name or 'the ids'!r} of {ids.nbytes // 4}")
    wg = kernel("embed").workgroup(g.gpu.caps)
    g.dispatch("embed", [ids, table, y.buf], [grid(d, wg, MAX_GROUPS_X), min(n_tokens, MAX_GROUPS_Y)],
               push=EmbedPush(d, n_tokens, n_vocab, rb, table_off // 4, ids_off, y.off, y.stride), spec=EmbedSpec(qt),
               name=name, desc=f"{n_tokens}x{d} {qt.name}", nbytes=n_tokens * (rb + F32 * d + 4))
