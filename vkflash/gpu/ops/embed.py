"""Embedding row gather (MODEL.md §5.1 E1): y[t] = table[ids[t]], decoding quantized rows on the fly.

Token ids are int32 in a buffer (a recorded graph replays with new ids). Table types: F32, F16,
Q8_0, Q4_0, Q5_0, Q4_K, Q6_K, decoded by the element decoders of shaders/common/quant.glsl. An id
outside [0, V) gives a NaN row rather than an out-of-bounds read. `decode_rows` is the same kernel
without ids: raw rows the host staged in order (the PLE rows of qwen4exp) decoded to f32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from gguf import GGMLQuantizationType as Q

from vkflash.formats.quant_blocks import BLOCK, row_bytes
from vkflash.gpu.interface import PushConstants, SpecConstants, boolean, u32
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
    """embed.comp's table type (GGML type id); identity: row t is table row t (no ids)."""

    table_type: u32
    identity: boolean = False


KERNELS = [Kernel("embed", "embed.comp", 3, push=EmbedPush, spec=EmbedSpec)]
TABLE_TYPES = (Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q6_K)
MAX_GROUPS_X = 256  # per token row; the grid-stride loop covers longer rows
MAX_GROUPS_Y = 65535  # tokens; more tokens loop


def embed(g: "Graph", table: Buffer, qtype: int, n_vocab: int, ids: Buffer, n_tokens: int, y: Rows,
          table_off: int = 0, ids_off: int = 0, name: str = "embed") -> None:
    """y[t] = dequant(table row ids[ids_off + t]) for t < n_tokens; d = y.n_cols.

    The table is V rows of d elements of `qtype` starting at byte `table_off` (4-aligned).
    """
    if ids_off < 0 or 4 * (ids_off + n_tokens) > ids.nbytes:
        raise ValueError(f"{name}: {n_tokens} ids at {ids_off} overflow {ids.name or 'the ids'!r} of {ids.nbytes // 4}")
    _gather(g, table, qtype, n_vocab, ids, n_tokens, y, table_off, ids_off, False, name)


def decode_rows(g: "Graph", table: Buffer, qtype: int, y: Rows, table_off: int = 0, name: str = "decode_rows") -> None:
    """y[t] = dequant(row t) of the y.n_rows rows of `qtype` stored in order from byte `table_off`
    (4-aligned) of `table`: rows the host gathered raw, decoded on the device."""
    _gather(g, table, qtype, y.n_rows, table, y.n_rows, y, table_off, 0, True, name)


def _gather(g: "Graph", table: Buffer, qtype: int, n_vocab: int, ids: Buffer, n_tokens: int, y: Rows,
            table_off: int, ids_off: int, identity: bool, name: str) -> None:
    """One embed.comp dispatch (the checks both entry points share)."""
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
    wg = kernel("embed").workgroup(g.gpu.caps)
    g.dispatch("embed", [ids, table, y.buf], [grid(d, wg, MAX_GROUPS_X), min(n_tokens, MAX_GROUPS_Y)],
               push=EmbedPush(d, n_tokens, n_vocab, rb, table_off // 4, ids_off, y.off, y.stride),
               spec=EmbedSpec(qt, identity), name=name, desc=f"{n_tokens}x{d} {qt.name}",
               nbytes=n_tokens * (rb + F32 * d + (0 if identity else 4)))
