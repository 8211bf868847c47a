"""Per-sequence caches on the GPU (MODEL.md §6): attention K/V per attention layer, and on QSA
layers the raw indexer keys and the pooled-key summary rows.

Each attention layer has a K and a V cache of [n_ctx, H_kv, Dh] in f16 (default), q8_0 (KV knob)
or f32 (exact comparisons). Rows are written at their positions by kv_append; the valid length
(n_kv) lives in the step-params buffer, so truncating a sequence needs no GPU work.

Every cache buffer is growable (gpu/memory.py): it is sized for n_ctx positions but holds memory
for the first `held` ones, grown in chunks of `chunk(n_ctx)` positions as the context fills
(engine/guard.py), so what a sequence holds at depth t is an allocation the budget can count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from vkflash.errors import ConfigError
from vkflash.gpu.memory import Buffer, buffer_limit, fmt_bytes
from vkflash.gpu.ops.attention import Cache, CacheType
from vkflash.gpu.ops.views import Rows
from vkflash.model.hparams import HParams

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu


def chunk(n_ctx: int) -> int:
    """Positions a cache grows by: a power of two ≥ 64, about n_ctx/32 (8192 at 256k)."""
    return max(64, 1 << max(0, -(-n_ctx // 32) - 1).bit_length())


def held_positions(t: int, n_ctx: int) -> int:
    """Positions a cache holds memory for once it must hold [0, t): t rounded up to whole chunks,
    at least one chunk, at most n_ctx."""
    c = chunk(n_ctx)
    return min(n_ctx, max(c, -(-t // c) * c))


def summary_bytes(positions: int, r: int, dim: int) -> int:
    """Bytes of the f32 summary rows of complete blocks (and one more) for `positions` positions."""
    return 4 * (positions // r + 1) * dim


def cache_type(name: str) -> CacheType:
    """The KV knob value ("f16", "q8_0", or "f32" for exact tests) as a CacheType."""
    try:
        return CacheType(name)
    except ValueError:
        raise ConfigError(f"KV={name!r} is not a cache type; accepted: f16, q8_0, f32") from None


@dataclass(frozen=True)
class LayerKV:
    """The K and V caches of one attention layer."""

    k: Cache
    v: Cache


@dataclass(frozen=True)
class KVCaches:
    """K/V caches of every attention layer, by layer index."""

    n_ctx: int
    type: CacheType
    layers: dict[int, LayerKV]

    def __getitem__(self, layer: int) -> LayerKV:
        return self.layers[layer]

    @property
    def nbytes(self) -> int:
        return sum(kv.k.buf.nbytes + kv.v.buf.nbytes for kv in self.layers.values())


def growable_cache(gpu: "Gpu", n_ctx: int, n_heads: int, dim: int, type: CacheType, held: int, name: str) -> Cache:
    """A cache of n_ctx positions with memory for the first `held`; a ConfigError naming the largest
    CTX that fits when one buffer of n_ctx positions is more than the device can index."""
    nbytes, limit = Cache.nbytes(n_ctx, n_heads, dim, type), buffer_limit(gpu.caps)
    if nbytes > limit:
        hint = " (KV=q8_0 holds about twice as many)" if type is CacheType.F16 else ""
        raise ConfigError(f"CTX {n_ctx}: the cache {name!r} would need {fmt_bytes(nbytes)} in one buffer, more than "
                          f"this device's largest buffer ({fmt_bytes(limit)}): CTX {limit // Cache.nbytes(1, n_heads, dim, type)} "
                          f"at most here{hint}")
    buf = gpu.buffer(nbytes, name, commit=Cache.nbytes(held, n_heads, dim, type))
    return Cache(buf, n_ctx, n_heads, dim, type)


def allocate_kv(gpu: "Gpu", hp: HParams, n_ctx: int, type: CacheType, layers: Iterable[int], held: int) -> KVCaches:
    """K and V caches of n_ctx positions for each attention layer in `layers`, `held` of them backed."""
    if type is CacheType.Q8_0 and hp.Dh % 32:
        raise ConfigError(f"KV=q8_0 needs a head dim that is a multiple of 32, the model has {hp.Dh}")
    out = {i: LayerKV(growable_cache(gpu, n_ctx, hp.H_kv, hp.Dh, type, held, f"blk.{i}.cache_k"),
                      growable_cache(gpu, n_ctx, hp.H_kv, hp.Dh, type, held, f"blk.{i}.cache_v"))
           for i in layers}
    return KVCaches(n_ctx, type, out)


@dataclass(frozen=True)
class IndexerCache:
    """One QSA layer's raw indexer keys ρ ([n_ctx, 1, D_I], the K type) and the f32 summary rows κ_b
    of complete blocks ([⌊n_ctx/r⌋ + 1, D_I]; row b is written once block b completes, and rows past
    the visible blocks are never read, so truncation needs no GPU work)."""

    keys: Cache
    summary: Buffer
    r: int

    @property
    def n_blocks(self) -> int:
        return self.keys.n_ctx // self.r + 1

    def summary_rows(self) -> Rows:
        return Rows(self.summary, self.n_blocks, self.keys.dim)


def allocate_indexer(gpu: "Gpu", hp: HParams, n_ctx: int, type: CacheType, held: int) -> dict[int, IndexerCache]:
    """Indexer caches of every QSA layer (r > 0) of the trunk, `held` positions backed."""
    out: dict[int, IndexerCache] = {}
    for i in range(hp.L):
        r = hp.r[i] if hp.r else 0
        if hp.is_gdn[i] or r == 0:
            continue
        keys = growable_cache(gpu, n_ctx, 1, hp.D_I, type, held, f"blk.{i}.cache_idx")
        summary = gpu.buffer(summary_bytes(n_ctx, r, hp.D_I), f"blk.{i}.qsa_summary",
                             commit=summary_bytes(held, r, hp.D_I))
        out[i] = IndexerCache(keys, summary, r)
    return out
