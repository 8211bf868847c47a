"""How the GPU layer runs step graphs, read once from the knob table when a `Gpu` is created.

Everything that chooses *how* a step runs — which fusions the pass in gpu/fuse.py applies,
cooperative-matrix GEMMs and flash attention, the MoE grid, barriers, submission budget and in-flight bound, tracing —
lives here, so building and replaying a graph reads no global settings. Tests build other options with
`GpuOptions.from_knobs(...)` and `Gpu.with_options` to compare paths on one device.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from enum import Enum

from vkflash import settings
from vkflash.gpu.trace import Tracing


class Fusion(str, Enum):
    """The rewrites of gpu/fuse.py, each one a revert switch of its own."""

    STACK = "stack"  # matmuls of one input whose weights are consecutive rows of one buffer → one matmul
    EPILOGUE = "epilogue"  # scale, bias, σ/silu, ⊙ and residual eltwise ops after a matmul → its store
    GLU = "glu"  # silu(W_g x) ⊙ W_u x of a stacked [gate; up] → one GEMV (≤ 8 tokens)
    NORM_ROPE = "norm_rope"  # RMSNorm then RoPE of the same head rows → one norm.comp dispatch
    COMBINE_NORM = "combine_norm"  # HC Combine then the next Mix's grouped norm → one dispatch
    NORM_INJECT = "norm_inject"  # the f32 HC inject projection of the normed rows → the norm (≤ 8 tokens)
    HC_MIX = "hc_mix"  # hc_pre, W_up and hc_mix → one GEMV (≤ 8 tokens)
    KV_APPEND = "kv_append"  # a layer's K and V appends → one dispatch
    MOE_OUT = "moe_out"  # the shared expert's down projection and the MoE combine → one GEMV (≤ 8 tokens)
    GDN_GATES = "gdn_gates"  # the GDN gates computed inside the delta-rule kernel


ALL_FUSIONS = frozenset(Fusion)
HC_FUSIONS = frozenset({Fusion.COMBINE_NORM, Fusion.NORM_INJECT, Fusion.HC_MIX})
"""What VKFLASH_HC_FUSE=0 turns off (with the one-dispatch HC tails)."""
EPILOGUE_FUSIONS = frozenset({Fusion.EPILOGUE, Fusion.GLU})
"""What VKFLASH_MM_TILE_EPILOG=0 turns off."""


@dataclass(frozen=True)
class GpuOptions:
    """The knobs of the GPU layer, resolved (see the knob table in vkflash/settings.py)."""

    fusions: frozenset[Fusion] = ALL_FUSIONS
    hc_tails: bool = True  # hyper-connection tails as one hc.comp dispatch each (else eltwise ops)
    coopmat: bool = False  # cooperative-matrix GEMMs for non-F32 weights where the device has them
    fa_coopmat: bool = True  # cooperative-matrix flash-attention prefill over f16 / q8_0 caches, where possible
    fa_rows: bool = True  # ... on the subgroup-rows kernel (attn_flash_sg.comp; else attn_flash_cm.comp)
    mmid_compact: bool = True  # MoE prefill launches only live (expert, tile) pairs
    mmid_fast_fetch: bool = True  # the coopmat MoE prefill GEMM decodes weight groups from wide loads
    mmid_half: bool = True  # ... in half groups on every invocation
    mm_splitk: bool = True  # split-K for tiled GEMMs with few output tiles; more workgroups for the transposed GEMV
    gdn_matrix: bool = True  # chunked GDN prefill in matrix form (else the scalar chunked kernel)
    gdn_split: bool = False  # the matrix form as a per-chunk pass and a scan (else one kernel)
    attn_decode: bool = True  # attention of ≤ 8 queries on the decode kernel (else the flash kernel)
    gemv_teams: bool = True  # decode GEMVs in row groups sized from K (gemv.comp; else mul_mat_vec.comp)
    gemv_q8: bool = False  # decode GEMVs of quantized weights on 8-bit activations and integer dots
    gemv_cols: bool = True  # decode GEMVs load each weight slice once for all token columns (else once per column)
    gemv_deq: bool = True  # decode GEMVs turn codes into weights once for all columns (else scale per column)
    topk_wide: bool = True  # QSA selection in few wide passes (else the previous kernel)
    qsa_score_tile: bool = True  # prefill QSA block scores in tiles of queries × blocks
    qsa_dense_head: bool = True  # per-query QSA lists: queries before W on the dense causal kernel
    router_rank: bool = False  # MoE router by rank counting in one pass (else k argmax rounds)
    stack_weights: bool = True  # same-type projections of one input uploaded as one buffer
    dep_barriers: bool = True  # barriers only on real dependencies (else before every dispatch)
    submit_budget_ms: float = 200.0  # estimated GPU time one prefill submission may hold
    max_inflight: int = 2
    serialize: bool = False  # wait for each submission before the next
    spin_wait: str = "auto"  # "1": poll fences; "0": sleep; auto: poll on GPUs only
    tracing: Tracing = Tracing()

    def fuses(self, f: Fusion) -> bool:
        return f in self.fusions

    def without(self, *fusions: Fusion) -> "GpuOptions":
        """These options with some fusions turned off (tests compare fused and plain graphs)."""
        return replace(self, fusions=self.fusions - frozenset(fusions))

    @classmethod
    def from_settings(cls, s: settings.Settings | None = None) -> "GpuOptions":
        """The options the knob table says (the process-wide settings by default)."""
        s = s or settings.current()
        fusions = set(ALL_FUSIONS)
        if not s["VKFLASH_MM_TILE_EPILOG"]:
            fusions -= EPILOGUE_FUSIONS
        if not s["VKFLASH_HC_FUSE"]:
            fusions -= HC_FUSIONS
        off = bool(s["VKFLASH_DISABLE_FUSION"])
        return cls(fusions=frozenset() if off else frozenset(fusions), hc_tails=bool(s["VKFLASH_HC_FUSE"]) and not off,
                   coopmat=not s["VKFLASH_DISABLE_COOPMAT"], fa_coopmat=bool(s["VKFLASH_FA_COOPMAT"]),
                   fa_rows=bool(s["VKFLASH_FA_ROWS"]),
                   mmid_compact=bool(s["VKFLASH_MMID_COMPACT"]), mmid_fast_fetch=bool(s["VKFLASH_MMID_FAST_FETCH"]),
                   mmid_half=bool(s["VKFLASH_MMID_HALF"]),
                   mm_splitk=bool(s["VKFLASH_MM_SPLITK"]),
                   gdn_matrix=bool(s["VKFLASH_GDN_MATRIX"]),
                   gdn_split=bool(s["VKFLASH_GDN_SPLIT"]), attn_decode=bool(s["VKFLASH_ATTN_DECODE"]),
                   gemv_teams=bool(s["VKFLASH_GEMV_TEAMS"]), gemv_q8=bool(s["VKFLASH_GEMV_Q8"]),
                   gemv_cols=bool(s["VKFLASH_GEMV_COLS"]), gemv_deq=bool(s["VKFLASH_GEMV_DEQ"]),
                   topk_wide=bool(s["VKFLASH_TOPK_WIDE"]), router_rank=bool(s["VKFLASH_ROUTER_RANK"]),
                   qsa_score_tile=bool(s["VKFLASH_QSA_SCORE_TILE"]), qsa_dense_head=bool(s["VKFLASH_QSA_DENSE_HEAD"]),
                   stack_weights=bool(s["VKFLASH_STACK_WEIGHTS"]), dep_barriers=bool(s["VKFLASH_DEP_BARRIERS"]),
                   submit_budget_ms=float(s["VKFLASH_SUBMIT_BUDGET_MS"]), max_inflight=int(s["VKFLASH_MAX_INFLIGHT"]),
                   serialize=bool(s["VKFLASH_SERIALIZE_SUBMISSIONS"]), spin_wait=str(s["VKFLASH_SPIN_WAIT"]),
                   tracing=Tracing.from_settings(s))

    @classmethod
    def from_knobs(cls, **knobs: str) -> "GpuOptions":
        """The options of the environment with some knobs set, e.g. from_knobs(VKFLASH_HC_FUSE="0")."""
        return cls.from_settings(settings.load(env=dict(os.environ, **knobs)))
