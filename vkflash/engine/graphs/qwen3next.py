"""The qwen3next step graph (MODEL.md §5.9 N1–N4): for n tokens,

    h = token_embd[ids]
    for each layer i:  h += Mixer(rms(h) ⊙ attn_norm)        GDN (grouped heads, silu gate) or
                                                             gated attention with NeoX RoPE
                       h += MoE(rms(h) ⊙ post_attention_norm)
    logits = W_out(rms(h) ⊙ output_norm) for the rows the head asks for, and their argmax.

Recurrent states live in `model.state` (engine/state.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vkflash.engine.graphs.common import Head, StepModel, embed_tokens, lm_head
from vkflash.engine.graphs.hybrid import (attention_sublayer, gdn_sublayer, hybrid_stacks, hybrid_transforms,
                                          moe_sublayer)
from vkflash.engine.state import RecurrentState, n_draft
from vkflash.engine.weights_gpu import Stack, Transform
from vkflash.formats.gguf_file import GGUFFile
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops.attention import CacheType
from vkflash.gpu.ops.gdn import Gate, HeadMap
from vkflash.gpu.ops.norm import rms_norm
from vkflash.model.hparams import HParams

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
    from vkflash.gpu.graph import Graph


class Qwen3NextGraph:
    """ArchGraph of qwen3next: GDN and gated-attention layers, each followed by the MoE."""

    def attention_layers(self, hp: HParams) -> list[int]:
        """The trunk layers that are not GDN."""
        return [i for i in range(hp.L) if not hp.is_gdn[i]]

    def weight_transforms(self, gf: GGUFFile, hp: HParams) -> dict[str, Transform]:
        """Legacy ssm_in / grouped ssm_ba rows re-ordered, conv kernels as f32 (hybrid_transforms)."""
        return hybrid_transforms(gf, hp)

    def weight_stacks(self, gf: GGUFFile, hp: HParams) -> list[Stack]:
        """GDN input projections, router + shared gate, shared and routed gate/up (hybrid_stacks)."""
        return hybrid_stacks(gf, hp)

    def host_tables(self, hp: HParams) -> list[str]:
        return []

    def extra_dim(self, gf: GGUFFile, hp: HParams) -> int:
        return 0

    def allocate_state(self, gpu: "Gpu", gf: GGUFFile, hp: HParams, n_ctx: int, kv: CacheType,
                       ub: int, held: int) -> RecurrentState:
        """GDN conv and SSM states (in planes, for rollback) of every GDN layer."""
        return RecurrentState.allocate(gpu, hp, n_draft())

    def build(self, g: "Graph", m: StepModel, n: int, head: Head) -> None:
        """The whole forward of an n-token step (tokens and positions from the params buffer)."""
        hp, w, st = m.hp, m.weights, m.state
        ring = st.ring(n)
        h = embed_tokens(g, m, n)
        for i in range(hp.L):
            b = f"blk.{i}."
            u = g.tensor(n, hp.d, b + "attn_norm")
            rms_norm(g, h, u, hp.eps, w[b + "attn_norm.weight"].buf, name=b + "attn_norm")  # (N1)
            if hp.is_gdn[i]:  # (N3)
                a = gdn_sublayer(g, m, i, u, st.gdn[i], ring, HeadMap.GROUPED, Gate.SILU)
            else:  # (N4)
                a = attention_sublayer(g, m, i, u)
            E.add(g, h, a, h, name=b + "attn_residual")
            u = g.tensor(n, hp.d, b + "ffn_norm")
            rms_norm(g, h, u, hp.eps, w[b + "post_attention_norm.weight"].buf, name=b + "ffn_norm")
            E.add(g, h, moe_sublayer(g, m, i, u), h, name=b + "l_out")
        lm_head(g, m, h, head)  # (N2)
