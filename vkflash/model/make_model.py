"""Synthetic qwen4exp / qwen3next GGUFs for tests and benchmarks (MODEL.md §9).

`tiny` writes seeded random float weights (F32 by default; F16, Q8_0 or a mixed set) that
llama.cpp loads; `shape-8L` writes the real per-layer shapes with random quant blocks,
streamed to disk in chunks; `shape-48L` is the real model's 48 layers. Weights are deterministic
per (seed, tensor name). Files are written and encoded by vkflash.formats. A `sparse` file has the
header and tensor table only, its data region a hole that reads as zeros: `vkflash plan` reads no
data, so it plans the 48-layer model from such a file without 100 GB of disk.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFValueType as VT

from vkflash.errors import ConfigError
from vkflash.formats.gguf_write import RawTensor, Typed, write_gguf
from vkflash.formats.quants import BLOCK, SCALE_FIELDS, dequantize, quantize, row_bytes
from vkflash.model import ple_hash
from vkflash.model.chat import QWEN3_THINKING_TEMPLATE
from vkflash.model.vocab_build import VocabMeta, qwen3_vocab, tiny_vocab

ARCHS = ("qwen4exp", "qwen3next")
CONFIGS = ("tiny", "shape-8L", "shape-48L")
SHAPE_QUANTS = ("Q4_K_M", "Q8_0")
TINY_QUANTS = ("F32", "F16", "Q8_0", "mix")
VARIANTS = ("tied", "f_array", "hc_norm_2d", "ple_conv_f16", "dense", "tie_stress", "ssm_in")
CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class Geometry:
    """Every size of a generated model (symbols as in MODEL.md §2)."""

    d: int
    V: int
    ctx: int
    L: int
    H: int
    H_kv: int
    Dh: int
    n_rot: int
    theta: float
    n_k: int
    n_v: int
    S: int
    K_c: int
    E: int
    k: int
    F: int
    F_s: int
    interval: int = 4
    eps: float = 1e-6
    sections: tuple[int, ...] = (0, 0, 0, 0)
    hc: int = 0
    lr: int = 0
    n_I: int = 0
    D_I: int = 0
    B: int = 0
    r: int = 0
    ple_layer: int = 1
    N: int = 0
    h_g: int = 0
    D_p: int = 0
    K_p: int = 0
    ple_eos: int = 0
    ple_image: int = 0
    ple_vocab_base: int = 0

    @property
    def C(self) -> int:
        """GDN conv channels 2·n_k·S + n_v·S."""
        return 2 * self.n_k * self.S + self.n_v * self.S

    def is_gdn(self, i: int) -> bool:
        """Layer i < L is GDN iff (i+1) mod I ≠ 0."""
        return i < self.L and (i + 1) % self.interval != 0


GEOMETRIES: dict[tuple[str, str], Geometry] = {
    ("qwen4exp", "tiny"): Geometry(
        d=128, V=512, ctx=4096, L=8, H=6, H_kv=2, Dh=64, n_rot=16, theta=1e7, n_k=2, n_v=6, S=32,
        K_c=4, E=16, k=4, F=64, F_s=64, sections=(3, 3, 2, 0), hc=4, lr=16, n_I=4, D_I=32, B=32,
        r=4, N=3, h_g=2, D_p=32, K_p=4, ple_eos=2, ple_image=3, ple_vocab_base=1009),
    ("qwen4exp", "shape-8L"): Geometry(
        d=2560, V=248320, ctx=262144, L=8, H=24, H_kv=2, Dh=256, n_rot=64, theta=1e7, n_k=16, n_v=48,
        S=128, K_c=4, E=512, k=10, F=640, F_s=640, sections=(11, 11, 10, 0), hc=4, lr=320, n_I=4,
        D_I=128, B=2048, r=4, N=3, h_g=8, D_p=160, K_p=4, ple_eos=248044, ple_image=248056,
        ple_vocab_base=1_000_000),
    ("qwen3next", "tiny"): Geometry(
        d=128, V=512, ctx=4096, L=8, H=6, H_kv=2, Dh=64, n_rot=16, theta=1e7, n_k=2, n_v=6, S=32,
        K_c=4, E=16, k=4, F=64, F_s=64),
    ("qwen3next", "shape-8L"): Geometry(
        d=2048, V=151936, ctx=262144, L=8, H=16, H_kv=2, Dh=256, n_rot=64, theta=1e7, n_k=16, n_v=32,
        S=128, K_c=4, E=512, k=10, F=512, F_s=512),
}
GEOMETRIES.update({(a, "shape-48L"): replace(GEOMETRIES[(a, "shape-8L")], L=48) for a in ARCHS})
# the real PLE table: P_h = the 16 primes after 2·10⁷ (MODEL.md §8), 320,001,536 rows
GEOMETRIES[("qwen4exp", "shape-48L")] = replace(GEOMETRIES[("qwen4exp", "shape-48L")],
                                                ple_vocab_base=20_000_000)


@dataclass
class Tensor:
    """One tensor to write: GGUF name, ggml shape ne (ne0 first), storage type, init rule."""

    name: str
    ne: tuple[int, ...]
    init: str  # "mat" | "gain" | "ssm_norm" | "ssm_a" | "dt_bias" | "ple_conv" | "router" | "embd"
    qtype: QT = QT.F32
    fan_in: int = 0  # for "mat": N(0, 1/√fan_in); default ne0

    @property
    def shape(self) -> tuple[int, ...]:
        """NumPy shape (reversed ne)."""
        return tuple(reversed(self.ne))

    @property
    def n(self) -> int:
        """Element count."""
        return int(np.prod(self.ne))

    @property
    def nbytes(self) -> int:
        """Stored size in bytes."""
        return row_bytes(self.qtype, self.n)


@dataclass
class ModelSpec:
    """Metadata (key → value with its GGUF type) and the ordered tensor list of one file."""

    arch: str
    meta: dict[str, Typed] = field(default_factory=dict)
    tensors: list[Tensor] = field(default_factory=list)

    def kv(self, key: str, value: object, vtype: VT) -> None:
        """Add a metadata key with an explicit GGUF type (for a list, the element type)."""
        self.meta[key] = Typed(value, vtype)

    def add(self, name: str, ne: tuple[int, ...], init: str = "mat", **kw) -> None:
        """Add a tensor."""
        self.tensors.append(Tensor(name, tuple(int(x) for x in ne), init, **kw))


# ---------------------------------------------------------------- tensor tables (MODEL.md §4)

def _wide(g: Geometry, variants: frozenset[str]) -> tuple[int, ...]:
    """ne of a wide (HC) norm gain: {hc·d} or, in variant hc_norm_2d, {d, hc}."""
    return (g.d, g.hc) if "hc_norm_2d" in variants else (g.hc * g.d,)


def _hc_set(s: ModelSpec, p: str, g: Geometry, v: frozenset[str]) -> None:
    """hc_{attn,ffn}_{norm,down,up,inject} of one block."""
    for X in ("attn", "ffn"):
        s.add(f"{p}hc_{X}_norm.weight", _wide(g, v), "gain")
        s.add(f"{p}hc_{X}_down.weight", (g.hc * g.d, g.lr))
        s.add(f"{p}hc_{X}_up.weight", (g.lr, g.hc * g.d))
        s.add(f"{p}hc_{X}_inject.weight", (g.hc * g.d, g.hc))


def _gdn_set(s: ModelSpec, p: str, g: Geometry, arch: str, v: frozenset[str]) -> None:
    """GDN tensors; qwen3next uses ssm_ba and, in variant ssm_in, the legacy fused ssm_in."""
    if arch == "qwen3next" and "ssm_in" in v:
        s.add(f"{p}ssm_in.weight", (g.d, 2 * g.n_k * g.S + 2 * g.n_v * g.S), "ssm_in")
    else:
        s.add(f"{p}attn_qkv.weight", (g.d, g.C))
        s.add(f"{p}attn_gate.weight", (g.d, g.n_v * g.S))
    if arch == "qwen3next":
        s.add(f"{p}ssm_ba.weight", (g.d, 2 * g.n_v), "ssm_ba")
    else:
        s.add(f"{p}ssm_beta.weight", (g.d, g.n_v))
        s.add(f"{p}ssm_alpha.weight", (g.d, g.n_v))
    s.add(f"{p}ssm_conv1d.weight", (g.K_c, g.C))
    s.add(f"{p}ssm_dt.bias", (g.n_v,), "dt_bias")
    s.add(f"{p}ssm_a", (g.n_v,), "ssm_a")
    s.add(f"{p}ssm_norm.weight", (g.S,), "ssm_norm")
    s.add(f"{p}ssm_out.weight", (g.n_v * g.S, g.d))


def _attn_set(s: ModelSpec, p: str, g: Geometry, arch: str) -> None:
    """Gated attention (+ the qwen4exp indexer)."""
    s.add(f"{p}attn_q.weight", (g.d, 2 * g.H * g.Dh))
    s.add(f"{p}attn_k.weight", (g.d, g.H_kv * g.Dh))
    s.add(f"{p}attn_v.weight", (g.d, g.H_kv * g.Dh))
    s.add(f"{p}attn_output.weight", (g.H * g.Dh, g.d))
    s.add(f"{p}attn_q_norm.weight", (g.Dh,), "gain")
    s.add(f"{p}attn_k_norm.weight", (g.Dh,), "gain")
    if arch == "qwen4exp":
        s.add(f"{p}indexer.q_proj.weight", (g.d, g.n_I * g.D_I), "idx_q")
        s.add(f"{p}indexer.k_proj.weight", (g.d, g.D_I), "idx_k")
        s.add(f"{p}indexer.q_norm.weight", (g.D_I,), "gain")
        s.add(f"{p}indexer.k_norm.weight", (g.D_I,), "gain")


def _moe_set(s: ModelSpec, p: str, g: Geometry) -> None:
    """Router, routed experts and the gated shared expert."""
    s.add(f"{p}ffn_gate_inp.weight", (g.d, g.E), "router")
    s.add(f"{p}ffn_gate_exps.weight", (g.d, g.F, g.E))
    s.add(f"{p}ffn_up_exps.weight", (g.d, g.F, g.E))
    s.add(f"{p}ffn_down_exps.weight", (g.F, g.d, g.E))
    s.add(f"{p}ffn_gate_inp_shexp.weight", (g.d,), "mat", fan_in=g.d)
    s.add(f"{p}ffn_gate_shexp.weight", (g.d, g.F_s))
    s.add(f"{p}ffn_up_shexp.weight", (g.d, g.F_s))
    s.add(f"{p}ffn_down_shexp.weight", (g.F_s, g.d))


def _ple_set(s: ModelSpec, p: str, g: Geometry, v: frozenset[str]) -> None:
    """The PLE projections of the PLE layer."""
    s.add(f"{p}ple_key.weight", (g.d, g.hc * g.d))
    s.add(f"{p}ple_value.weight", (g.d, g.d))
    for n in ("key", "query", "conv"):
        s.add(f"{p}ple_norm_{n}.weight", _wide(g, v), "gain")
    s.add(f"{p}ple_conv1d.weight", (g.K_p, g.hc * g.d), "ple_conv",
          qtype=QT.F16 if "ple_conv_f16" in v else QT.F32)


def _ple_params(g: Geometry) -> ple_hash.PleHashParams:
    """PLE constants from the HF derivation (seed 1234, PLE index 0)."""
    return ple_hash.make_params(g.V, g.N, g.h_g, g.ple_eos, g.ple_vocab_base)


def trunk_spec(arch: str, g: Geometry, v: frozenset[str]) -> ModelSpec:
    """Tensors of the trunk file (stock layout: block_count = L, no MTP)."""
    s = ModelSpec(arch)
    s.add("token_embd.weight", (g.d, g.V), "embd")
    if "tied" not in v:
        s.add("output.weight", (g.d, g.V))
    if arch == "qwen4exp":
        s.add("output_hc_norm.weight", _wide(g, v), "gain")
        s.add("output_hc_down.weight", (g.hc * g.d, g.lr))
        s.add("output_hc_up.weight", (g.lr, g.hc * g.d))
        hp = _ple_params(g)
        rows = -(-int(hp.head_offsets[-1] + hp.head_vocab_sizes[-1]) // 128) * 128  # HF pads to 128
        s.add("per_layer_token_embd.weight", (g.D_p, rows), "mat", fan_in=g.D_p)
    else:
        s.add("output_norm.weight", (g.d,), "gain")
    for i in range(g.L):
        p = f"blk.{i}."
        if arch == "qwen4exp":
            _hc_set(s, p, g, v)
            if i == g.ple_layer:
                _ple_set(s, p, g, v)
        else:
            s.add(f"{p}attn_norm.weight", (g.d,), "gain")
            s.add(f"{p}post_attention_norm.weight", (g.d,), "gain")
        if g.is_gdn(i):
            _gdn_set(s, p, g, arch, v)
        else:
            _attn_set(s, p, g, arch)
        _moe_set(s, p, g)
    return s


def mtp_spec(g: Geometry, v: frozenset[str]) -> ModelSpec:
    """Tensors of the qwen4exp MTP-only file: block L (HC, attention incl. indexer, MoE, nextn.*)."""
    s = ModelSpec("qwen4exp")
    p = f"blk.{g.L}."
    _hc_set(s, p, g, v)
    _attn_set(s, p, g, "qwen4exp")
    _moe_set(s, p, g)
    s.add(f"{p}nextn.enorm.weight", (g.d,), "gain")
    s.add(f"{p}nextn.hnorm.weight", _wide(g, v), "gain")
    s.add(f"{p}nextn.eh_proj.weight", (2 * g.d, g.d))
    s.add(f"{p}nextn.hc_head_norm.weight", _wide(g, v), "gain")
    s.add(f"{p}nextn.hc_head_down.weight", (g.hc * g.d, g.lr))
    s.add(f"{p}nextn.hc_head_up.weight", (g.lr, g.hc * g.d))
    return s


# ---------------------------------------------------------------- metadata (MODEL.md §3)

def _hparams_meta(s: ModelSpec, g: Geometry, v: frozenset[str], mtp: bool, mtp_only: bool = False) -> None:
    """All arch keys with the exact GGUF types of §3 (`mtp`: block_count counts the MTP block;
    `mtp_only`: an MTP-only file, without PLE keys)."""
    A, u32 = s.arch, VT.UINT32
    L_all = g.L + (1 if mtp else 0)
    s.kv("general.name", f"vkflash synthetic {s.arch}", VT.STRING)
    for key, val in (("context_length", g.ctx), ("embedding_length", g.d), ("block_count", L_all),
                     ("vocab_size", g.V), ("expert_count", g.E), ("expert_used_count", g.k),
                     ("expert_shared_feed_forward_length", g.F_s), ("attention.head_count", g.H),
                     ("attention.head_count_kv", g.H_kv), ("attention.key_length", g.Dh),
                     ("attention.value_length", g.Dh), ("rope.dimension_count", g.n_rot),
                     ("ssm.conv_kernel", g.K_c), ("ssm.state_size", g.S), ("ssm.group_count", g.n_k),
                     ("ssm.time_step_rank", g.n_v), ("ssm.inner_size", g.n_v * g.S),
                     ("full_attention_interval", g.interval)):
        s.kv(f"{A}.{key}", val, u32)
    if "f_array" in v:
        s.kv(f"{A}.expert_feed_forward_length", [g.F] * L_all, u32)
    else:
        s.kv(f"{A}.expert_feed_forward_length", g.F, u32)
    s.kv(f"{A}.attention.layer_norm_rms_epsilon", g.eps, VT.FLOAT32)
    s.kv(f"{A}.rope.freq_base", g.theta, VT.FLOAT32)
    if mtp:
        s.kv(f"{A}.nextn_predict_layers", 1, u32)
    if A != "qwen4exp":
        return
    s.kv(f"{A}.rope.dimension_sections", list(g.sections), VT.INT32)
    s.kv(f"{A}.hyper_connection.count", g.hc, u32)
    s.kv(f"{A}.hyper_connection.low_rank", g.lr, u32)
    s.kv(f"{A}.attention.indexer.head_count", g.n_I, u32)
    s.kv(f"{A}.attention.indexer.key_length", g.D_I, u32)
    s.kv(f"{A}.attention.indexer.top_k", g.B, u32)
    r = 0 if "dense" in v else g.r
    ratios = [0 if g.is_gdn(i) or i >= g.L else r for i in range(L_all)]
    s.kv(f"{A}.attention.compress_ratios", ratios, VT.INT32)
    if mtp_only:
        return  # an MTP-only file carries no PLE keys
    hp = _ple_params(g)
    s.kv(f"{A}.ple.layers", [g.ple_layer], VT.INT32)
    for key, val in (("ple.ngram_size", g.N), ("ple.heads_per_ngram", g.h_g), ("ple.conv_kernel", g.K_p),
                     ("embedding_length_per_layer_input", g.D_p), ("ple.eos_token_id", g.ple_eos),
                     ("ple.image_token_id", g.ple_image)):
        s.kv(f"{A}.{key}", val, u32)
    for key, arr in (("ple.layer_multipliers", hp.multipliers), ("ple.head_offsets", hp.head_offsets),
                     ("ple.head_vocab_sizes", hp.head_vocab_sizes)):
        s.kv(f"{A}.{key}", [int(x) for x in arr], VT.UINT64)


def _tokenizer_meta(s: ModelSpec, vm: VocabMeta) -> None:
    """tokenizer.ggml.* keys and the chat template."""
    s.kv("tokenizer.ggml.model", "gpt2", VT.STRING)
    s.kv("tokenizer.ggml.pre", vm.pre, VT.STRING)
    s.kv("tokenizer.ggml.tokens", vm.tokens, VT.STRING)
    s.kv("tokenizer.ggml.token_type", vm.token_types, VT.INT32)
    s.kv("tokenizer.ggml.merges", vm.merges, VT.STRING)
    s.kv("tokenizer.ggml.bos_token_id", vm.bos_id, VT.UINT32)
    s.kv("tokenizer.ggml.eos_token_id", vm.eos_id, VT.UINT32)
    s.kv("tokenizer.ggml.padding_token_id", vm.pad_id, VT.UINT32)
    s.kv("tokenizer.ggml.add_bos_token", False, VT.BOOL)
    s.kv("tokenizer.chat_template", QWEN3_THINKING_TEMPLATE, VT.STRING)


# ---------------------------------------------------------------- storage types

def _k_or(qt: QT, ne0: int) -> QT:
    """K-quants need ne0 % 256 = 0: else Q4_K → Q5_0, Q5_K → Q5_0, Q6_K → Q8_0 (§8)."""
    if qt in (QT.Q4_K, QT.Q5_K, QT.Q6_K) and ne0 % 256:
        return QT.Q8_0 if qt == QT.Q6_K else QT.Q5_0
    return qt


def shape8l_type(t: Tensor, quant: str = "Q4_K_M") -> QT:
    """§9 shape-8L types: 1-D, routers, inject, convs F32; PLE table Q4_0; else Q4_K-family
    (quant Q8_0: every quantized tensor Q8_0)."""
    name = t.name
    if t.qtype != QT.F32:
        return t.qtype  # explicit (variant ple_conv_f16)
    if len(t.ne) == 1 or t.init in ("router", "ple_conv") or "inject" in name or "conv1d" in name:
        return QT.F32
    if name.endswith("_norm.weight") or ".enorm" in name or ".hnorm" in name:
        return QT.F32
    if quant == "Q8_0":
        return QT.Q8_0
    if name == "per_layer_token_embd.weight":
        return QT.Q4_0
    if "ffn_down" in name:
        return _k_or(QT.Q5_0, t.ne[0])
    if name == "output.weight" or "attn_v." in name:
        return _k_or(QT.Q6_K, t.ne[0])
    if "attn_qkv" in name or "ssm_in" in name:
        return _k_or(QT.Q5_K, t.ne[0])
    return _k_or(QT.Q4_K, t.ne[0])


def tiny_type(t: Tensor, quant: str) -> QT:
    """Storage type of a tiny-model tensor for --quant F32 | F16 | Q8_0 | mix."""
    if t.qtype != QT.F32 or len(t.ne) == 1 or t.init in ("gain", "router"):
        return t.qtype  # explicit (F16 ple_conv1d), 1-D and routers stay as they are
    blk32 = t.ne[0] % 32 == 0 and "conv1d" not in t.name and "inject" not in t.name
    if quant == "F32":
        return QT.F32
    if quant == "F16":
        return QT.F16
    if quant == "Q8_0":
        return QT.Q8_0 if blk32 else QT.F32
    if not blk32:  # mix
        return QT.F32
    if "ffn_gate_exps" in t.name or "ffn_up_exps" in t.name or t.name == "per_layer_token_embd.weight":
        return QT.Q4_0
    if "ffn_down" in t.name:
        return QT.Q5_0
    if t.name == "token_embd.weight":
        return QT.F16
    return QT.Q8_0


# ---------------------------------------------------------------- weight values

def _rng(seed: int, name: str) -> np.random.Generator:
    """Per-tensor generator: the same (seed, name) gives the same weights in every variant."""
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


@dataclass(frozen=True)
class Rank1:
    """The indexer trick of §9: b (unit, R^d) added 6× to embeddings, 0.5·a·bᵀ on W_Iq/W_Ik."""

    a: np.ndarray
    b: np.ndarray

    @classmethod
    def make(cls, seed: int, g: Geometry) -> "Rank1":
        """a is unit and supported on the un-rotated indexer dims n_rot..D_I−1."""
        r = _rng(seed, "#indexer-rank1")
        a = np.zeros(g.D_I)
        a[g.n_rot:] = r.standard_normal(g.D_I - g.n_rot)
        b = r.standard_normal(g.d)
        return cls(a / np.linalg.norm(a), b / np.linalg.norm(b))


def float_values(t: Tensor, seed: int, g: Geometry, rank1: Rank1 | None) -> np.ndarray:
    """float32 values (NumPy shape) of a tiny-model tensor per the §9 init rules."""
    r = _rng(seed, t.name)
    shape = t.shape
    if t.init == "gain":
        return (1 + r.uniform(-0.1, 0.1, shape)).astype(np.float32)
    if t.init == "ssm_norm":
        return r.uniform(0.9, 1.1, shape).astype(np.float32)
    if t.init == "ssm_a":
        return (-r.uniform(0.05, 1.0, shape)).astype(np.float32)
    if t.init == "dt_bias":
        return (1 + r.uniform(-0.5, 0.5, shape)).astype(np.float32)
    if t.init == "ple_conv":
        return (0.3 * r.standard_normal(shape)).astype(np.float32)
    if t.init == "ssm_in":
        return _ssm_in_values(t, seed, g)
    if t.init == "ssm_ba":
        return _ssm_ba_values(t, seed, g)
    w = r.standard_normal(shape) / np.sqrt(t.fan_in or t.ne[0])
    if t.init == "router":
        w *= 4
    elif t.init == "embd" and rank1 is not None:
        w += 6 * rank1.b[None, :]
    elif t.init == "idx_q" and rank1 is not None:
        w = w.reshape(g.n_I, g.D_I, g.d) + 0.5 * np.outer(rank1.a, rank1.b)[None]
        w = w.reshape(shape)
    elif t.init == "idx_k" and rank1 is not None:
        w += 0.5 * np.outer(rank1.a, rank1.b)
    return w.astype(np.float32)


def _named_mat(seed: int, name: str, rows: int, cols: int) -> np.ndarray:
    """N(0, 1/√cols) matrix (rows, cols) from the named generator (as a {cols, rows} tensor)."""
    return _rng(seed, name).standard_normal((rows, cols)) / np.sqrt(cols)


def _ssm_in_values(t: Tensor, seed: int, g: Geometry) -> np.ndarray:
    """Legacy qwen3next ssm_in built from the attn_qkv/attn_gate weights of the same layer, so
    both layouts are the same model: group j rows = [q_j | k_j | v_j (ρS) | z_j (ρS)]."""
    p = t.name[: -len("ssm_in.weight")]
    qkv = _named_mat(seed, p + "attn_qkv.weight", g.C, g.d)
    z = _named_mat(seed, p + "attn_gate.weight", g.n_v * g.S, g.d)
    kS, rho = g.n_k * g.S, g.n_v // g.n_k
    q, k, v = qkv[:kS], qkv[kS:2 * kS], qkv[2 * kS:]
    groups = []
    for j in range(g.n_k):
        vs = slice(j * rho * g.S, (j + 1) * rho * g.S)
        groups += [q[j * g.S:(j + 1) * g.S], k[j * g.S:(j + 1) * g.S], v[vs], z[vs]]
    return np.concatenate(groups).astype(np.float32)


def _ssm_ba_values(t: Tensor, seed: int, g: Geometry) -> np.ndarray:
    """qwen3next ssm_ba from separate β and α matrices: group j rows = [b (ρ rows) | a (ρ rows)]."""
    p = t.name[: -len("ssm_ba.weight")]
    b = _named_mat(seed, p + "ssm_beta.weight", g.n_v, g.d)
    a = _named_mat(seed, p + "ssm_alpha.weight", g.n_v, g.d)
    rho = g.n_v // g.n_k
    out = np.stack([b.reshape(g.n_k, rho, g.d), a.reshape(g.n_k, rho, g.d)], axis=1)
    return out.reshape(2 * g.n_v, g.d).astype(np.float32)


# ---------------------------------------------------------------- random quant blocks (shape-8L)

_unit_cache: dict[QT, tuple[float, float]] = {}


def _unit_scales(qt: QT) -> tuple[float, float]:
    """(d, dmin) for random codes so that dequantized values have mean ≈ 0 and std 1."""
    if qt in _unit_cache:
        return _unit_cache[qt]
    bs, ts = BLOCK[qt]
    raw = np.random.default_rng(0).integers(0, 256, (4096, ts), dtype=np.uint8)
    fields = SCALE_FIELDS[qt]  # (d,) or (d, dmin)

    def deq(d: float, dmin: float) -> np.ndarray:
        b = raw.copy()
        for off, value in zip(fields, (d, dmin)):
            b[:, off:off + 2] = np.array([value], np.float16).view(np.uint8)
        return dequantize(b, qt, b.shape[0] * bs).astype(np.float64)

    ratio = -deq(1, 0).mean() / deq(0, 1).mean() if len(fields) > 1 else 0.0  # deq(0, 1) = −dmin·m
    v = deq(1, ratio)
    _unit_cache[qt] = (1 / v.std(), ratio / v.std())
    return _unit_cache[qt]


def random_block_chunks(t: Tensor, seed: int) -> Iterator[np.ndarray]:
    """Random codes with fixed f16 scales giving std ≈ 1/√fan_in, in ≤ 64 MiB uint8 chunks."""
    bs, ts = BLOCK[t.qtype]
    n_blocks = t.n // bs
    d, dmin = _unit_scales(t.qtype)
    target = 1 / np.sqrt(t.fan_in or t.ne[0])
    scales = [(off, np.array([value * target], np.float16).view(np.uint8))
              for off, value in zip(SCALE_FIELDS[t.qtype], (d, dmin))]
    bitgen = np.random.PCG64([seed, zlib.crc32(t.name.encode())])
    per = max(1, CHUNK_BYTES // ts)
    for start in range(0, n_blocks, per):
        nb = min(per, n_blocks - start)
        words = -(-nb * ts // 8)
        b = bitgen.random_raw(words).view(np.uint8)[: nb * ts].reshape(nb, ts)
        for off, h in scales:
            b[:, off:off + 2] = h
        yield b


# ---------------------------------------------------------------- writing

def _write(path: Path, spec: ModelSpec, chunks: Callable[[Tensor], Iterator[np.ndarray]], sparse: bool = False) -> Path:
    """Write spec to path, streaming each tensor's bytes from chunks(t) (never all in RAM); sparse:
    the data a hole (formats.gguf_write)."""
    tensors = {t.name: RawTensor(lambda t=t: chunks(t), t.qtype, t.ne) for t in spec.tensors}
    write_gguf(path, spec.arch, spec.meta, tensors, sparse=sparse)
    return path


def _variants(variant: str | tuple[str, ...] | frozenset[str] | None) -> frozenset[str]:
    """Parse 'a,b' / iterable variant names, rejecting unknown ones."""
    if not variant:
        return frozenset()
    names = frozenset(variant.split(",") if isinstance(variant, str) else variant) - {""}
    bad = sorted(names - set(VARIANTS))
    if bad:
        raise ConfigError(f"unknown model variant(s) {', '.join(bad)}; known: {', '.join(VARIANTS)}")
    return names


def make_model(arch: str, config: str, quant: str | None, seed: int, out: str | Path,
               mtp_separate: bool = False, variant: str | tuple[str, ...] | None = None,
               sparse: bool = False, mtp_block: bool = False) -> list[Path]:
    """Write a synthetic model (and, with mtp_separate, its MTP-only file `<out>-mtp.gguf`; with
    mtp_block, the MTP block in the model file itself: block_count L + 1, which only vkflash loads).

    Returns the written paths. tiny: quant ∈ F32 (default) | F16 | Q8_0 | mix; shape configs:
    the §9 types (quant None or "Q4_K_M"), or "Q8_0" for every quantized tensor. sparse: header
    and tensor table only (see the module docstring).
    """
    if arch not in ARCHS:
        raise ConfigError(f"--arch must be one of {', '.join(ARCHS)}, not {arch!r}")
    if config not in CONFIGS:
        raise ConfigError(f"--config must be one of {', '.join(CONFIGS)}, not {config!r}")
    v = _variants(variant)
    if arch == "qwen3next" and (v & {"hc_norm_2d", "ple_conv_f16", "dense", "tie_stress"} or mtp_separate
                                or mtp_block):
        raise ConfigError("qwen3next has no HC, PLE, QSA or MTP: drop those variants / --mtp-separate / --mtp")
    if arch == "qwen4exp" and "ssm_in" in v:
        raise ConfigError("the ssm_in variant is qwen3next-only")
    g = GEOMETRIES[(arch, config)]
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tiny = config == "tiny"
    if tiny:
        quant = quant or "F32"
        if quant not in TINY_QUANTS:
            raise ConfigError(f"--quant for tiny must be one of {', '.join(TINY_QUANTS)}, not {quant!r}")
        vm = tiny_vocab(g.V)
    else:
        quant = quant or "Q4_K_M"
        if quant not in SHAPE_QUANTS:
            raise ConfigError(f"--quant for {config} must be one of {', '.join(SHAPE_QUANTS)} (the §9 mix, or all "
                              f"quantized tensors Q8_0), not {quant!r}")
        vm = qwen3_vocab(g.V)
    rank1 = Rank1.make(seed, g) if arch == "qwen4exp" and "tie_stress" not in v else None

    def typed(spec: ModelSpec) -> ModelSpec:
        spec.tensors = [replace(t, qtype=tiny_type(t, quant) if tiny else shape8l_type(t, quant)) for t in spec.tensors]
        return spec

    def chunks(t: Tensor) -> Iterator[np.ndarray]:
        if t.qtype in SCALE_FIELDS and not tiny:
            yield from random_block_chunks(t, seed)
        else:
            yield quantize(float_values(t, seed, g, rank1), t.qtype)

    spec = typed(trunk_spec(arch, g, v))
    if mtp_block:
        spec.tensors += typed(mtp_spec(g, v)).tensors
    _hparams_meta(spec, g, v, mtp=mtp_block)
    _tokenizer_meta(spec, vm)
    paths = [_write(out, spec, chunks, sparse)]
    if mtp_separate:
        mspec = typed(mtp_spec(g, v))
        _hparams_meta(mspec, g, v, mtp=True, mtp_only=True)
        _tokenizer_meta(mspec, vm)
        paths.append(_write(out.with_name(out.stem + "-mtp" + out.suffix), mspec, chunks, sparse))
    return paths
