"""The qwen2 step graph (MODEL.md §5.9 N1/N2 with plain attention A1–A6, A8): for n tokens,

    x = token_embd[ids]
    for each layer i:  u = rms(x) ⊙ attn_norm;  q, k, v = W_q u + b_q, W_k u + b_k, W_v u + b_v
                       q, k = RoPE_p(q), RoPE_p(k);  cache[p] = (k, v);  x += W_o attn(q, cache)
                       u = rms(x) ⊙ ffn_norm;  x += W_down (silu(W_gate u) ⊙ W_up u)
    logits = W_out (rms(x) ⊙ output_norm) for the rows the head asks for, and their argmax.

q and k are the two halves of one row ([q heads | k heads] per token), so one RoPE rotates every
head of the row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vkflash.engine.graphs.common import Head, StepModel, embed_tokens, lm_head
from vkflash.engine.weights_gpu import Stack, Transform
from vkflash.formats.gguf_file import GGUFFile
from vkflash.gpu.ops import eltwise as E
from vkflash.gpu.ops.attention import CacheType, Heads, attention, kv_append
from vkflash.gpu.ops.matmul import matmul
from vkflash.gpu.ops.norm import rms_norm
from vkflash.gpu.ops.rope import rope_neox
from vkflash.gpu.ops.views import Rows
from vkflash.model.hparams import HParams

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
    from vkflash.gpu.graph import Graph


def attention_sublayer(g: "Graph", m: StepModel, i: int, u: Rows) -> Rows:
    """Layer i's attention on the normed rows u: W_o attn(RoPE(W_q u + b_q), RoPE(W_k u + b_k), W_v u + b_v)."""
    hp, w, p = m.hp, m.weights, m.params
    H, H_kv, Dh, n = hp.H, hp.H_kv, hp.Dh, u.n_rows
    b = f"blk.{i}."
    qk = g.tensor(n, (H + H_kv) * Dh, b + "Qcur+Kcur")
    q, k = qk.cols(0, H * Dh), qk.cols(H * Dh, H_kv * Dh)
    v = g.tensor(n, H_kv * Dh, b + "Vcur")
    matmul(g, w[b + "attn_q.weight"].matrix(), u, q, name=b + "attn_q")
    matmul(g, w[b + "attn_k.weight"].matrix(), u, k, name=b + "attn_k")
    matmul(g, w[b + "attn_v.weight"].matrix(), u, v, name=b + "attn_v")
    E.add(g, q, w[b + "attn_q.bias"].vector(), q, name=b + "attn_q.bias")
    E.add(g, k, w[b + "attn_k.bias"].vector(), k, name=b + "attn_k.bias")
    E.add(g, v, w[b + "attn_v.bias"].vector(), v, name=b + "Vcur")
    heads = Rows(qk.buf, n * (H + H_kv), Dh, qk.off)  # every head of the [q | k] rows
    rope_neox(g, heads, heads, H + H_kv, hp.n_rot, hp.theta, p.buf, p.pos, name=b + "Qcur+Kcur")  # (A3)
    cache = m.kv[i]
    kv_append(g, p.buf, p.pos, Heads(qk, H_kv, Dh, col=H * Dh), cache.k, name=b + "cache_k")  # (A4)
    kv_append(g, p.buf, p.pos, Heads(v, H_kv, Dh), cache.v, name=b + "cache_v")
    o = g.tensor(n, H * Dh, b + "kqv_out")
    attention(g, p.buf, 0, Heads(qk, H, Dh), cache.k, cache.v, Heads(o, H, Dh), name=b + "kqv_out")  # (A5)–(A6)
    a = g.tensor(n, hp.d, b + "attn_out")
    matmul(g, w[b + "attn_output.weight"].matrix(), o, a, name=b + "attn_out")  # (A8)
    return a


def ffn_sublayer(g: "Graph", m: StepModel, i: int, u: Rows) -> Rows:
    """Layer i's SwiGLU FFN: W_down(silu(W_gate u) ⊙ W_up u)."""
    hp, w, n = m.hp, m.weights, u.n_rows
    b = f"blk.{i}."
    gate, up = g.tensor(n, hp.F_dense, b + "ffn_gate"), g.tensor(n, hp.F_dense, b + "ffn_up")
    h, f = g.tensor(n, hp.F_dense, b + "ffn_h"), g.tensor(n, hp.d, b + "ffn_out")
    matmul(g, w[b + "ffn_gate.weight"].matrix(), u, gate, name=b + "ffn_gate")
    E.silu(g, gate, gate, name=b + "ffn_silu")
    matmul(g, w[b + "ffn_up.weight"].matrix(), u, up, name=b + "ffn_up")
    E.mul(g, gate, up, h, name=b + "ffn_h")
    matmul(g, w[b + "ffn_down.weight"].matrix(), h, f, name=b + "ffn_out")
    return f


class Qwen2Graph:
    """ArchGraph of qwen2: every layer attention + dense FFN, no state beyond K/V."""

    def attention_layers(self, hp: HParams) -> list[int]:
        return list(range(hp.L))

    def weight_transforms(self, gf: GGUFFile, hp: HParams) -> dict[str, Transform]:
        return {}

    def weight_stacks(self, gf: GGUFFile, hp: HParams) -> list[Stack]:
        """Per layer: W_q with W_k (and their biases: q and k share a row) and W_gate with W_up."""
        out = []
        for i in range(hp.L):
            b = f"blk.{i}."
            for names in (("attn_q.weight", "attn_k.weight"), ("attn_q.bias", "attn_k.bias"),
                          ("ffn_gate.weight", "ffn_up.weight")):
                out.append(Stack(b + "+".join(names), tuple(b + t for t in names)))
        return out

    def host_tables(self, hp: HParams) -> list[str]:
        return []

    def extra_dim(self, gf: GGUFFile, hp: HParams) -> int:
        return 0

    def allocate_state(self, gpu: "Gpu", gf: GGUFFile, hp: HParams, n_ctx: int, kv: CacheType, ub: int,
                       held: int) -> None:
        return None

    def build(self, g: "Graph", m: StepModel, n: int, head: Head) -> None:
        """The whole forward of an n-token step (tokens and positions from the params buffer)."""
        hp, w = m.hp, m.weights
        x = embed_tokens(g, m, n)
        for i in range(hp.L):
            b = f"blk.{i}."
            u = g.tensor(n, hp.d, b + "attn_norm")
            rms_norm(g, x, u, hp.eps, w[b + "attn_norm.weight"].buf, name=b + "attn_norm")
            E.add(g, x, attention_sublayer(g, m, i, u), x, name=b + "attn_residual")
            u = g.tensor(n, hp.d, b + "ffn_norm")
            rms_norm(g, x, u, hp.eps, w[b + "ffn_norm.weight"].buf, name=b + "ffn_norm")
            E.add(g, x, ffn_sublayer(g, m, i, u), x, name=b + "l_out")
        lm_head(g, m, x, head)
