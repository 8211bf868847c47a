"""Hyper-parameters of a GGUF model, read and validated exactly as MODEL.md §3 says.

`hparams_from_gguf` turns typed GGUF metadata into one `HParams`; every rejection is a single
`ModelError` line naming the offending key, so a user sees at once what is wrong with a file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from vkflash.errors import ModelError

SUPPORTED_ARCHS = ("qwen4exp", "qwen3next", "qwen2")

_MAX_PLE_HEADS = 64
_MAX_NGRAM = 8
_MAX_COMPRESS_RATIO = 64
_INT32_MAX = 2**31 - 1
_MAX_LAYERS = 512  # llama.cpp's LLAMA_MAX_LAYERS; per-layer tuples are built before any tensor is seen


@dataclass(frozen=True)
class Metadata:
    """GGUF key/value metadata with its stored types: key -> (type, value).

    Types are 'u32', 'i32', 'f32', 'u64', 'bool', 'str', … and 'arr[<elem>]' for arrays; array
    values are NumPy arrays (u64 kept as uint64) or, for strings, lists of str.
    """

    arch: str
    kv: Mapping[str, tuple[str, Any]]

    def type_of(self, key: str) -> str | None:
        """Stored type of `key`, or None when absent."""
        item = self.kv.get(key)
        return None if item is None else item[0]

    def value(self, key: str) -> Any:
        """Stored value of `key` (the key must exist)."""
        return self.kv[key][1]


@dataclass(frozen=True)
class HParams:
    """Every hyper-parameter the reference and the engine need, named as in MODEL.md §2."""

    arch: str
    n_ctx_train: int  # context_length
    d: int  # d, embedding_length
    V: int  # V, vocabulary size
    L_all: int  # L_all, block_count (includes MTP blocks)
    n_mtp: int  # n_mtp, nextn_predict_layers
    H: int  # H, q heads
    H_kv: int  # H_kv, kv heads
    Dh: int  # Dh, head dim
    n_rot: int  # n_rot, rotary dims
    theta: float  # θ, rope base
    eps: float  # ε, layer_norm_rms_epsilon (every norm)
    is_gdn: tuple[bool, ...]  # per layer (L_all entries): GDN or attention
    # MoE (qwen4exp, qwen3next)
    E: int = 0  # E, experts
    k: int = 0  # k, experts used
    F: int = 0  # F, expert FFN
    F_s: int = 0  # F_s, shared-expert FFN
    # dense FFN (qwen2)
    F_dense: int = 0  # feed_forward_length
    # GDN
    K_c: int = 0  # K_c, conv kernel
    S: int = 0  # S, GDN head dim
    n_k: int = 0  # n_k, GDN key heads
    n_v: int = 0  # n_v, GDN value heads
    # qwen4exp: IMRoPE sections, hyper-connections, QSA indexer
    sections: tuple[int, ...] = ()  # IMRoPE sections (text: irrelevant, validated)
    hc: int = 0  # hc, HC streams
    lr: int = 0  # lr, HC low rank
    n_I: int = 0  # n_I, indexer heads
    D_I: int = 0  # D_I, indexer head dim
    B: int = 0  # B, QSA token budget
    r: tuple[int, ...] = ()  # r_l per layer (L_all entries), 0 = dense
    # PLE (qwen4exp)
    ple_layer: int | None = None  # the single PLE layer, 0-based
    N: int = 0  # N, n-gram size (also the PLE conv dilation)
    h_g: int = 0  # h_g, heads per n-gram
    K_p: int = 0  # K_p, PLE conv kernel
    D_p: int = 0  # D_p, PLE row dim
    ple_eos: int = 0  # n-gram reset token
    ple_image: int = 0  # token hashed at embedding-only positions
    ple_mult: tuple[int, ...] = ()  # m_0..m_{N-1}
    ple_offsets: tuple[int, ...] = ()  # o_h
    ple_sizes: tuple[int, ...] = ()  # P_h

    @property
    def L(self) -> int:
        """L, the trunk layers (L_all − n_mtp)."""
        return self.L_all - self.n_mtp

    @property
    def rho(self) -> int:
        """ρ = n_v / n_k, value heads per key head."""
        return self.n_v // self.n_k

    @property
    def C(self) -> int:
        """C = 2·n_k·S + n_v·S, GDN conv channels."""
        return 2 * self.n_k * self.S + self.n_v * self.S

    @property
    def n_p(self) -> int:
        """n_p = (N−1)·h_g, PLE heads."""
        return (self.N - 1) * self.h_g

    @property
    def has_ple(self) -> bool:
        """True when the model has a PLE layer."""
        return self.ple_layer is not None

    def kb(self, layer: int) -> int:
        """kb = B / r, the blocks kept on a QSA layer."""
        return self.B // self.r[layer]

    def W(self, layer: int) -> int:
        """W = B + r − 1, the cell width of a QSA layer."""
        return self.B + self.r[layer] - 1


class _Reader:
    """Typed access to one arch's keys; every failure names the key."""

    def __init__(self, meta: Metadata):
        self.meta = meta
        self.arch = meta.arch

    def key(self, suffix: str) -> str:
        return f"{self.arch}.{suffix}"

    def has(self, suffix: str) -> bool:
        return self.meta.type_of(self.key(suffix)) is not None

    def u32(self, suffix: str, default: int | None = None, *, nz: bool = False) -> int:
        """A u32 scalar; absent → default (None = required); nz rejects 0."""
        key = self.key(suffix)
        typ = self.meta.type_of(key)
        if typ is None:
            if default is None:
                raise ModelError(f"missing required key {key}")
            value = default
        else:
            if typ != "u32":
                raise ModelError(f"key {key} must be u32, found {typ}")
            value = int(self.meta.value(key))
        if nz and value == 0:
            raise ModelError(f"key {key} must be non-zero")
        return value

    def f32(self, suffix: str, default: float | None = None) -> float:
        """An f32 scalar; absent → default (None = required)."""
        key = self.key(suffix)
        typ = self.meta.type_of(key)
        if typ is None:
            if default is None:
                raise ModelError(f"missing required key {key}")
            return default
        if typ != "f32":
            raise ModelError(f"key {key} must be f32, found {typ}")
        return float(np.float32(self.meta.value(key)))

    def positive_f32(self, suffix: str, default: float | None = None) -> float:
        """An f32 scalar that must be finite and > 0 (a NaN ε or θ only shows as garbage output)."""
        value = self.f32(suffix, default)
        if not (np.isfinite(value) and value > 0):
            raise ModelError(f"key {self.key(suffix)} = {value} must be finite and > 0")
        return value

    def int_array(self, suffix: str, elem_types: tuple[str, ...]) -> np.ndarray | None:
        """An integer array whose element type is one of elem_types, or None when absent."""
        key = self.key(suffix)
        typ = self.meta.type_of(key)
        if typ is None:
            return None
        if not typ.startswith("arr[") or typ[4:-1] not in elem_types:
            raise ModelError(f"key {key} must be an array of {'/'.join(elem_types)}, found {typ}")
        return np.asarray(self.meta.value(key))

    def per_layer_u32(self, suffix: str, L_all: int, default: int | None) -> tuple[int, ...]:
        """A u32 scalar broadcast to L_all layers, or a u32/i32 array of exactly L_all entries."""
        key = self.key(suffix)
        typ = self.meta.type_of(key)
        if typ is not None and typ.startswith("arr["):
            arr = self.int_array(suffix, ("u32", "i32"))
            assert arr is not None
            if len(arr) != L_all:
                raise ModelError(f"key {key} has {len(arr)} entries, expected exactly {L_all} (block_count)")
            if (arr < 0).any():
                raise ModelError(f"key {key} has a negative entry")
            return tuple(int(v) for v in arr)
        return (self.u32(suffix, default),) * L_all


def _uniform(values: tuple[int, ...], key: str) -> int:
    """The single value of a per-layer array that must be uniform."""
    if len(set(values)) != 1:
        raise ModelError(f"key {key} has unequal per-layer entries {sorted(set(values))}; only uniform values are supported")
    return values[0]


def _reject_rope_scaling(rd: _Reader) -> None:
    """Any rope scaling is rejected (MODEL.md §3)."""
    key = rd.key("rope.scaling.type")
    typ = rd.meta.type_of(key)
    if typ is not None and (typ != "str" or rd.meta.value(key) not in ("none", "")):
        raise ModelError(f"key {key} = {rd.meta.value(key)!r} ({typ}): rope scaling is not supported")
    key = rd.key("rope.scaling.factor")
    typ = rd.meta.type_of(key)
    if typ is not None and (typ not in ("f32", "f64") or float(rd.meta.value(key)) not in (0.0, 1.0)):
        raise ModelError(f"key {key} = {rd.meta.value(key)!r} ({typ}): rope scaling is not supported")


def _vocab(rd: _Reader) -> int:
    """V from A.vocab_size, else the length of tokenizer.ggml.tokens."""
    if rd.has("vocab_size"):
        return rd.u32("vocab_size", nz=True)
    typ = rd.meta.type_of("tokenizer.ggml.tokens")
    if typ is not None:
        if typ != "arr[str]":
            raise ModelError(f"key tokenizer.ggml.tokens must be an array of str, found {typ}")
        return len(rd.meta.value("tokenizer.ggml.tokens"))
    raise ModelError(f"missing required key {rd.key('vocab_size')} (and no tokenizer.ggml.tokens)")


def _common(rd: _Reader) -> dict[str, Any]:
    """Keys shared by all three archs: sizes, attention, rope, ε."""
    _reject_rope_scaling(rd)
    d = rd.u32("embedding_length", nz=True)
    L_all = rd.u32("block_count", nz=True)
    if L_all > _MAX_LAYERS:
        raise ModelError(f"key {rd.key('block_count')} = {L_all} is more than {_MAX_LAYERS} (llama.cpp's limit too)")
    H = _uniform(rd.per_layer_u32("attention.head_count", L_all, None), rd.key("attention.head_count"))
    if H == 0:
        raise ModelError(f"key {rd.key('attention.head_count')} must be non-zero")
    H_kv = _uniform(rd.per_layer_u32("attention.head_count_kv", L_all, H), rd.key("attention.head_count_kv"))
    if H_kv == 0 or H % H_kv != 0:
        raise ModelError(f"key {rd.key('attention.head_count_kv')} = {H_kv} must divide head_count {H}")
    Dk = rd.u32("attention.key_length", d // H, nz=True)
    Dv = rd.u32("attention.value_length", d // H, nz=True)
    if Dk != Dv:
        raise ModelError(f"key {rd.key('attention.value_length')} = {Dv} must equal attention.key_length = {Dk}")
    n_rot = rd.u32("rope.dimension_count", Dk)
    if not 2 <= n_rot <= Dk or n_rot % 2 != 0:
        raise ModelError(f"key {rd.key('rope.dimension_count')} = {n_rot} must be even, ≥ 2 and ≤ head dim {Dk}")
    return dict(
        arch=rd.arch,
        n_ctx_train=rd.u32("context_length", nz=True),
        d=d,
        V=_vocab(rd),
        L_all=L_all,
        H=H,
        H_kv=H_kv,
        Dh=Dk,
        n_rot=n_rot,
        theta=rd.positive_f32("rope.freq_base", 10000.0),
        eps=rd.positive_f32("attention.layer_norm_rms_epsilon"),
    )


def _hybrid(rd: _Reader, p: dict[str, Any]) -> None:
    """Keys shared by qwen4exp and qwen3next: MTP count, MoE, GDN, layer kinds."""
    strict = rd.arch == "qwen4exp"
    L_all = p["L_all"]
    n_mtp = rd.u32("nextn_predict_layers", 0)
    if n_mtp >= L_all:
        raise ModelError(f"key {rd.key('nextn_predict_layers')} = {n_mtp} must be < block_count {L_all}")
    L = L_all - n_mtp
    E = rd.u32("expert_count", 0)
    k = rd.u32("expert_used_count", 0)
    if E == 0:
        raise ModelError(f"key {rd.key('expert_count')} must be non-zero (every block is MoE)")
    if k == 0 or k > E:
        raise ModelError(f"key {rd.key('expert_used_count')} = {k} must be in 1..expert_count ({E})")
    if rd.has("expert_feed_forward_length"):
        F = _uniform(rd.per_layer_u32("expert_feed_forward_length", L_all, None), rd.key("expert_feed_forward_length"))
    else:
        F = _uniform(rd.per_layer_u32("feed_forward_length", L_all, None), rd.key("feed_forward_length")) // k
    if rd.has("expert_shared_feed_forward_length"):
        F_s = rd.u32("expert_shared_feed_forward_length")
    else:
        F_s = _uniform(rd.per_layer_u32("feed_forward_length", L_all, None), rd.key("feed_forward_length"))
    if F == 0 or F_s == 0:
        raise ModelError(f"key {rd.key('expert_feed_forward_length')}: expert FFN sizes must be non-zero")
    K_c = rd.u32("ssm.conv_kernel", nz=strict)
    S = rd.u32("ssm.state_size", nz=strict)
    n_k = rd.u32("ssm.group_count", nz=strict)
    n_v = rd.u32("ssm.time_step_rank", nz=strict)
    inner = rd.u32("ssm.inner_size", nz=strict)
    if n_k == 0 or n_v % n_k != 0:
        raise ModelError(f"key {rd.key('ssm.time_step_rank')} = {n_v} must be a multiple of ssm.group_count = {n_k}")
    if inner != n_v * S:
        raise ModelError(f"key {rd.key('ssm.inner_size')} = {inner} must equal time_step_rank·state_size = {n_v * S}")
    if K_c < 1:
        raise ModelError(f"key {rd.key('ssm.conv_kernel')} must be ≥ 1")
    rec_key = rd.key("attention.recurrent_layers")
    rec_type = rd.meta.type_of(rec_key)
    if rec_type is not None:
        if rec_type != "arr[bool]":
            raise ModelError(f"key {rec_key} must be an array of bool, found {rec_type}")
        mask = [bool(v) for v in rd.meta.value(rec_key)]
        if len(mask) != L_all:
            raise ModelError(f"key {rec_key} has {len(mask)} entries, expected exactly {L_all} (block_count)")
        is_gdn = tuple(mask[i] and i < L for i in range(L_all))
    else:
        interval = rd.u32("full_attention_interval", 4, nz=strict)
        if interval == 0:
            raise ModelError(f"key {rd.key('full_attention_interval')} must be non-zero")
        is_gdn = tuple(i < L and (i + 1) % interval != 0 for i in range(L_all))
    p.update(n_mtp=n_mtp, E=E, k=k, F=F, F_s=F_s, K_c=K_c, S=S, n_k=n_k, n_v=n_v, is_gdn=is_gdn)


def _qwen4exp(rd: _Reader, p: dict[str, Any]) -> None:
    """qwen4exp-only keys: IMRoPE sections, HC, indexer, compress ratios, PLE."""
    L_all, L = p["L_all"], p["L_all"] - p["n_mtp"]
    sec = rd.int_array("rope.dimension_sections", ("i32", "u32"))
    if sec is None:
        raise ModelError(f"missing required key {rd.key('rope.dimension_sections')}")
    if len(sec) != 4:
        raise ModelError(f"key {rd.key('rope.dimension_sections')} has {len(sec)} entries, expected exactly 4")
    hc = rd.u32("hyper_connection.count", nz=True)
    if hc < 2:
        raise ModelError(f"key {rd.key('hyper_connection.count')} = {hc} must be > 1")
    lr = rd.u32("hyper_connection.low_rank", nz=True)
    n_I = rd.u32("attention.indexer.head_count", nz=True)
    D_I = rd.u32("attention.indexer.key_length", nz=True)
    B = rd.u32("attention.indexer.top_k", nz=True)
    r_file = rd.per_layer_u32("attention.compress_ratios", L_all, 0)
    for i, r in enumerate(r_file):
        if r > _MAX_COMPRESS_RATIO:
            raise ModelError(f"key {rd.key('attention.compress_ratios')}[{i}] = {r} must be ≤ {_MAX_COMPRESS_RATIO}")
    # QSA only runs on trunk attention layers; GDN layers and the MTP block are dense/unused.
    r = tuple(ri if (i < L and not p["is_gdn"][i]) else 0 for i, ri in enumerate(r_file))
    if p["n_rot"] > D_I:
        raise ModelError(f"key {rd.key('rope.dimension_count')} = {p['n_rot']} must be ≤ "
                         f"{rd.key('attention.indexer.key_length')} = {D_I} (the indexer keys are rotated too)")
    for i, ri in enumerate(r):
        if ri and B % ri:
            raise ModelError(f"key {rd.key('attention.indexer.top_k')} = {B} must be a multiple of "
                             f"{rd.key('attention.compress_ratios')}[{i}] = {ri} (whole blocks)")
    p.update(sections=tuple(int(s) for s in sec), hc=hc, lr=lr, n_I=n_I, D_I=D_I, B=B, r=r)
    _ple(rd, p)


def _ple(rd: _Reader, p: dict[str, Any]) -> None:
    """PLE keys (§3): present only when ple.layers is non-empty."""
    layers = rd.int_array("ple.layers", ("u32", "i32"))
    if layers is None or len(layers) == 0:
        return
    key = rd.key("ple.layers")
    if len(layers) != 1:
        raise ModelError(f"key {key} has {len(layers)} entries; exactly one PLE layer is supported")
    layer = int(layers[0])
    if not 0 <= layer < p["L_all"]:
        raise ModelError(f"key {key} = {layer} must be in 0..{p['L_all'] - 1}")
    if not p["is_gdn"][layer]:
        raise ModelError(f"key {key} = {layer} must name a GDN layer")
    N = rd.u32("ple.ngram_size")
    if not 2 <= N <= _MAX_NGRAM:
        raise ModelError(f"key {rd.key('ple.ngram_size')} = {N} must be in 2..{_MAX_NGRAM}")
    h_g = rd.u32("ple.heads_per_ngram", nz=True)
    n_p = (N - 1) * h_g
    if n_p > _MAX_PLE_HEADS:
        raise ModelError(f"key {rd.key('ple.heads_per_ngram')} = {h_g} gives {n_p} PLE heads, more than {_MAX_PLE_HEADS}")
    K_p = rd.u32("ple.conv_kernel", nz=True)
    D_p = rd.u32("embedding_length_per_layer_input", nz=True)
    if n_p * D_p != p["d"]:
        raise ModelError(f"key {rd.key('embedding_length_per_layer_input')} = {D_p}: n_p·D_p = {n_p * D_p} must equal embedding_length {p['d']}")
    eos = rd.u32("ple.eos_token_id")
    image = rd.u32("ple.image_token_id", 0) or eos
    mult = _u64_array(rd, "ple.layer_multipliers", N, _MAX_NGRAM)
    offs = _u64_array(rd, "ple.head_offsets", n_p, _MAX_PLE_HEADS)
    sizes = _u64_array(rd, "ple.head_vocab_sizes", n_p, _MAX_PLE_HEADS)
    for h in range(n_p):
        if sizes[h] == 0 or offs[h] + sizes[h] > _INT32_MAX:
            raise ModelError(f"key {rd.key('ple.head_vocab_sizes')}[{h}]: need P_h > 0 and o_h + P_h ≤ 2^31−1")
    p.update(ple_layer=layer, N=N, h_g=h_g, K_p=K_p, D_p=D_p, ple_eos=eos, ple_image=image,
             ple_mult=tuple(mult[:N]), ple_offsets=tuple(offs[:n_p]), ple_sizes=tuple(sizes[:n_p]))


def _u64_array(rd: _Reader, suffix: str, n_min: int, n_max: int) -> list[int]:
    """A required u64 array with n_min..n_max entries, as Python ints (exact)."""
    arr = rd.int_array(suffix, ("u64",))
    if arr is None:
        raise ModelError(f"missing required key {rd.key(suffix)}")
    if not n_min <= len(arr) <= n_max:
        raise ModelError(f"key {rd.key(suffix)} has {len(arr)} entries, expected {n_min}..{n_max}")
    return [int(v) for v in arr.astype(np.uint64)]


def _qwen2(rd: _Reader, p: dict[str, Any]) -> None:
    """qwen2 (dense llama-style): a dense FFN, every layer attention."""
    L_all = p["L_all"]
    F = _uniform(rd.per_layer_u32("feed_forward_length", L_all, None), rd.key("feed_forward_length"))
    if F == 0:
        raise ModelError(f"key {rd.key('feed_forward_length')} must be non-zero")
    p.update(n_mtp=0, F_dense=F, is_gdn=(False,) * L_all)


def hparams_from_metadata(meta: Metadata) -> HParams:
    """Validate metadata for its arch and build HParams (MODEL.md §3)."""
    if meta.arch not in SUPPORTED_ARCHS:
        raise ModelError(f"unsupported architecture {meta.arch!r} (general.architecture); supported: {', '.join(SUPPORTED_ARCHS)}")
    rd = _Reader(meta)
    p = _common(rd)
    if meta.arch == "qwen2":
        _qwen2(rd, p)
    else:
        _hybrid(rd, p)
        if meta.arch == "qwen4exp":
            _qwen4exp(rd, p)
    return HParams(**p)


def hparams_from_gguf(file: Any) -> HParams:
    """HParams of a GGUF model file (a path or a vkflash GGUFFile)."""
    from vkflash.model.weights import metadata_of

    return hparams_from_metadata(metadata_of(file))
