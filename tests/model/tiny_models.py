"""In-memory tiny models (MODEL.md §9 sizes, random weights) for the reference's own tests.

`tiny_meta(arch, **over)` gives typed metadata; `tiny_arrays(hp, ...)` random tensors that fill
the arch's tensor table with the §9 init rules; `tiny_model(arch, ...)` both, loaded in float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from threadpoolctl import threadpool_limits

from vkflash.model.hparams import HParams, Metadata, hparams_from_metadata
from vkflash.model.ple_hash import build_layer_multipliers
from vkflash.model.tensors import tensor_table
from vkflash.model.weights import ArraySource, Weights, load_weights

# Tiny matrices: multi-threaded BLAS only adds contention on shared CI cores (5x slower measured).
threadpool_limits(1, user_api="blas")

PLE_SIZES = [1009, 1013, 1019, 1021]
PLE_ROWS = 4096


def _u32(v: int) -> tuple[str, Any]:
    return ("u32", v)


def tiny_meta(arch: str = "qwen4exp", *, mtp: bool = False, drop: tuple[str, ...] = (),
              over: dict[str, tuple[str, Any]] | None = None) -> Metadata:
    """Tiny metadata of §9 for an arch; `drop` removes keys (suffixes), `over` sets typed values."""
    L_all = 9 if mtp else 8
    a = arch
    kv: dict[str, tuple[str, Any]] = {
        "general.architecture": ("str", arch),
        f"{a}.context_length": _u32(4096),
        f"{a}.embedding_length": _u32(128),
        f"{a}.block_count": _u32(L_all),
        f"{a}.vocab_size": _u32(512),
        f"{a}.attention.head_count": _u32(6),
        f"{a}.attention.head_count_kv": _u32(2),
        f"{a}.attention.layer_norm_rms_epsilon": ("f32", 1e-6),
        f"{a}.rope.freq_base": ("f32", 1e7),
    }
    if arch == "qwen2":
        kv.update({f"{a}.feed_forward_length": _u32(96), f"{a}.attention.head_count": _u32(4),
                   f"{a}.rope.freq_base": ("f32", 1e6)})
    else:
        kv.update({
            f"{a}.attention.key_length": _u32(64), f"{a}.attention.value_length": _u32(64),
            f"{a}.rope.dimension_count": _u32(16),
            f"{a}.ssm.conv_kernel": _u32(4), f"{a}.ssm.state_size": _u32(32), f"{a}.ssm.group_count": _u32(2),
            f"{a}.ssm.time_step_rank": _u32(6), f"{a}.ssm.inner_size": _u32(192),
            f"{a}.full_attention_interval": _u32(4),
            f"{a}.expert_count": _u32(16), f"{a}.expert_used_count": _u32(4),
            f"{a}.expert_feed_forward_length": _u32(64), f"{a}.expert_shared_feed_forward_length": _u32(64),
        })
    if mtp:
        kv[f"{a}.nextn_predict_layers"] = _u32(1)
    if arch == "qwen4exp":
        mult = build_layer_multipliers(512, 3)
        kv.update({
            f"{a}.rope.dimension_sections": ("arr[i32]", np.array([3, 3, 2, 0], np.int32)),
            f"{a}.hyper_connection.count": _u32(4), f"{a}.hyper_connection.low_rank": _u32(16),
            f"{a}.attention.indexer.head_count": _u32(4), f"{a}.attention.indexer.key_length": _u32(32),
            f"{a}.attention.indexer.top_k": _u32(32),
            f"{a}.attention.compress_ratios": ("arr[i32]", np.array([0, 0, 0, 4, 0, 0, 0, 4] + [0] * (L_all - 8), np.int32)),
            f"{a}.ple.layers": ("arr[i32]", np.array([1], np.int32)),
            f"{a}.ple.ngram_size": _u32(3), f"{a}.ple.heads_per_ngram": _u32(2), f"{a}.ple.conv_kernel": _u32(4),
            f"{a}.embedding_length_per_layer_input": _u32(32),
            f"{a}.ple.eos_token_id": _u32(2), f"{a}.ple.image_token_id": _u32(3),
            f"{a}.ple.layer_multipliers": ("arr[u64]", np.array(mult, np.uint64)),
            f"{a}.ple.head_offsets": ("arr[u64]", np.array([0, 1009, 2022, 3041], np.uint64)),
            f"{a}.ple.head_vocab_sizes": ("arr[u64]", np.array(PLE_SIZES, np.uint64)),
        })
    for suffix in drop:
        kv.pop(f"{a}.{suffix}")
    for suffix, typed in (over or {}).items():
        kv[f"{a}.{suffix}"] = typed
    return Metadata(arch=arch, kv=kv)


def _init(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """§9 init rules by tensor name (NumPy shape)."""
    if name.endswith("ssm_norm.weight"):
        return rng.uniform(0.9, 1.1, shape)
    if name.endswith("ssm_a"):
        return -rng.uniform(0.05, 1.0, shape)
    if name.endswith("ssm_dt.bias"):
        return 1 + rng.uniform(-0.5, 0.5, shape)
    if name.endswith("ple_conv1d.weight"):
        return rng.normal(0, 0.3, shape)
    if "norm" in name and len(shape) <= 2 and not name.endswith("_down.weight") and not name.endswith("_up.weight"):
        return 1 + rng.uniform(-0.1, 0.1, shape)
    if name.endswith(".bias"):
        return rng.normal(0, 0.1, shape)
    if name in ("token_embd.weight", "per_layer_token_embd.weight") or name.endswith("embed_tokens.weight"):
        return rng.normal(0, 1, shape)
    scale = 1 / np.sqrt(shape[-1])
    if name.endswith("ffn_gate_inp.weight"):
        scale *= 4
    return rng.normal(0, scale, shape)


def tiny_arrays(hp: HParams, rng: np.random.Generator, *, names: frozenset[str] = frozenset(),
                boost_indexer: bool = True, mtp_block: bool = False, trunk: bool = True,
                untied: bool = True) -> dict[str, np.ndarray]:
    """Random tensors for every required entry of hp's table (alternatives/optionals chosen by `names`)."""
    hint = set(names) | ({"output.weight"} if untied else set())
    if mtp_block:
        hint.add(f"blk.{hp.L}.attn_q.weight")
    if trunk:
        hint.add("blk.0.attn_q.weight")
    table, _, _ = tensor_table(hp, frozenset(hint))
    arrays: dict[str, np.ndarray] = {}
    for name, spec in table.items():
        if not spec.required and name not in hint:
            continue
        ne = _first_shape(spec.expect, hp)
        arrays[name] = _init(name, tuple(reversed(ne)), rng).astype(np.float32)
    if hp.arch == "qwen4exp" and boost_indexer and "token_embd.weight" in arrays:
        _boost_indexer(hp, arrays, rng)
    return arrays


def _first_shape(expect: str, hp: HParams) -> tuple[int, ...]:
    """The first shape of a spec description ('{a, b} or {c}'); '≥n' means exactly n (PLE rows)."""
    first = expect.split(" or ")[0].strip("{}")
    dims = []
    for part in first.split(", "):
        dims.append(PLE_ROWS if part.startswith("≥") else int(part))
    return tuple(dims)


def _boost_indexer(hp: HParams, arrays: dict[str, np.ndarray], rng: np.random.Generator) -> None:
    """§9: 6·b on every embedding row, 0.5·a·bᵀ on W_Iq (each head) and W_Ik, a on dims n_rot..D_I."""
    b = rng.normal(size=hp.d)
    b /= np.linalg.norm(b)
    a = np.zeros(hp.D_I)
    a[hp.n_rot:] = rng.normal(size=hp.D_I - hp.n_rot)
    a /= np.linalg.norm(a)
    arrays["token_embd.weight"] += (6 * b).astype(np.float32)
    for name in list(arrays):
        if name.endswith("indexer.k_proj.weight"):
            arrays[name] += (0.5 * np.outer(a, b)).astype(np.float32)
        elif name.endswith("indexer.q_proj.weight"):
            arrays[name] += (0.5 * np.tile(np.outer(a, b), (hp.n_I, 1))).astype(np.float32)


def tiny_model(arch: str = "qwen4exp", *, dtype: Any = np.float64, rng: np.random.Generator | None = None,
               mtp: bool = False, names: frozenset[str] = frozenset(), boost_indexer: bool = True,
               over: dict[str, tuple[str, Any]] | None = None) -> Weights:
    """A loaded tiny model of `arch` with fresh random weights."""
    rng = rng or np.random.default_rng()
    hp = hparams_from_metadata(tiny_meta(arch, mtp=mtp, over=over))
    arrays = tiny_arrays(hp, rng, names=names, boost_indexer=boost_indexer, mtp_block=mtp)
    return load_weights(hp, ArraySource(arrays), dtype)
