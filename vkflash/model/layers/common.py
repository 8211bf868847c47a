"""Shared pieces of the reference layers: options, the dump hook and scalar activations (§2)."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Self

import numpy as np

from vkflash.model.reference import check_global, layer_name

Dump = Callable[[str, np.ndarray], None]
Route = Callable[[int, np.ndarray, np.ndarray], np.ndarray]  # (layer, probs (T, E), top-k (T, k)) → top-k
Select = Callable[[int, np.ndarray, np.ndarray], np.ndarray]  # (layer, positions (T,), block scores) → scores


@dataclass
class RefOptions:
    """Reference forward switches: QSA mode/tie rule, gathered path, GDN chunking, cache dtype, dump hook."""

    qsa_mode: str = "block"  # "block" (HF-exact, default) or "cell" (llama.cpp, BLKTOPK=0)
    tie_rule: str = "heap"  # cell mode ties: "heap" (libstdc++ partial_sort) or "index" (lower first)
    gathered: bool = False  # (S1)–(S3) gathered sparse attention instead of the masked path
    gather_tile: int = 64  # query tile of the gathered path
    gdn_chunk: int = 64  # chunk size c_s of the chunked GDN prefill; 0 = recurrent (G8) always
    cache_dtype: Any = np.float32  # K/V and indexer-key cache dtype, rounded at write (F16 like llama.cpp default)
    mtp_hnorm: str = "grouped"  # (T2) "grouped" per stream (default) or "flat" (vLLM)
    keep_hidden: bool = False  # keep h_nextn of every position (MTP drafting)
    dump: Dump | None = None
    route: Route | None = None  # resolves router near-ties as another engine did (comparisons, §7.10)
    select: Select | None = None  # the QSA block scores selection uses, likewise for selection near-ties

    def __post_init__(self) -> None:
        if self.qsa_mode not in ("block", "cell"):
            raise ValueError(f"qsa_mode must be 'block' or 'cell', not {self.qsa_mode!r}")
        if self.tie_rule not in ("heap", "index"):
            raise ValueError(f"tie_rule must be 'heap' or 'index', not {self.tie_rule!r}")
        if self.mtp_hnorm not in ("grouped", "flat"):
            raise ValueError(f"mtp_hnorm must be 'grouped' or 'flat', not {self.mtp_hnorm!r}")


class Snapshots:
    """Base of the reference's per-sequence states: snapshot() is a deep copy sharing the (read-only)
    weights and options."""

    weights: Any
    opts: RefOptions

    def snapshot(self) -> Self:
        """A deep copy sharing the (read-only) weights and options."""
        return copy.deepcopy(self, memo={id(self.weights): self.weights, id(self.opts): self.opts})


def emit(opts: RefOptions, i: int, op: str, x: np.ndarray) -> None:
    """Pass layer i's intermediate `op` to the dump hook, if any."""
    if opts.dump is not None:
        opts.dump(layer_name(i, op), x)


def emit_global(opts: RefOptions, name: str, x: np.ndarray) -> None:
    """Pass a global intermediate to the dump hook, if any."""
    if opts.dump is not None:
        opts.dump(check_global(name), x)


def sigmoid(x: np.ndarray) -> np.ndarray:
    """σ(x) = 1/(1+e^{−x}) (e^{−x} may overflow to inf, giving the correct 0)."""
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


def silu(x: np.ndarray) -> np.ndarray:
    """silu(x) = x·σ(x)."""
    return x * sigmoid(x)


def softplus(x: np.ndarray) -> np.ndarray:
    """softplus(x) = ln(1+eˣ), or x when x > 20."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    """Softmax along an axis (−inf entries get 0)."""
    m = np.max(x, axis=axis, keepdims=True)
    e = np.exp(x - m)
    return e / np.sum(e, axis=axis, keepdims=True)
