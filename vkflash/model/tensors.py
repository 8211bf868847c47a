"""Tensor tables per arch (MODEL.md §4) and their validation against a file's tensor list.

Like llama.cpp, a load fails on a missing required tensor, a wrong shape, or an extra tensor;
alternatives (fused/legacy forms, tied output, {d,hc} vs {hc·d} norms, MTP blocks) are resolved
from the names present. Shapes are GGUF `ne` tuples (ne0 first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from vkflash.errors import ModelError, one_line
from vkflash.model.hparams import HParams

Ne = tuple[int, ...]


@dataclass(frozen=True)
class Spec:
    """What one tensor must look like: a shape predicate, its description, and whether required."""

    ok: Callable[[Ne], bool]
    expect: str
    required: bool = True


@dataclass(frozen=True)
class TensorLayout:
    """The alternatives a validated tensor set uses."""

    has_mtp: bool  # blk.L.* (qwen4exp MTP block) present
    mtp_only: bool  # an MTP-only file: no trunk block i < L


def fmt_ne(ne: Ne) -> str:
    """GGUF-style shape text, e.g. {128, 512}."""
    return "{" + ", ".join(str(n) for n in ne) + "}"


def exact(*shapes: Ne, required: bool = True) -> Spec:
    """A tensor whose ne is one of `shapes`."""
    allowed = {tuple(s) for s in shapes}
    return Spec(lambda ne: tuple(ne) in allowed, " or ".join(fmt_ne(s) for s in shapes), required)


def optional(spec: Spec) -> Spec:
    """The same spec, not required."""
    return Spec(spec.ok, spec.expect, False)


def _wide_norm(hp: HParams) -> Spec:
    """A grouped HC/PLE norm gain: {hc·d} or {d, hc} (same bytes)."""
    return exact((hp.hc * hp.d,), (hp.d, hp.hc))


def _hc_set(hp: HParams, p: str, X: str) -> dict[str, Spec]:
    """The four tensors of one HC mixer (γ, W_dn, W_up, W_inj)."""
    w = hp.hc * hp.d
    return {
        f"{p}hc_{X}_norm.weight": _wide_norm(hp),
        f"{p}hc_{X}_down.weight": exact((w, hp.lr)),
        f"{p}hc_{X}_up.weight": exact((hp.lr, w)),
        f"{p}hc_{X}_inject.weight": exact((w, hp.hc)),
    }


def _head_mixer(hp: HParams, p: str) -> dict[str, Spec]:
    """A head mixer (no inject): output_hc_* or nextn.hc_head_*."""
    w = hp.hc * hp.d
    return {f"{p}_norm.weight": _wide_norm(hp), f"{p}_down.weight": exact((w, hp.lr)), f"{p}_up.weight": exact((hp.lr, w))}


def _moe(hp: HParams, p: str, names: frozenset[str]) -> dict[str, Spec]:
    """Router, routed experts (split or fused gate/up) and shared expert."""
    d, E, F, F_s = hp.d, hp.E, hp.F, hp.F_s
    t = {
        f"{p}ffn_gate_inp.weight": exact((d, E)),
        f"{p}ffn_down_exps.weight": exact((F, d, E)),
        f"{p}ffn_gate_inp_shexp.weight": exact((d,)),
        f"{p}ffn_gate_shexp.weight": exact((d, F_s)),
        f"{p}ffn_up_shexp.weight": exact((d, F_s)),
        f"{p}ffn_down_shexp.weight": exact((F_s, d)),
    }
    if f"{p}ffn_gate_up_exps.weight" in names:
        t[f"{p}ffn_gate_up_exps.weight"] = exact((d, 2 * F, E))
    else:
        t[f"{p}ffn_gate_exps.weight"] = exact((d, F, E))
        t[f"{p}ffn_up_exps.weight"] = exact((d, F, E))
    return t


def _gdn(hp: HParams, p: str, names: frozenset[str]) -> dict[str, Spec]:
    """A GDN layer; qwen3next may use the legacy ssm_in and always ssm_ba."""
    d, S, n_k, n_v, C, K_c = hp.d, hp.S, hp.n_k, hp.n_v, hp.C, hp.K_c
    t = {
        f"{p}ssm_conv1d.weight": exact((K_c, C)),
        f"{p}ssm_dt.bias": exact((n_v,)),
        f"{p}ssm_a": exact((n_v,)),
        f"{p}ssm_norm.weight": exact((S,)),
        f"{p}ssm_out.weight": exact((n_v * S, d)),
    }
    if hp.arch == "qwen3next" and f"{p}ssm_in.weight" in names:
        t[f"{p}ssm_in.weight"] = exact((d, 2 * n_k * S + 2 * n_v * S))
    else:
        t[f"{p}attn_qkv.weight"] = exact((d, C))
        t[f"{p}attn_gate.weight"] = exact((d, n_v * S))
    if hp.arch == "qwen3next":
        t[f"{p}ssm_ba.weight"] = exact((d, 2 * n_v))
    else:
        t[f"{p}ssm_beta.weight"] = exact((d, n_v))
        t[f"{p}ssm_alpha.weight"] = exact((d, n_v))
    return t


def _attn(hp: HParams, p: str, names: frozenset[str]) -> dict[str, Spec]:
    """A gated attention layer (q+gate interleaved); qwen4exp adds the indexer."""
    d, H, H_kv, Dh = hp.d, hp.H, hp.H_kv, hp.Dh
    t = {
        f"{p}attn_output.weight": exact((H * Dh, d)),
        f"{p}attn_q_norm.weight": exact((Dh,)),
        f"{p}attn_k_norm.weight": exact((Dh,)),
    }
    n_qkv = 2 * H * Dh + 2 * H_kv * Dh
    if hp.arch == "qwen3next" and f"{p}attn_qkv.weight" in names:
        t[f"{p}attn_qkv.weight"] = exact((d, n_qkv))
        t[f"{p}attn_qkv.bias"] = exact((n_qkv,), required=False)
    else:
        t[f"{p}attn_q.weight"] = exact((d, 2 * H * Dh))
        t[f"{p}attn_k.weight"] = exact((d, H_kv * Dh))
        t[f"{p}attn_v.weight"] = exact((d, H_kv * Dh))
    if hp.arch == "qwen4exp":
        t[f"{p}indexer.q_proj.weight"] = exact((d, hp.n_I * hp.D_I))
        t[f"{p}indexer.k_proj.weight"] = exact((d, hp.D_I))
        t[f"{p}indexer.q_norm.weight"] = exact((hp.D_I,))
        t[f"{p}indexer.k_norm.weight"] = exact((hp.D_I,))
    return t


def _ple(hp: HParams, p: str) -> dict[str, Spec]:
    """PLE projections, norms and conv on the PLE layer."""
    w = hp.hc * hp.d
    return {
        f"{p}ple_key.weight": exact((hp.d, w)),
        f"{p}ple_value.weight": exact((hp.d, hp.d)),
        f"{p}ple_norm_key.weight": _wide_norm(hp),
        f"{p}ple_norm_query.weight": _wide_norm(hp),
        f"{p}ple_norm_conv.weight": _wide_norm(hp),
        f"{p}ple_conv1d.weight": exact((hp.K_p, w)),
    }


def _ple_table(hp: HParams) -> Spec:
    """per_layer_token_embd {D_p, R_p} with R_p ≥ max_h(o_h + P_h)."""
    need = max(o + P for o, P in zip(hp.ple_offsets, hp.ple_sizes))
    return Spec(lambda ne: len(ne) == 2 and ne[0] == hp.D_p and ne[1] >= need, f"{{{hp.D_p}, ≥{need}}}")


def _qwen4exp(hp: HParams, names: frozenset[str]) -> tuple[dict[str, Spec], bool, bool]:
    """The qwen4exp table: trunk (unless MTP-only) plus the MTP block when present."""
    d, V, L = hp.d, hp.V, hp.L
    mtp_only = hp.n_mtp > 0 and not any(block_of(n) is not None and block_of(n) < L for n in names)
    has_mtp = any((b := block_of(n)) is not None and b >= L for n in names)
    t: dict[str, Spec] = {"token_embd.weight": exact((d, V), required=not mtp_only),
                          "output.weight": exact((d, V), required=False)}
    if not mtp_only:
        t.update(_head_mixer(hp, "output_hc"))
        if hp.has_ple:
            t["per_layer_token_embd.weight"] = _ple_table(hp)
        for i in range(L):
            p = f"blk.{i}."
            t.update(_hc_set(hp, p, "attn"))
            t.update(_hc_set(hp, p, "ffn"))
            t.update(_gdn(hp, p, names) if hp.is_gdn[i] else _attn(hp, p, names))
            t.update(_moe(hp, p, names))
            if i == hp.ple_layer:
                t.update(_ple(hp, p))
    if has_mtp:
        for i in range(L, hp.L_all):
            p = f"blk.{i}."
            t.update(_hc_set(hp, p, "attn"))
            t.update(_hc_set(hp, p, "ffn"))
            t.update(_attn(hp, p, names))
            t.update(_moe(hp, p, names))
            t[f"{p}nextn.enorm.weight"] = exact((d,))
            t[f"{p}nextn.hnorm.weight"] = _wide_norm(hp)
            t[f"{p}nextn.eh_proj.weight"] = exact((2 * d, d))
            t[f"{p}nextn.embed_tokens.weight"] = exact((d, V), required=False)
            t[f"{p}nextn.shared_head_head.weight"] = exact((d, V), required=False)
            if f"{p}nextn.hc_head_norm.weight" in names or "output_hc_norm.weight" not in names:
                t.update(_head_mixer(hp, f"{p}nextn.hc_head"))
            elif mtp_only:  # older draft files store the draft's own mixer as output_hc_*
                t.update(_head_mixer(hp, "output_hc"))
    return t, has_mtp, mtp_only


def _qwen3next(hp: HParams, names: frozenset[str]) -> dict[str, Spec]:
    """The qwen3next table; MTP blocks are accepted but optional (vkflash runs no qwen3next MTP)."""
    d, V = hp.d, hp.V
    t: dict[str, Spec] = {"token_embd.weight": exact((d, V)), "output.weight": exact((d, V), required=False),
                          "output_norm.weight": exact((d,))}
    for i in range(hp.L_all):
        p = f"blk.{i}."
        blk = {f"{p}attn_norm.weight": exact((d,)), f"{p}post_attention_norm.weight": exact((d,))}
        blk.update(_gdn(hp, p, names) if hp.is_gdn[i] else _attn(hp, p, names))
        blk.update(_moe(hp, p, names))
        if i >= hp.L:
            blk.update({f"{p}nextn.eh_proj.weight": exact((2 * d, d)), f"{p}nextn.enorm.weight": exact((d,)),
                        f"{p}nextn.hnorm.weight": exact((d,)), f"{p}nextn.embed_tokens.weight": exact((d, V)),
                        f"{p}nextn.shared_head_head.weight": exact((d, V)),
                        f"{p}nextn.shared_head_norm.weight": exact((d,))})
            blk = {n: optional(s) for n, s in blk.items()}
        t.update(blk)
    return t


def _qwen2(hp: HParams) -> dict[str, Spec]:
    """The qwen2 table: dense llama-style blocks with q/k/v biases."""
    d, H, H_kv, Dh, F = hp.d, hp.H, hp.H_kv, hp.Dh, hp.F_dense
    t: dict[str, Spec] = {"token_embd.weight": exact((d, hp.V)), "output.weight": exact((d, hp.V), required=False),
                          "output_norm.weight": exact((d,))}
    for i in range(hp.L_all):
        p = f"blk.{i}."
        t.update({
            f"{p}attn_norm.weight": exact((d,)),
            f"{p}attn_q.weight": exact((d, H * Dh)), f"{p}attn_q.bias": exact((H * Dh,)),
            f"{p}attn_k.weight": exact((d, H_kv * Dh)), f"{p}attn_k.bias": exact((H_kv * Dh,)),
            f"{p}attn_v.weight": exact((d, H_kv * Dh)), f"{p}attn_v.bias": exact((H_kv * Dh,)),
            f"{p}attn_output.weight": exact((H * Dh, d)),
            f"{p}ffn_norm.weight": exact((d,)),
            f"{p}ffn_gate.weight": exact((d, F)), f"{p}ffn_up.weight": exact((d, F)),
            f"{p}ffn_down.weight": exact((F, d)),
        })
    return t


def block_of(name: str) -> int | None:
    """The block index of a `blk.i.*` name, else None."""
    if not name.startswith("blk."):
        return None
    head = name.split(".", 2)[1]
    return int(head) if head.isdigit() else None


def tensor_table(hp: HParams, names: frozenset[str]) -> tuple[dict[str, Spec], bool, bool]:
    """Expected tensors for hp given the names present: (table, has_mtp, mtp_only)."""
    if hp.arch == "qwen4exp":
        return _qwen4exp(hp, names)
    if hp.arch == "qwen3next":
        return _qwen3next(hp, names), False, False
    return _qwen2(hp), False, False


def validate_tensors(hp: HParams, found: Mapping[str, Ne]) -> TensorLayout:
    """Check a file's tensors (name → ne) against the table; the first problem is one ModelError."""
    names = frozenset(found)
    table, has_mtp, mtp_only = tensor_table(hp, names)
    problems: list[str] = []
    for name, spec in table.items():
        if name not in found:
            if spec.required:
                problems.append(f"missing tensor {name} (expected ne {spec.expect})")
        elif not spec.ok(tuple(found[name])):
            problems.append(f"tensor {name} has ne {fmt_ne(tuple(found[name]))}, expected {spec.expect}")
    for name in sorted(names - set(table)):
        problems.append(f"unexpected tensor {one_line(name)} (ne {fmt_ne(tuple(found[name]))}) is not part of a {hp.arch} model")
    if problems:
        more = f" (and {len(problems) - 1} more tensor problems)" if len(problems) > 1 else ""
        raise ModelError(problems[0] + more)
    return TensorLayout(has_mtp=has_mtp, mtp_only=mtp_only)
