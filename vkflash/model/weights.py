"""Load a validated model as dequantized NumPy arrays in typed per-layer dataclasses.

Sources are a GGUF file (through vkflash.formats' GGUFFile and dequantize) or an in-memory
dict (tests). Arrays use the shape rule of MODEL.md §2: NumPy shape = reversed(ne). Fused and
legacy layouts are unpacked here so the forward code sees one form per op.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from vkflash.errors import ModelError
from vkflash.formats.gguf_file import GGUFFile
from vkflash.formats.quants import dequantize
from vkflash.model.hparams import HParams, Metadata, hparams_from_metadata
from vkflash.model.tensors import Ne, validate_tensors

RowTable = Callable[[np.ndarray], np.ndarray]  # rows (n,) int → (n, D) float


class TensorSource(Protocol):
    """Named tensors with GGUF shapes, loadable as float32 NumPy arrays (shape = reversed(ne))."""

    shapes: Mapping[str, Ne]

    def load(self, name: str) -> np.ndarray: ...

    def rows(self, name: str) -> RowTable: ...


# ---------------------------------------------------------------------------- GGUF access

_VALUE_TYPE_NAMES = {
    "UINT8": "u8", "INT8": "i8", "UINT16": "u16", "INT16": "i16", "UINT32": "u32", "INT32": "i32",
    "FLOAT32": "f32", "BOOL": "bool", "STRING": "str", "UINT64": "u64", "INT64": "i64", "FLOAT64": "f64",
    "ARRAY": "arr",
}


def open_gguf(file: Any) -> GGUFFile:
    """A GGUFFile for a path, or the GGUFFile itself."""
    return file if isinstance(file, GGUFFile) else GGUFFile(file)


def metadata_of(file: Any) -> Metadata:
    """Typed metadata (key → (type, value)) of a GGUF (path or GGUFFile); u64 arrays stay uint64."""
    from gguf import GGUFValueType

    gf = open_gguf(file)
    kv: dict[str, tuple[str, Any]] = {}
    for key in gf.metadata:
        main = gf.metadata.key_type(key)
        if main == GGUFValueType.ARRAY:
            typ = f"arr[{_VALUE_TYPE_NAMES[gf.metadata.array_type(key).name]}]"
        else:
            typ = _VALUE_TYPE_NAMES[main.name]
        # string arrays other than the vocabulary, and nested arrays, are never read as hparams
        value = None if typ == "arr[arr]" or (typ == "arr[str]" and key != "tokenizer.ggml.tokens") else gf.metadata[key]
        kv[key] = (typ, value)
    return Metadata(arch=gf.arch, kv=kv)


class GGUFSource:
    """Tensors of a GGUF file (path or GGUFFile), dequantized to float32 on demand."""

    def __init__(self, file: Any):
        self.file = open_gguf(file)
        self.shapes: dict[str, Ne] = {n: t.ne for n, t in self.file.tensors.items()}

    def load(self, name: str) -> np.ndarray:
        """The whole tensor as float32, NumPy shape = reversed(ne)."""
        return self.file.tensor_f32(name)

    def rows(self, name: str) -> RowTable:
        """Row gather of a 2-D tensor without dequantizing the whole table."""
        info = self.file.tensors[name]
        ne0, ne1 = info.ne
        data = info.data.reshape(ne1, -1)

        def gather(idx: np.ndarray) -> np.ndarray:
            picked = data[np.asarray(idx).reshape(-1)]
            return dequantize(picked, info.ggml_type, picked.shape[0] * ne0).reshape(-1, ne0)

        return gather


class ArraySource:
    """In-memory tensors (name → NumPy array in NumPy shape), for tests and generators."""

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self.arrays = dict(arrays)
        self.shapes: dict[str, Ne] = {n: tuple(reversed(a.shape)) for n, a in self.arrays.items()}

    def load(self, name: str) -> np.ndarray:
        return np.asarray(self.arrays[name], dtype=np.float32)

    def rows(self, name: str) -> RowTable:
        table = self.arrays[name]
        return lambda idx: np.asarray(table[np.asarray(idx)], dtype=np.float32)


# ---------------------------------------------------------------------------- typed weights


@dataclass
class HCMixW:
    """One HC mixer: γ (hc·d), W_dn (lr, hc·d), W_up (hc·d, lr), W_inj (hc, hc·d) or None (head)."""

    norm: np.ndarray
    down: np.ndarray
    up: np.ndarray
    inject: np.ndarray | None


@dataclass
class IndexerW:
    """QSA indexer: W_Iq (n_I·D_I, d), W_Ik (D_I, d) and their folded norm gains (D_I)."""

    q_proj: np.ndarray
    k_proj: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray


@dataclass
class AttnW:
    """Attention: W_q (H·Dh, d), gate rows (H·Dh, d) or None (qwen2), W_k, W_v, W_o, norms, biases."""

    wq: np.ndarray
    wgate: np.ndarray | None
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    q_norm: np.ndarray | None = None
    k_norm: np.ndarray | None = None
    bq: np.ndarray | None = None
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    indexer: IndexerW | None = None


@dataclass
class GDNW:
    """GDN: W_qkv (C, d), W_z (n_v·S, d), W_β, W_α (n_v, d), conv (C, K_c), dt_bias, ssm_a, ssm_norm, W_o."""

    wqkv: np.ndarray
    wz: np.ndarray
    wbeta: np.ndarray
    walpha: np.ndarray
    conv: np.ndarray
    dt_bias: np.ndarray
    a: np.ndarray
    norm: np.ndarray
    wo: np.ndarray


@dataclass
class MoEW:
    """MoE: router (E, d), experts gate/up (E, F, d), down (E, d, F), shared gate (d) and FFN."""

    router: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    sh_gate_inp: np.ndarray
    sh_gate: np.ndarray
    sh_up: np.ndarray
    sh_down: np.ndarray


@dataclass
class DenseFFNW:
    """Dense SwiGLU FFN (qwen2): gate, up (F, d), down (d, F)."""

    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray


@dataclass
class PLEW:
    """PLE layer: W_pk (hc·d, d), W_pv (d, d), grouped norms (hc·d), conv (hc·d, K_p), table rows."""

    wk: np.ndarray
    wv: np.ndarray
    norm_key: np.ndarray
    norm_query: np.ndarray
    norm_conv: np.ndarray
    conv: np.ndarray
    table: RowTable


@dataclass
class BlockW:
    """One block: its mixer (GDN or attention), FFN, and the arch's norms / HC mixers / PLE."""

    mixer: GDNW | AttnW
    ffn: MoEW | DenseFFNW
    attn_norm: np.ndarray | None = None  # qwen3next, qwen2
    ffn_norm: np.ndarray | None = None  # qwen3next post_attention_norm, qwen2 ffn_norm
    hc_attn: HCMixW | None = None  # qwen4exp
    hc_ffn: HCMixW | None = None
    ple: PLEW | None = None


@dataclass
class MTPW:
    """qwen4exp MTP block L: the block, enorm (d), hnorm (hc·d), W_eh (d, 2d), head mixer, own emb/head."""

    block: BlockW
    enorm: np.ndarray
    hnorm: np.ndarray
    eh_proj: np.ndarray
    head: HCMixW | None  # None: use the target's output_hc_* mixer
    embed: np.ndarray | None  # None: the target's token_embd
    out: np.ndarray | None  # None: the target's output


@dataclass
class Weights:
    """All weights of one file, in one compute dtype. Missing trunk parts are None (MTP-only file)."""

    hp: HParams
    token_embd: np.ndarray | None
    output: np.ndarray | None  # tied → token_embd
    blocks: list[BlockW]
    output_norm: np.ndarray | None = None
    output_hc: HCMixW | None = None
    mtp: MTPW | None = None

    @property
    def dtype(self) -> np.dtype:
        """The compute dtype of the forward (that of the weights)."""
        arr = self.token_embd if self.token_embd is not None else self.mtp.eh_proj  # type: ignore[union-attr]
        return arr.dtype


class _Loader:
    """Loads tensors by name in the chosen dtype; knows which names are present."""

    def __init__(self, src: TensorSource, dtype: np.dtype):
        self.src, self.dtype = src, np.dtype(dtype)

    def has(self, name: str) -> bool:
        return name in self.src.shapes

    def get(self, name: str) -> np.ndarray:
        return self.src.load(name).astype(self.dtype, copy=False)

    def opt(self, name: str) -> np.ndarray | None:
        return self.get(name) if self.has(name) else None

    def flat(self, name: str) -> np.ndarray:
        """A gain stored as {hc·d} or {d, hc}: always flat (hc·d,)."""
        return self.get(name).reshape(-1)

    def rows(self, name: str) -> RowTable:
        table, dtype = self.src.rows(name), self.dtype
        return lambda idx: table(idx).astype(dtype, copy=False)


def _hc(ld: _Loader, p: str, inject: bool) -> HCMixW:
    return HCMixW(ld.flat(f"{p}_norm.weight"), ld.get(f"{p}_down.weight"), ld.get(f"{p}_up.weight"),
                  ld.get(f"{p}_inject.weight") if inject else None)


def _attn(ld: _Loader, hp: HParams, p: str) -> AttnW:
    """Attention weights; q/gate de-interleaved per head, a fused qwen3next attn_qkv split."""
    H, H_kv, Dh, d = hp.H, hp.H_kv, hp.Dh, hp.d
    bq = bk = bv = None
    if ld.has(f"{p}attn_qkv.weight"):
        fused = ld.get(f"{p}attn_qkv.weight")
        wqg, wk, wv = np.split(fused, [2 * H * Dh, 2 * H * Dh + H_kv * Dh])
        bias = ld.opt(f"{p}attn_qkv.bias")
        if bias is not None:
            bqg, bk, bv = np.split(bias, [2 * H * Dh, 2 * H * Dh + H_kv * Dh])
            bq = bqg.reshape(H, 2, Dh)[:, 0].reshape(-1)
            if np.any(bqg.reshape(H, 2, Dh)[:, 1]):
                raise ModelError(f"tensor {p}attn_qkv.bias has a non-zero gate bias, which is not supported")
    else:
        wqg, wk, wv = ld.get(f"{p}attn_q.weight"), ld.get(f"{p}attn_k.weight"), ld.get(f"{p}attn_v.weight")
    if hp.arch == "qwen2":
        wq, wgate = wqg, None
        bq, bk, bv = ld.get(f"{p}attn_q.bias"), ld.get(f"{p}attn_k.bias"), ld.get(f"{p}attn_v.bias")
    else:
        view = wqg.reshape(H, 2, Dh, d)  # (A1): [h,0] = q_h, [h,1] = gate_h
        wq, wgate = view[:, 0].reshape(H * Dh, d).copy(), view[:, 1].reshape(H * Dh, d).copy()
    indexer = None
    if hp.arch == "qwen4exp":
        indexer = IndexerW(ld.get(f"{p}indexer.q_proj.weight"), ld.get(f"{p}indexer.k_proj.weight"),
                           ld.get(f"{p}indexer.q_norm.weight"), ld.get(f"{p}indexer.k_norm.weight"))
    return AttnW(wq=wq, wgate=wgate, wk=wk, wv=wv, wo=ld.get(f"{p}attn_output.weight"),
                 q_norm=ld.opt(f"{p}attn_q_norm.weight"), k_norm=ld.opt(f"{p}attn_k_norm.weight"),
                 bq=bq, bk=bk, bv=bv, indexer=indexer)


def _gdn(ld: _Loader, hp: HParams, p: str) -> GDNW:
    """GDN weights; qwen3next legacy ssm_in and grouped ssm_ba unpacked (§4, N3)."""
    n_k, n_v, S, rho, d = hp.n_k, hp.n_v, hp.S, hp.rho, hp.d
    if ld.has(f"{p}ssm_in.weight"):
        g = ld.get(f"{p}ssm_in.weight").reshape(n_k, 2 * S + 2 * rho * S, d)
        q, k, v, z = np.split(g, [S, 2 * S, 2 * S + rho * S], axis=1)
        wqkv = np.concatenate([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)])
        wz = z.reshape(-1, d)
    else:
        wqkv, wz = ld.get(f"{p}attn_qkv.weight"), ld.get(f"{p}attn_gate.weight")
    if ld.has(f"{p}ssm_ba.weight"):
        ba = ld.get(f"{p}ssm_ba.weight").reshape(n_k, 2, rho, d)  # [g,0,i] = b, [g,1,i] = a of v-head g·ρ+i
        wbeta, walpha = ba[:, 0].reshape(n_v, d).copy(), ba[:, 1].reshape(n_v, d).copy()
    else:
        wbeta, walpha = ld.get(f"{p}ssm_beta.weight"), ld.get(f"{p}ssm_alpha.weight")
    return GDNW(wqkv=wqkv, wz=wz, wbeta=wbeta, walpha=walpha, conv=ld.get(f"{p}ssm_conv1d.weight"),
                dt_bias=ld.get(f"{p}ssm_dt.bias"), a=ld.get(f"{p}ssm_a"), norm=ld.get(f"{p}ssm_norm.weight"),
                wo=ld.get(f"{p}ssm_out.weight"))


def _moe(ld: _Loader, hp: HParams, p: str) -> MoEW:
    """MoE weights; a fused gate_up stack split into gate rows [0, F) and up rows [F, 2F)."""
    if ld.has(f"{p}ffn_gate_up_exps.weight"):
        gu = ld.get(f"{p}ffn_gate_up_exps.weight")
        gate, up = gu[:, : hp.F].copy(), gu[:, hp.F:].copy()
    else:
        gate, up = ld.get(f"{p}ffn_gate_exps.weight"), ld.get(f"{p}ffn_up_exps.weight")
    return MoEW(router=ld.get(f"{p}ffn_gate_inp.weight"), gate=gate, up=up, down=ld.get(f"{p}ffn_down_exps.weight"),
                sh_gate_inp=ld.get(f"{p}ffn_gate_inp_shexp.weight"), sh_gate=ld.get(f"{p}ffn_gate_shexp.weight"),
                sh_up=ld.get(f"{p}ffn_up_shexp.weight"), sh_down=ld.get(f"{p}ffn_down_shexp.weight"))


def _block(ld: _Loader, hp: HParams, i: int) -> BlockW:
    """Block i of any arch."""
    p = f"blk.{i}."
    mixer = _gdn(ld, hp, p) if hp.is_gdn[i] else _attn(ld, hp, p)
    if hp.arch == "qwen2":
        ffn: MoEW | DenseFFNW = DenseFFNW(ld.get(f"{p}ffn_gate.weight"), ld.get(f"{p}ffn_up.weight"),
                                          ld.get(f"{p}ffn_down.weight"))
        return BlockW(mixer, ffn, attn_norm=ld.get(f"{p}attn_norm.weight"), ffn_norm=ld.get(f"{p}ffn_norm.weight"))
    ffn = _moe(ld, hp, p)
    if hp.arch == "qwen3next":
        return BlockW(mixer, ffn, attn_norm=ld.get(f"{p}attn_norm.weight"),
                      ffn_norm=ld.get(f"{p}post_attention_norm.weight"))
    ple = None
    if i == hp.ple_layer:
        ple = PLEW(wk=ld.get(f"{p}ple_key.weight"), wv=ld.get(f"{p}ple_value.weight"),
                   norm_key=ld.flat(f"{p}ple_norm_key.weight"), norm_query=ld.flat(f"{p}ple_norm_query.weight"),
                   norm_conv=ld.flat(f"{p}ple_norm_conv.weight"), conv=ld.get(f"{p}ple_conv1d.weight"),
                   table=ld.rows("per_layer_token_embd.weight"))
    return BlockW(mixer, ffn, hc_attn=_hc(ld, f"{p}hc_attn", True), hc_ffn=_hc(ld, f"{p}hc_ffn", True), ple=ple)


def _mtp(ld: _Loader, hp: HParams) -> MTPW:
    """The qwen4exp MTP block L (fork layout, §4)."""
    L = hp.L
    p = f"blk.{L}."
    block = BlockW(_attn(ld, hp, p), _moe(ld, hp, p), hc_attn=_hc(ld, f"{p}hc_attn", True),
                   hc_ffn=_hc(ld, f"{p}hc_ffn", True))
    if ld.has(f"{p}nextn.hc_head_norm.weight"):
        head: HCMixW | None = _hc(ld, f"{p}nextn.hc_head", False)
    elif ld.has("output_hc_norm.weight"):
        head = _hc(ld, "output_hc", False)
    else:
        head = None
    embed = ld.opt(f"{p}nextn.embed_tokens.weight")
    if embed is None:
        embed = ld.opt("token_embd.weight")
    out = ld.opt(f"{p}nextn.shared_head_head.weight")
    if out is None:
        out = ld.opt("output.weight")
    return MTPW(block=block, enorm=ld.get(f"{p}nextn.enorm.weight"), hnorm=ld.flat(f"{p}nextn.hnorm.weight"),
                eh_proj=ld.get(f"{p}nextn.eh_proj.weight"), head=head, embed=embed, out=out)


def load_weights(hp: HParams, src: TensorSource, dtype: Any = np.float32) -> Weights:
    """Validate src against hp's tensor table and load every tensor in `dtype`."""
    layout = validate_tensors(hp, src.shapes)
    ld = _Loader(src, dtype)
    token_embd = ld.opt("token_embd.weight")
    output = ld.opt("output.weight")
    w = Weights(hp=hp, token_embd=token_embd, output=output if output is not None else token_embd,
                blocks=[] if layout.mtp_only else [_block(ld, hp, i) for i in range(hp.L)])
    if hp.arch in ("qwen3next", "qwen2"):
        w.output_norm = ld.get("output_norm.weight")
    elif not layout.mtp_only:
        w.output_hc = _hc(ld, "output_hc", False)
    if layout.has_mtp:
        w.mtp = _mtp(ld, hp)
    return w


def load_model(path: str | Path | GGUFFile, dtype: Any = np.float32) -> Weights:
    """Read, validate and load a GGUF model file."""
    gf = open_gguf(path)
    return load_weights(hparams_from_metadata(metadata_of(gf)), GGUFSource(gf), dtype)
