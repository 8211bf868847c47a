"""The qwen3next step graph (MODEL.md §5.9 N1–N4): for n tokens,

    h = token_embd[ids]
    for each layer i:  h += Mixer(rms(h) ⊙ attn_norm)        GDN (grouped heads, silu gate) or
                                                             gated attention with NeoX RoPE
                       h += MoE(rms(h) ⊙ post_attention_norm)
    logits = W_out(rms(h) ⊙ output_norm) for the rows the head asks for, and their argmax.

The mixer's residual add is its output projection's epilogue; the MoE output (routed slots +
σ-gated shared expert, summed by moe_combine) is added after. Recurrent states live in
`model.state` (engine/state.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vkflash.engine.graphs.common import Head, StepModel, embed_tokens, lm_head
from vkflash.engine.graphs.hybrid import (HybridScratch, attention_sublayer, moe_sublayer, gdn_sublayer,
                                          hybrid_stacks, hybrid_transforms)
from vkflash.engine.state import RecurrentState, n_draft
from vkflash.engine.weights_gpu import Stack, Transform
from vkflash.formats.gguf_file import GGUFFile
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.attention import CacheType
from vkflash.gpu.ops.gdn import Gate, HeadMap
from vkflash.gpu.ops.norm import rms_norm
from vkflash.gpu.ops.views import Rows
from vkflash.model.hparams import HParams

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
    from vkflash.gpu.graph import Graph


def attention_layers(hp: HParams) -> list[int]:
    """The trunk layers that are not GDN."""
    return [i for i in range(hp.L) if not hp.is_gdn[i]]


def weight_transforms(gf: GGUFFile, hp: HParams) -> dict[str, Transform]:
    """Legacy ssm_in / grouped ssm_ba rows re-ordered, expert stacks laid out for the MoE."""
    return hybrid_transforms(gf, hp)


def weight_stacks(gf: GGUFFile, hp: HParams) -> list[Stack]:
    """GDN input projections, router + shared gate, shared and routed gate/up (hybrid_stacks)."""
    return hybrid_stacks(gf, hp)


def allocate_state(gpu: "Gpu", gf: GGUFFile, hp: HParams, n_ctx: int, kv: CacheType, ub: int) -> RecurrentState:
    """GDN conv and SSM states (+ checkpoint slots) of every GDN layer."""
    return RecurrentState.allocate(gpu, hp, n_draft())


@dataclass
class Scratch:
    """The residual h [ub, d] and the sublayers' activations."""

    ub: int
    x: Buffer
    hy: HybridScratch

    @classmethod
    def allocate(cls, gpu: "Gpu", hp: HParams, ub: int, n_split: int) -> "Scratch":
        return cls(ub, gpu.buffer(4 * ub * hp.d, "h"), HybridScratch.allocate(gpu, hp, ub, n_split))


def build(g: "Graph", m: StepModel, s: Scratch, n: int, head: Head) -> None:
    """The whole forward of an n-token step (tokens and positions from the params buffer)."""
    if not 1 <= n <= s.ub:
        raise ValueError(f"qwen3next step of {n} tokens; the scratch holds 1..{s.ub}")
    hp, w, st = m.hp, m.weights, m.state
    d = hp.d
    x, u = Rows(s.x, n, d), Rows(s.hy.u, n, d)
    n_slots = st.slots_for(n)
    embed_tokens(g, m, x)
    for i in range(hp.L):
        b = f"blk.{i}."
        rms_norm(g, x, u, hp.eps, w[b + "attn_norm.weight"].buf, name=b + "attn_norm")  # (N1)
        if hp.is_gdn[i]:
            gdn_sublayer(g, m, s.hy, i, n, u, x, True, st.gdn[i], n_slots, HeadMap.GROUPED, Gate.SILU)  # (N3)
        else:
            attention_sublayer(g, m, s.hy, i, n, u, x, True)  # (N4)
        rms_norm(g, x, u, hp.eps, w[b + "post_attention_norm.weight"].buf, name=b + "ffn_norm")
        moe_sublayer(g, m, s.hy, i, n, u, x, True)
    lm_head(g, m, x, u, head)  # (N2)
