"""The reference forward's public face: the dump-name list and a small arch dispatcher.

Every intermediate the reference computes is passed to an optional `dump(name, array)` callback
under a llama.cpp-callback-style name (`blk.N.<op>` or a global name). The names live here, in
one list, so the GPU engine can emit the same ones and `vkflash verify` can compare op by op.
"""

from __future__ import annotations

from typing import Any

from vkflash.errors import ModelError

GLOBAL_NAMES: tuple[str, ...] = (
    "inp_embd",  # (E1) x_t, (T, d)
    "result_norm",  # (O2)/(N2) the vector the LM head multiplies, (T, d)
    "result_output",  # (O3) logits, (T, V)
    "h_nextn",  # (O1) wide residual before the head mixer, (T, hc, d)
    "mtp.inp_e",  # (T1) ê, (T, d)
    "mtp.inp_h",  # (T2) Ĥ, (T, hc, d)
    "mtp.eh",  # (T3) R⁰, (T, hc, d)
    "mtp.result_norm",  # (T5) draft mixer output, (T, d)
    "mtp.result_output",  # (T5) draft logits, (T, V)
)

LAYER_OPS: tuple[str, ...] = (
    "ple_rows",  # (P3) int rows (T, n_p)
    "ple_gate",  # (P8) λ, (T, hc)
    "ple_conv",  # (P9) y, (T, hc, d)
    "ple_out",  # (P10) R after PLE, (T, hc, d)
    "attn_norm",  # qwen3next/qwen2 normalised mixer input, (T, d)
    "hc_attn_mix",  # (L2) u, (T, d)
    "hc_attn_inject",  # (L2) ι, (T, hc)
    "gdn_qkv",  # (G1) m, (T, C)
    "gdn_z",  # (G1) z, (T, n_v·S)
    "gdn_beta",  # (G2) β, (T, n_v)
    "gdn_g",  # (G3) g, (T, n_v)
    "gdn_conv",  # (G4) c, (T, C)
    "gdn_q",  # (G6) q̂ after 1/√S, (T, n_k, S)
    "gdn_k",  # (G6) k̂, (T, n_k, S)
    "gdn_o",  # (G8) o, (T, n_v, S)
    "gdn_gated",  # (G9) y, (T, n_v, S)
    "Qcur",  # (A3) roped q, (T, H, Dh)
    "Kcur",  # (A3) roped k, (T, H_kv, Dh)
    "Vcur",  # (A2) v, (T, H_kv, Dh)
    "attn_gate",  # (A1) gate pre-σ, (T, H, Dh)
    "kqv_out",  # (A6) o before the gate, (T, H, Dh)
    "idx_k",  # (Q1) raw indexer keys ρ, (T, D_I)
    "idx_q",  # (Q4) qI, (T, n_I, D_I)
    "idx_scores",  # (Q5) block scores s_{t,b}, (T, nb) (invisible blocks −inf)
    "qsa_mask",  # (Q9) selected cells, bool (T, n_kv)
    "attn_out",  # (A8)/(G10) mixer output a, (T, d)
    "attn_residual",  # (L4)/(N1) residual after the mixer
    "ffn_norm",  # qwen3next/qwen2 normalised FFN input, (T, d)
    "hc_ffn_mix",  # (L5) u, (T, d)
    "hc_ffn_inject",  # (L5) ι, (T, hc)
    "ffn_moe_logits",  # (M1) z, (T, E)
    "ffn_moe_probs",  # (M1) p, (T, E)
    "ffn_moe_topk",  # (M2) I, int (T, k)
    "ffn_moe_weights",  # (M3) w, (T, k)
    "ffn_moe_out",  # (M4) routed sum, (T, d)
    "ffn_shexp_out",  # (M4) gated shared expert, (T, d)
    "ffn_out",  # (L6) f, (T, d)
    "l_out",  # (L7)/(N1) residual after the layer
)

_LAYER_SET = frozenset(LAYER_OPS)
_GLOBAL_SET = frozenset(GLOBAL_NAMES)


def layer_name(i: int, op: str) -> str:
    """`blk.{i}.{op}` for an op of LAYER_OPS."""
    if op not in _LAYER_SET:
        raise KeyError(f"unknown layer op {op!r}; add it to LAYER_OPS")
    return f"blk.{i}.{op}"


def check_global(name: str) -> str:
    """A global dump name, checked against GLOBAL_NAMES."""
    if name not in _GLOBAL_SET:
        raise KeyError(f"unknown dump name {name!r}; add it to GLOBAL_NAMES")
    return name


def arch_module(arch: str) -> Any:
    """The reference module (`new_state`, `prefill`, `State`) of an arch."""
    if arch == "qwen4exp":
        from vkflash.model import qwen4exp as mod
    elif arch == "qwen3next":
        from vkflash.model import qwen3next as mod
    elif arch == "qwen2":
        from vkflash.model import qwen2 as mod
    else:
        raise ModelError(f"no reference forward for architecture {arch!r}")
    return mod


def new_state(weights: Any, **options: Any) -> Any:
    """A fresh per-sequence state of the weights' arch; options: see layers.common.RefOptions."""
    return arch_module(weights.hp.arch).new_state(weights, **options)


def prefill(tokens: Any, state: Any) -> Any:
    """Run tokens through the model (decode = prefill of one token); logits (T, V)."""
    return arch_module(state.weights.hp.arch).prefill(tokens, state)
