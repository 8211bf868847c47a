"""Per-sequence caches on the GPU (MODEL.md §6): attention K/V per attention layer, and on QSA
layers the raw indexer keys and the pooled-key summary rows.

Each attention layer has a K and a V cache of [n_ctx, H_kv, Dh] in f16 (default), q8_0 (KV knob)
or f32 (exact comparisons). Rows are written at their positions by kv_append; the valid length
(n_kv) lives in the step-params buffer, so truncating a sequence needs no GPU work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from vkflash.errors import ConfigError
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.attention import Cache, CacheType
from vkflash.gpu.ops.views import Rows
from vkflash.model.hparams import HParams

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu


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


def allocate_kv(gpu: "Gpu", hp: HParams, n_ctx: int, type: CacheType, layers: Iterable[int]) -> KVCaches:
    """K and V caches of n_ctx positions for each attention layer in `layers`."""
    if type is CacheType.Q8_0 and hp.Dh % 32:
        raise ConfigError(f"KV=q8_0 needs a head dim that is a multiple of 32, the model has {hp.Dh}")
    out: dict[int, LayerKV] = {}
    nbytes = Cache.nbytes(n_ctx, hp.H_kv, hp.Dh, type)
    for i in layers:
        k = gpu.buffer(nbytes, f"blk.{i}.cache_k")
        v = gpu.buffer(nbytes, f"blk.{i}.cache_v")
        out[i] = LayerKV(Cache(k, n_ctx, hp.H_kv, hp.Dh, type), Cache(v, n_ctx, hp.H_kv, hp.Dh, type))
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


def allocate_indexer(gpu: "Gpu", hp: HParams, n_ctx: int, type: CacheType) -> dict[int, IndexerCache]:
    """Indexer caches of every QSA layer (r > 0) of the trunk."""
    out: dict[int, IndexerCache] = {}
    for i in range(hp.L):
        r = hp.r[i] if hp.r else 0
        if hp.is_gdn[i] or r == 0:
            continue
        keys = Cache(gpu.buffer(Cache.nbytes(n_ctx, 1, hp.D_I, type), f"blk.{i}.cache_idx"), n_ctx, 1, hp.D_I, type)
        out[i] = IndexerCache(keys, gpu.buffer(4 * (n_ctx // r + 1) * hp.D_I, f"blk.{i}.qsa_summary"), r)
    return out
