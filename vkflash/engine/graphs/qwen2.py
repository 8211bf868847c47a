"""The qwen2 step graph (MODEL.md §5.9 N1/N2 with plain attention A1–A6, A8): for n tokens,

    x = token_embd[ids]
    for each layer i:  u = rms(x) ⊙ attn_norm;  q, k, v = W_q u + b_q, W_k u + b_k, W_v u + b_v
                       q, k = RoPE_p(q), RoPE_p(k);  cache[p] = (k, v);  x += W_o attn(q, cache)
                       u = rms(x) ⊙ ffn_norm;  x += W_down (silu(W_gate u) ⊙ W_up u)
    logits = W_out (rms(x) ⊙ output_norm) for the rows the head asks for, and their argmax.

q and k share one row buffer ([q heads | k heads] per token) so one RoPE dispatch rotates both,
and W_q, W_k (stacked at upload when their types agree) fill it in one matmul; the FFN gate's
silu, the up-projection's product and both residual adds are matmul epilogues (one fused GEMV
for a stacked gate/up in decode).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from vkflash.engine.graphs.common import SPLIT_MAX_TOKENS, Head, StepModel, append_kv, embed_tokens, lm_head
from vkflash.engine.weights_gpu import Stack
from vkflash.formats.gguf_file import GGUFFile
from vkflash.gpu.memory import Buffer
from vkflash.gpu.ops.attention import Heads, attention, partial_bytes
from vkflash.gpu.ops.matmul import Epilogue, glu_matmul, matmul
from vkflash.gpu.ops.norm import rms_norm
from vkflash.gpu.ops.rope import rope_neox
from vkflash.gpu.ops.views import Rows
from vkflash.model.hparams import HParams

if TYPE_CHECKING:
    from vkflash.gpu.context import Gpu
    from vkflash.gpu.graph import Graph


def attention_layers(hp: HParams) -> list[int]:
    """Every qwen2 layer has attention."""
    return list(range(hp.L))


def weight_stacks(gf: GGUFFile, hp: HParams) -> list[Stack]:
    """Per layer: W_q with W_k (and their biases: q and k share a row buffer) and W_gate with W_up."""
    out = []
    for i in range(hp.L):
        b = f"blk.{i}."
        for names in (("attn_q.weight", "attn_k.weight"), ("attn_q.bias", "attn_k.bias"),
                      ("ffn_gate.weight", "ffn_up.weight")):
            out.append(Stack(b + "+".join(names), tuple(b + t for t in names)))
    return out


@dataclass
class Scratch:
    """Activations of up to `ub` tokens, shared by every step graph (steps run one at a time)."""

    ub: int
    x: Buffer  # residual h, [ub, d]
    u: Buffer  # normed input of a sublayer, [ub, d]
    qk: Buffer  # [ub, (H + H_kv)·Dh]: roped q heads then k heads
    v: Buffer  # [ub, H_kv·Dh]
    o: Buffer  # attention output, [ub, H·Dh]
    gate: Buffer  # silu(W_gate u), [ub, F]
    ffn: Buffer  # silu(W_gate u) ⊙ W_up u, [ub, F]
    partial: Buffer  # flash-decode partials

    @classmethod
    def allocate(cls, gpu: "Gpu", hp: HParams, ub: int, n_split: int) -> "Scratch":
        d, Dh, F = hp.d, hp.Dh, hp.F_dense

        def buf(cols: int, name: str) -> Buffer:
            return gpu.buffer(4 * ub * cols, name)

        part = partial_bytes(min(ub, SPLIT_MAX_TOKENS), hp.H, Dh, n_split) if n_split > 1 else 4
        return cls(ub, buf(d, "x"), buf(d, "u"), buf((hp.H + hp.H_kv) * Dh, "qk"), buf(hp.H_kv * Dh, "v"),
                   buf(hp.H * Dh, "o"), buf(F, "ffn_gate"), buf(F, "ffn_h"), gpu.buffer(part, "attn.partial"))


def _attention(g: "Graph", m: StepModel, s: Scratch, i: int, n: int) -> None:
    """Layer i's attention sublayer on n tokens: x += W_o attn(rms(x) ⊙ attn_norm)."""
    hp, w, p = m.hp, m.weights, m.params
    H, H_kv, Dh, d = hp.H, hp.H_kv, hp.Dh, hp.d
    b = f"blk.{i}."
    x, u = Rows(s.x, n, d), Rows(s.u, n, d)
    rms_norm(g, x, u, hp.eps, w[b + "attn_norm.weight"].buf, name=b + "attn_norm")
    qk_cols = (H + H_kv) * Dh
    q = Rows(s.qk, n, H * Dh, 0, qk_cols)
    k = Rows(s.qk, n, H_kv * Dh, H * Dh, qk_cols)
    v = Rows(s.v, n, H_kv * Dh)
    wqk = w.stacked(b + "attn_q.weight", b + "attn_k.weight")
    bq, bk = w[b + "attn_q.bias"].vector(), w[b + "attn_k.bias"].vector()
    if wqk is not None and bk.buf is bq.buf:  # one matmul, the biases stacked alike
        matmul(g, wqk, u, Rows(s.qk, n, qk_cols), Epilogue(bias=Rows(bq.buf, 1, qk_cols, bq.off)),
               name=b + "attn_q+attn_k")
    else:
        matmul(g, w[b + "attn_q.weight"].matrix(), u, q, Epilogue(bias=bq), name=b + "attn_q")
        matmul(g, w[b + "attn_k.weight"].matrix(), u, k, Epilogue(bias=bk), name=b + "attn_k")
    matmul(g, w[b + "attn_v.weight"].matrix(), u, v, Epilogue(bias=w[b + "attn_v.bias"].vector()), name=b + "Vcur")
    heads = Rows(s.qk, n * (H + H_kv), Dh)
    rope_neox(g, heads, heads, H + H_kv, hp.n_rot, hp.theta, p.buf, p.pos, name=b + "Qcur+Kcur")
    rows = Rows(s.qk, n, qk_cols)
    cache = m.kv[i]
    append_kv(g, m, i, Heads(rows, H_kv, Dh, col=H * Dh), Heads(v, H_kv, Dh), b)
    o = Rows(s.o, n, H * Dh)
    n_split = m.splits(n)
    attention(g, p.buf, 0, Heads(rows, H, Dh), cache.k, cache.v, Heads(o, H, Dh), n_split=n_split,
              partial=s.partial if n_split > 1 else None, name=b + "kqv_out")
    matmul(g, w[b + "attn_output.weight"].matrix(), o, x, Epilogue(res=x), name=b + "attn_residual")


def _ffn(g: "Graph", m: StepModel, s: Scratch, i: int, n: int) -> None:
    """Layer i's FFN sublayer on n tokens: x += W_down(silu(W_gate u) ⊙ W_up u), u = rms(x) ⊙ ffn_norm."""
    hp, w = m.hp, m.weights
    b = f"blk.{i}."
    x, u = Rows(s.x, n, hp.d), Rows(s.u, n, hp.d)
    gate, h = Rows(s.gate, n, hp.F_dense), Rows(s.ffn, n, hp.F_dense)
    rms_norm(g, x, u, hp.eps, w[b + "ffn_norm.weight"].buf, name=b + "ffn_norm")
    glu = w.stacked(b + "ffn_gate.weight", b + "ffn_up.weight")
    if glu is not None:  # silu(gate) ⊙ up in one decode pass
        glu_matmul(g, glu, u, h, name=b + "ffn_glu")
    else:
        matmul(g, w[b + "ffn_gate.weight"].matrix(), u, gate, Epilogue(act="silu"), name=b + "ffn_gate")
        matmul(g, w[b + "ffn_up.weight"].matrix(), u, h, Epilogue(mul=gate), name=b + "ffn_up")
    matmul(g, w[b + "ffn_down.weight"].matrix(), h, x, Epilogue(res=x), name=b + "l_out")


def build(g: "Graph", m: StepModel, s: Scratch, n: int, head: Head) -> None:
    """The whole forward of an n-token step (tokens and positions from the params buffer)."""
    if not 1 <= n <= s.ub:
        raise ValueError(f"qwen2 step of {n} tokens; the scratch holds 1..{s.ub}")
    embed_tokens(g, m, Rows(s.x, n, m.hp.d))
    for i in range(m.hp.L):
        _attention(g, m, s, i, n)
        _ffn(g, m, s, i, n)
    lm_head(g, m, Rows(s.x, n, m.hp.d), Rows(s.u, n, m.hp.d), head)
