"""The MTP draft head on the GPU (MODEL.md §5.10): its weights (the model's own blk.L, or an MTP-only
GGUF named by MODEL_DRAFT, in whatever types the kernels decode), its own one-layer K/V cache, step
params and head buffers, and the drafting protocol's bookkeeping (D1, D4).

The target's step graph leaves the h_nextn rows of its last step in a buffer (GpuForward(mtp=True)).
Rows of that step whose next token is known are *pending*: their MTP rows (x_p, H_target[p−1]) are
still to be written into the head's cache. A round of drafting runs them as catch-up rows, then the
draft row and the chained rows (graphs/mtp.py); a round without drafting runs them as catch-up
only. The draft graphs are sized by the rows they carry (never the target's ubatch graphs) and
share the Gpu's arena with the target's, as all graphs of a Gpu do.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from vkflash.engine.caches import allocate_kv
from vkflash.engine.gpu_forward import GpuForward
from vkflash.engine.guard import Fill, cache_fill
from vkflash.engine.graphs import mtp
from vkflash.engine.graphs.common import HeadBuffers, StepModel
from vkflash.engine.step_params import ROW_STEP_MAX, StepParams
from vkflash.engine.weights_gpu import GpuTensor, GpuWeights, device_embeddable, host_row_gather, upload_weights
from vkflash.errors import ConfigError
from vkflash.formats.gguf_file import GGUFFile
from vkflash.gpu.graph import Graph
from vkflash.gpu.memory import Buffer
from vkflash.model.hparams import HParams, hparams_from_gguf
from vkflash.model.tensors import validate_tensors

SHARED_KEYS = ("d", "V", "H", "H_kv", "Dh", "n_rot", "theta", "eps", "E", "k", "F", "F_s", "hc", "lr", "L")
"""Hyper-parameters a separate draft file must share with its target."""


def _check_draft(target: HParams, draft: HParams, name: str) -> None:
    """A separate MTP file fits the target: qwen4exp, the same geometry, its block at index L."""
    if draft.arch != "qwen4exp" or draft.n_mtp < 1:
        raise ConfigError(f"MODEL_DRAFT {name}: not a qwen4exp MTP file (arch {draft.arch}, "
                          f"nextn_predict_layers {draft.n_mtp})")
    bad = [k for k in SHARED_KEYS if getattr(draft, k) != getattr(target, k)]
    if bad:
        k = bad[0]
        raise ConfigError(f"MODEL_DRAFT {name} does not fit the model: {k} = {getattr(draft, k)}, the model has "
                          f"{getattr(target, k)}")


@dataclass(frozen=True)
class Drafted:
    """One round's draft: the drafted token ids, and their logits rows when asked for."""

    ids: list[int]
    logits: np.ndarray | None


class MtpDrafter:
    """The draft head of one GpuForward sequence (built with mtp=True): catch-up and drafting; it is
    the forward's step hooks, so every target step keeps its rows (GpuForward.StepHooks)."""

    def __init__(self, fwd: GpuForward, draft_path: str | os.PathLike[str] | None, k_max: int) -> None:
        """The head from `draft_path` (an MTP-only GGUF) or else the model file's own block; rounds
        of at most k_max drafted tokens."""
        if fwd.model.hidden is None:
            raise ConfigError("the MTP draft head needs a forward built with mtp=True")
        self.fwd, self.k_max = fwd, k_max
        gpu, hp = fwd.gpu, fwd.hp
        target = fwd.model.weights
        own = target
        self.source = f"{target.file.path.name}'s own blk.{hp.L}"
        if draft_path is not None:
            self.source = Path(draft_path).name
            gf = GGUFFile(draft_path)
            dhp = hparams_from_gguf(gf)
            _check_draft(hp, dhp, Path(draft_path).name)
            layout = validate_tensors(dhp, {n: t.ne for n, t in gf.tensors.items()})
            if not layout.has_mtp:
                raise ConfigError(f"MODEL_DRAFT {Path(draft_path).name} holds no MTP block (blk.{hp.L}.*)")
            stacks = fwd.arch.weight_stacks(gf, dhp) if gpu.options.stack_weights else ()
            own = upload_weights(gpu, gf, dhp, (), None, fwd.arch.weight_transforms(gf, dhp), stacks)
        elif f"blk.{hp.L}.nextn.eh_proj.weight" not in target.tensors:
            raise ConfigError(f"{fwd.model.weights.file.path.name} has no MTP block (blk.{hp.L}.nextn.*): "
                              "set MODEL_DRAFT to an MTP-only GGUF or turn MTP off")
        weights, (embed_file, embed_name) = _draft_weights(hp, own, target)
        table = weights.get("token_embd.weight")
        gather: Callable[[np.ndarray], np.ndarray] | None = None
        if table is None or not device_embeddable(table.qtype):
            gather = host_row_gather(embed_file, embed_name)
        self.device_chain = gather is None  # drafted tokens feed the next row without the host
        self._gather = gather
        emb = hp.d if gather is not None else 0
        self._own = list({id(t.buf): t.buf for t in own.tensors.values()}.values()) if own is not target else []
        kv = allocate_kv(gpu, hp, fwd.n_ctx, fwd.model.kv.type, [hp.L], fwd.guard.held)
        params = StepParams.allocate(gpu, fwd.ub, emb, 0, mtp.CELL_SHIFT)
        model = StepModel(gpu, hp, weights, kv, params, HeadBuffers.allocate(gpu, hp.V, k_max))
        rows = [StepParams.allocate(gpu, 1, emb, 0, mtp.CELL_SHIFT) for _ in range(k_max)]
        self.d = mtp.DraftModel(model, fwd.model.hidden, gpu.buffer(4 * hp.hc * hp.d, "mtp.chain"), rows)
        self._graphs: dict[tuple[object, ...], Graph] = {}
        self.reset()
        fwd.hooks = self
        fwd.draft = self

    # --- what the deep-context guard sees (engine/guard.py Draft) ----------------------------
    @property
    def can_shrink(self) -> bool:
        """No smaller quant to switch to (MODEL_DRAFT_SMALL is planned)."""
        return False

    def weights(self) -> list[Buffer]:
        """The buffers of a separate draft file's weights (the model's own block is the model's)."""
        return self._own

    def fills(self) -> list[Fill]:
        """The head's K/V cache, which grows with the context as the trunk's does."""
        kv = self.d.model.kv.layers[self.fwd.hp.L]
        return [cache_fill(kv.k), cache_fill(kv.v)]

    def shrink(self) -> None:
        raise NotImplementedError("the MTP draft has no smaller quant to switch to")

    def restore(self) -> None:
        """Nothing to restore: the draft never shrinks."""

    # --- bookkeeping -----------------------------------------------------------------------
    def reset(self) -> None:
        """A new sequence: nothing pending, an empty cache."""
        self._p0 = 1  # MTP position of pending row 0 (target position of hidden row 0, plus 1)
        self._c = 0  # pending rows: hidden rows [0, c)
        self._tokens: list[int] = []  # tokens of pending rows 0..c−2 (the last one's is the next token)
        self._pos0 = 0  # position of the last round's draft row

    @property
    def pending(self) -> int:
        """Pending rows (hidden rows of the last target step not yet in the head's cache)."""
        return self._c

    def before(self, p0: int, ids: np.ndarray) -> None:
        """A target step is about to overwrite the hidden rows: catch the pending ones up (ids[0]
        is the last one's token)."""
        self.catch_up(int(ids[0]))

    def after(self, p0: int, ids: np.ndarray) -> None:
        """The target fed ids at positions [p0, p0 + n): its hidden rows [0, n) are pending."""
        self._p0, self._c, self._tokens = p0 + 1, len(ids), [int(t) for t in ids[1:]]

    def truncated(self, n: int) -> None:
        """The target sequence was cut to n tokens: pending rows past it go (a rolled-back verify
        step keeps its first rows, D4)."""
        self._c = max(0, min(self._c, n - (self._p0 - 1)))
        del self._tokens[max(0, self._c - 1):]

    # --- GPU work --------------------------------------------------------------------------
    def catch_up(self, next_token: int) -> None:
        """(D1) write every pending row into the head's cache; `next_token` is the last one's token."""
        if self._c == 0:
            return
        toks = np.asarray(self._tokens + [next_token], np.int32)
        self._set(self.d.model.params, self._p0, toks)
        self._graph(("catch", self._c), lambda g: mtp.catch_up(g, self.d, self._c)).run()
        self._c = 0

    def draft(self, x: int, k: int, logits: bool = False) -> Drafted:
        """(D1) the pending rows, the draft row (x at the target's next position) and k − 1 chained
        rows on the device: k drafted ids (greedy), their logits rows with `logits`."""
        if not 1 <= k <= self.k_max or not self.device_chain:
            raise ValueError(f"draft: {k} tokens (1..{self.k_max}) need a device-embeddable draft table")
        g = self._start(x, k, True)
        g.run()
        return self._read(k, logits)

    def first(self, x: int) -> np.ndarray:
        """The draft row alone (after the pending rows): its logits; chained rows follow by `next`."""
        self._start(x, 1, False).run()
        return self._read(1, True).logits[0]  # type: ignore[index]

    def next(self, j: int, token: int) -> np.ndarray:
        """Chained row j (1 ≤ j < k_max) on the token the host drew after row j − 1: its logits."""
        p = self.d.rows[j]
        self._set(p, self._pos0 + j, np.array([token], np.int32))
        self._graph(("chain", j), lambda g: mtp.chained_row(g, self.d, j)).run()
        return self.d.model.head.logits.read(np.float32, self.fwd.n_vocab, 4 * j * self.fwd.n_vocab)

    def warm(self) -> None:
        """Record every graph a decoding round can use (up to k_max + 1 pending rows, up to k_max
        drafted tokens), so that timing sees replays only."""
        for c in range(1, self.k_max + 2):
            self._graph(("catch", c), lambda g, c=c: mtp.catch_up(g, self.d, c)).record()
            for k in range(1, self.k_max + 1 if self.device_chain else 2):
                self._round_graph(c, k, self.device_chain).record()
        for j in range(1, self.k_max):
            self._graph(("chain", j), lambda g, j=j: mtp.chained_row(g, self.d, j)).record()

    def _round_graph(self, c: int, k: int, device_chain: bool) -> Graph:
        chain = device_chain and k > 1
        return self._graph(("round", c, k if chain else 1),
                           lambda g: mtp.draft_round(g, self.d, c, k if chain else 1, chain), split=c > ROW_STEP_MAX)

    def _start(self, x: int, k: int, device_chain: bool) -> Graph:
        """Params of a round (pending rows, draft row at the position after them, chained rows)
        and its graph; the pending rows are written by it."""
        c = self._c
        if c == 0:
            raise ValueError("draft: no pending target row (the draft row needs the target's last hidden row)")
        if c > 1:
            self._set(self.d.model.params, self._p0, np.asarray(self._tokens, np.int32))
        self._pos0 = self._p0 + c - 1
        self._set(self.d.rows[0], self._pos0, np.array([x], np.int32))
        for j in range(1, k):
            self.d.rows[j].set(self._pos0 + j, np.zeros(1, np.int32))  # tokens come from the row before
        self._c = 0
        return self._round_graph(c, k, device_chain)

    def _read(self, k: int, logits: bool) -> Drafted:
        head = self.d.model.head
        ids = [int(t) for t in head.ids.read(np.uint32, k)]
        rows = head.logits.read(np.float32, k * self.fwd.n_vocab).reshape(k, -1) if logits else None
        return Drafted(ids, rows)

    def _set(self, p: StepParams, p0: int, toks: np.ndarray) -> None:
        p.set(p0, toks, self._gather(toks) if self._gather is not None else None)

    def _graph(self, key: tuple[object, ...], build: Callable[[Graph], None], split: bool = False) -> Graph:
        g = self._graphs.get(key)
        if g is None:
            g = Graph(self.fwd.gpu, "mtp." + ".".join(str(x) for x in key), split=split)
            build(g)
            self._graphs[key] = g
        return g


def _draft_weights(hp: HParams, own: GpuWeights, target: GpuWeights) -> tuple[GpuWeights, tuple[GGUFFile, str]]:
    """The head's weights: blk.L.* of `own` (the model's or the draft file's), and under the names
    the draft graphs use the embedding, LM head and output mixer, each the block's own (nextn.*),
    else the draft file's, else the target's (MODEL.md §4, §5.10, as model/mtp.py). Also the file
    and name of the embedding table (for a host gather when the embed kernel cannot decode it)."""
    p = f"blk.{hp.L}."
    w = GpuWeights(hp, own.file, {n: t for n, t in own.tensors.items() if n.startswith(p)})

    def first(*options: tuple[GpuWeights, str]) -> tuple[GpuTensor | None, tuple[GGUFFile, str]]:
        """The first option uploaded, else (None, the first option the file holds)."""
        for src, name in options:
            if name in src.tensors:
                return src.tensors[name], (src.file, name)
        return None, next(((s.file, n) for s, n in options if n in s.file.tensors), (target.file, options[-1][1]))

    embed, embed_src = first((own, p + "nextn.embed_tokens.weight"), (own, "token_embd.weight"),
                             (target, "token_embd.weight"))
    if embed is not None:
        w.tensors["token_embd.weight"] = embed
    tied = "output.weight" if "output.weight" in target.file.tensors else "token_embd.weight"
    out, _ = first((own, p + "nextn.shared_head_head.weight"), (own, "output.weight"), (target, tied))
    if out is None:
        raise ConfigError("the MTP head has no LM head on the GPU (nextn.shared_head_head, output, token_embd)")
    w.tensors["output.weight"] = out
    for part in ("norm", "down", "up"):
        t, _ = first((own, f"{p}nextn.hc_head_{part}.weight"), (own, f"output_hc_{part}.weight"),
                     (target, f"output_hc_{part}.weight"))
        if t is None:
            raise ConfigError(f"the MTP head has no output mixer (nextn.hc_head_{part}, output_hc_{part})")
        w.tensors[f"{p}nextn.hc_head_{part}.weight"] = t
    return w, embed_src
