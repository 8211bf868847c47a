"""A tiny random qwen2 GGUF (no tokenizer) for GPU-forward tests: ragged random geometry,
matrices stored in a chosen GGML type, 1-D gains and biases in F32."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q

from vkflash.formats.gguf_write import FloatTensor, write_gguf


@dataclass(frozen=True)
class Geometry:
    """d, heads, kv heads, head dim, FFN width, vocabulary, layers."""

    d: int
    H: int
    H_kv: int
    Dh: int
    F: int
    V: int
    L: int


def write_qwen2(path: Path, rng: np.random.Generator, geo: Geometry, qtype: Q = Q.F32, embd: Q | None = None,
                tied: bool = False, n_ctx_train: int = 4096) -> None:
    """Write a qwen2 GGUF: matrices as `qtype`, token_embd as `embd` (default qtype), output tied or not."""
    d, H, H_kv, Dh, F, V = geo.d, geo.H, geo.H_kv, geo.Dh, geo.F, geo.V

    def mat(n_out: int, k: int, t: Q = qtype) -> FloatTensor:
        return FloatTensor(rng.normal(0, 1 / np.sqrt(k), (n_out, k)).astype(np.float32), t)

    def gain(n: int) -> np.ndarray:
        return (1 + rng.uniform(-0.2, 0.2, n)).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return rng.normal(0, 0.3, n).astype(np.float32)

    tensors: dict[str, object] = {
        "token_embd.weight": FloatTensor(rng.normal(0, 1, (V, d)).astype(np.float32), embd or qtype),
        "output_norm.weight": gain(d),
    }
    if not tied:
        tensors["output.weight"] = mat(V, d)
    for i in range(geo.L):
        b = f"blk.{i}."
        tensors.update({
            b + "attn_norm.weight": gain(d),
            b + "attn_q.weight": mat(H * Dh, d), b + "attn_q.bias": bias(H * Dh),
            b + "attn_k.weight": mat(H_kv * Dh, d), b + "attn_k.bias": bias(H_kv * Dh),
            b + "attn_v.weight": mat(H_kv * Dh, d), b + "attn_v.bias": bias(H_kv * Dh),
            b + "attn_output.weight": mat(d, H * Dh),
            b + "ffn_norm.weight": gain(d),
            b + "ffn_gate.weight": mat(F, d), b + "ffn_up.weight": mat(F, d), b + "ffn_down.weight": mat(d, F),
        })
    meta = {
        "qwen2.context_length": n_ctx_train, "qwen2.embedding_length": d, "qwen2.block_count": geo.L,
        "qwen2.feed_forward_length": F, "qwen2.attention.head_count": H, "qwen2.attention.head_count_kv": H_kv,
        "qwen2.attention.key_length": Dh, "qwen2.attention.value_length": Dh, "qwen2.vocab_size": V,
        "qwen2.rope.freq_base": float(rng.choice([1e4, 1e6])), "qwen2.attention.layer_norm_rms_epsilon": 1e-6,
    }
    write_gguf(path, "qwen2", meta, tensors)  # type: ignore[arg-type]
