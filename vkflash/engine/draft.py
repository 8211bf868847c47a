"""The MTP draft head on the GPU (MODEL.md §5.10): its weights (the model's own blk.L, or an MTP-only
GGUF named by MODEL_DRAFT, in whatever types the kernels decode), its own one-layer K/V cache, step
params and head buffers, and the drafting protocol's bookkeeping (D1, D4).

The target's step graph leaves the h_nextn rows of its last step in a buffer (GpuForward(mtp=True)).
Rows of that step whose next token is known are *pending*: their MTP rows (x_p, H_target[p−1]) are
still to be written into the head's cache. A round of drafting runs them as catch-up rows, then the
draft row and the chained rows (graphs/mtp.py); a round without drafting runs them as catch-up
only. The draft graphs are sized by the rows they carry (never the target's ubatch graphs) and
share the Gpu's arena with the target's, as all graphs of a Gpu do; GpuForward.reserve() places
every one a run can use, so the memory plan (engine/plan.py, which builds this head on a planning
Gpu) counts what a run holds.

The deep-context guard's first step switches the head to MODEL_DRAFT_SMALL, an MTP-only GGUF of
the same block in a smaller quant: the weights the head holds alone are freed (the model's own
blk.L tensors are the head's, not the target's), then the small file's are uploaded and the graphs
built again. The head's K/V cache stays: rows written with the other quant's weights only change
which drafts the target accepts, and the target decides every token. A new sequence switches back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from vkflash.engine.caches import allocate_kv
from vkflash.engine.gpu_forward import GpuForward, build_checked
from vkflash.engine.guard import Fill
from vkflash.engine.graphs import mtp
from vkflash.engine.graphs.common import Head, HeadBuffers, StepModel
from vkflash.engine.step_params import ROW_STEP_MAX, StepParams
from vkflash.engine.weights_gpu import GpuTensor, GpuWeights, device_embeddable, host_row_gather, upload_weights
from vkflash.errors import ConfigError, FormatError, ModelError
from vkflash.formats.gguf_file import GGUFFile
from vkflash.gpu.graph import Graph
from vkflash.gpu.memory import Buffer, fmt_bytes
from vkflash.gpu.ops.attention import Cache
from vkflash.model.hparams import HParams, hparams_from_gguf
from vkflash.model.tensors import validate_tensors
from vkflash.settings import current

SHARED_KEYS = ("d", "V", "H", "H_kv", "Dh", "n_rot", "theta", "eps", "E", "k", "F", "F_s", "hc", "lr", "L")
"""Hyper-parameters a separate draft file must share with its target."""


def _check_draft(target: HParams, draft: HParams, name: str, knob: str = "MODEL_DRAFT") -> None:
    """A separate MTP file fits the target: qwen4exp, the same geometry, its block at index L."""
    if draft.arch != "qwen4exp" or draft.n_mtp < 1:
        raise ConfigError(f"{knob} {name}: not a qwen4exp MTP file (arch {draft.arch}, "
                          f"nextn_predict_layers {draft.n_mtp})")
    bad = [k for k in SHARED_KEYS if getattr(draft, k) != getattr(target, k)]
    if bad:
        k = bad[0]
        raise ConfigError(f"{knob} {name} does not fit the model: {k} = {getattr(draft, k)}, the model has "
                          f"{getattr(target, k)}")


def _open_draft(path: Path, knob: str, hp: HParams) -> GGUFFile:
    """The MTP-only GGUF at `path`, checked against the target's hp: one ConfigError naming `knob`
    when it is not a GGUF, not an MTP file of this geometry, or lacks a tensor."""
    try:
        gf = GGUFFile(path)
        dhp = hparams_from_gguf(gf)
        _check_draft(hp, dhp, path.name, knob)
        layout = validate_tensors(dhp, {n: t.ne for n, t in gf.tensors.items()})
    except FormatError as e:  # its message starts with the path
        raise ConfigError(f"{knob}: {e}") from None
    except ModelError as e:
        raise ConfigError(f"{knob} {path.name}: {e}") from None
    if not layout.has_mtp:
        raise ConfigError(f"{knob} {path.name} holds no MTP block (blk.{hp.L}.*)")
    return gf


def _stored_bytes(gf: GGUFFile, prefix: str = "") -> int:
    """Bytes of the file's tensors whose names start with `prefix`, as stored."""
    return sum(t.nbytes for n, t in gf.tensors.items() if n.startswith(prefix))


@dataclass(frozen=True)
class Drafted:
    """One round's draft: the drafted token ids, and their logits rows when asked for."""

    ids: list[int]
    logits: np.ndarray | None


class MtpDrafter:
    """The draft head of one GpuForward sequence (built with mtp=True): catch-up and drafting; it is
    the forward's step hooks, so every target step keeps its rows (GpuForward.StepHooks), and its
    `draft`, which the deep-context guard may switch to a smaller quant (engine/guard.py Draft)."""

    def __init__(self, fwd: GpuForward, draft_path: str | os.PathLike[str] | None, k_max: int,
                 small_path: str | os.PathLike[str] | None = None) -> None:
        """The head from `draft_path` (an MTP-only GGUF) or else the model file's own block, whose
        tensors it then holds instead of the target; rounds of at most k_max drafted tokens.
        `small_path` (MODEL_DRAFT_SMALL): an MTP-only GGUF of the same block in a smaller quant, for
        the guard's draft step; checked now, uploaded only when the guard switches to it."""
        if fwd.model.hidden is None:
            raise ConfigError("the MTP draft head needs a forward built with mtp=True")
        self.fwd, self.k_max, self._hidden = fwd, k_max, fwd.model.hidden
        gpu, hp = fwd.gpu, fwd.hp
        target = fwd.model.weights
        self._prefix = f"blk.{hp.L}."
        self._path = Path(draft_path) if draft_path is not None else None
        self.small = Path(small_path) if small_path is not None else None  # MODEL_DRAFT_SMALL
        self._files: dict[Path | None, GGUFFile] = {None: target.file}
        if self._path is None:
            if f"{self._prefix}nextn.eh_proj.weight" not in target.tensors:
                raise ConfigError(f"{target.file.path.name} has no MTP block (blk.{hp.L}.nextn.*): "
                                  "set MODEL_DRAFT to an MTP-only GGUF or turn MTP off")
            own = GpuWeights(hp, target.file, {n: target.tensors.pop(n) for n in list(target.tensors)
                                                if n.startswith(self._prefix)})
        else:
            self._files[self._path] = _open_draft(self._path, "MODEL_DRAFT", hp)
            own = self._upload(self._path)
        if self.small is not None:
            small = self._files[self.small] = _open_draft(self.small, "MODEL_DRAFT_SMALL", hp)
            big = _stored_bytes(self._files[self._path], "" if self._path else self._prefix)
            if _stored_bytes(small) >= big:
                raise ConfigError(f"MODEL_DRAFT_SMALL {self.small.name} ({fmt_bytes(_stored_bytes(small))}) is "
                                  f"not smaller than the draft it replaces ({fmt_bytes(big)})")
        self.shrunk = False  # MODEL_DRAFT_SMALL in use
        self._ub = fwd.ub  # the most hidden rows a step leaves (UB at boot: the guard may lower it)
        self._reserved = False
        self._graphs: dict[tuple[object, ...], Graph] = {}
        self._inflight: Graph | None = None  # a catch-up submitted and not yet waited for
        self._async = bool(current()["VKFLASH_MTP_CATCHUP_ASYNC"])
        self._params: StepParams | None = None
        self._rows: list[StepParams] = []
        self._kv = allocate_kv(gpu, hp, fwd.n_ctx, fwd.model.kv.type, [hp.L], self._cells(fwd.guard.held))
        self._head = HeadBuffers.allocate(gpu, hp.V, k_max)
        self._chain = gpu.buffer(4 * hp.hc * hp.d, "mtp.chain")
        self._load(own, self._path)
        self.reset()
        fwd.hooks = self
        fwd.draft = self

    def _upload(self, path: Path | None) -> GpuWeights:
        """Upload the draft's own tensors: every tensor of the MTP-only file at `path`, or (None)
        the model file's blk.L, stacked and re-laid as the forward uploads them."""
        fwd = self.fwd
        gf = self._files[path]
        hp = fwd.hp if path is None else hparams_from_gguf(gf)
        skip = [n for n in gf.tensors if not n.startswith(self._prefix)] if path is None else []
        stacks = fwd.arch.weight_stacks(gf, hp) if fwd.gpu.options.stack_weights else ()
        return upload_weights(fwd.gpu, gf, hp, skip, None, fwd.arch.weight_transforms(gf, hp), stacks)

    def _load(self, own: GpuWeights, path: Path | None) -> None:
        """Make the head of `own` (what the draft holds itself: the block, with a draft file's
        other tensors): its weights under the graphs' names, the embedding source and the step
        params it needs (allocated again only when that changes). Graphs are built on use."""
        fwd, gpu, hp = self.fwd, self.fwd.gpu, self.fwd.hp
        target = fwd.model.weights
        self.source = path.name if path is not None else f"{target.file.path.name}'s own blk.{hp.L}"
        kept = {t.buf.id for t in target.tensors.values()}  # borrowed from the target: never freed here
        self._own = [b for b in {t.buf.id: t.buf for t in own.tensors.values()}.values() if b.id not in kept]
        weights, (embed_file, embed_name) = _draft_weights(hp, own, target)
        table = weights.get("token_embd.weight")
        gather: Callable[[np.ndarray], np.ndarray] | None = None
        if table is None or not device_embeddable(table.qtype):
            gather = host_row_gather(embed_file, embed_name)
        self.device_chain = gather is None  # drafted tokens feed the next row without the host
        self._gather = gather
        emb = hp.d if gather is not None else 0
        if self._params is None or self._params.emb_dim != emb:
            for p in ([self._params] if self._params is not None else []) + self._rows:
                gpu.free(p.buf)
            self._params = StepParams.allocate(gpu, self._ub, emb, 0, mtp.CELL_SHIFT)
            self._rows = [StepParams.allocate(gpu, 1, emb, 0, mtp.CELL_SHIFT) for _ in range(self.k_max)]
        model = StepModel(gpu, hp, weights, self._kv, self._params, self._head)
        self.d = mtp.DraftModel(model, self._hidden, self._chain, self._rows)

    # --- what the deep-context guard and the memory plan see (engine/guard.py Draft) -------
    @property
    def can_shrink(self) -> bool:
        """MODEL_DRAFT_SMALL is given and not in use yet."""
        return self.small is not None and not self.shrunk

    def weights(self) -> list[Buffer]:
        """The buffers of the weights it holds alone (what a switch frees; the embedding, LM head or
        output mixer it borrows from the target are the target's)."""
        return self._own

    def io(self) -> list[Buffer]:
        """Its step params (catch-up rows and each draft row), head buffers and chained row."""
        return [self.d.model.params.buf, *(p.buf for p in self.d.rows), self._head.logits, self._head.ids, self._chain]

    def fills(self) -> list[Fill]:
        """The head's K/V cache, which grows with the context as the trunk's does (_cells)."""
        kv = self._kv.layers[self.fwd.hp.L]
        return [Fill(c.buf, lambda t, c=c: Cache.nbytes(self._cells(t), c.n_heads, c.dim, c.type))
                for c in (kv.k, kv.v)]

    def _cells(self, t: int) -> int:
        """Cells the head's cache holds while the target's hold t positions: a round drafting k
        tokens after n ≤ t writes cells up to n + k − 2 (its rows' positions n … n + k − 1, less
        CELL_SHIFT), past the target's until its verify step makes room; so k_max − 1 more."""
        return min(self.fwd.n_ctx, t + self.k_max - 1)

    def graphs(self) -> list[Graph]:
        """Its graphs built so far (they share the Gpu's arena; what they own is theirs)."""
        return list(self._graphs.values())

    def reserve(self) -> None:
        """Build and place every graph a run can use at the forward's ubatch, the target's verify
        steps included, so that the arena holds what speculation needs from now on (the memory
        plan's compute): catch-up and round graphs for each count of pending rows a step can leave
        (a prefill piece: UB or a smaller power of two; a verify step of up to k_max + 1, and fewer
        after a rollback), rounds of every draft length, the host-chained rows. GpuForward.reserve
        calls it; after a switch the new graphs are placed again."""
        self._reserved = True
        fwd = self.fwd
        step = fwd.logits_step  # the most tokens one verify step holds
        counts = {fwd.ub} | {1 << i for i in range(fwd.ub.bit_length()) if 1 << i < fwd.ub}
        for c in sorted(counts | set(range(1, min(self.k_max + 1, fwd.ub) + 1))):
            self._catch_graph(c).place()
            for k in range(1, self.k_max + 1 if self.device_chain else 2):
                self._round_graph(c, k, self.device_chain).place()
        for j in range(1, self.k_max):
            self._chain_graph(j).place()
        for n in range(2, min(self.k_max + 1, step) + 1):
            fwd.graph(n, Head.ALL).place()

    def shrink(self) -> None:
        """The guard's draft step: free the weights it holds alone, then upload MODEL_DRAFT_SMALL's
        block and make the head of it (graphs built again; the K/V cache and pending rows stay)."""
        if not self.can_shrink:
            raise ValueError("the MTP draft has no smaller quant to switch to")
        self._switch(self.small)
        self.shrunk = True

    def restore(self) -> None:
        """Back to the draft it started with, after a shrink (a new sequence: engine/guard.py reset)."""
        if self.shrunk:
            self._switch(self._path)
            self.shrunk = False

    def _switch(self, path: Path | None) -> None:
        """Free, then load: its graphs and the weights it holds alone go first, then `path`'s block
        (None: the model file's own) is uploaded and the head made of it."""
        self.settle()
        self._drop_graphs()
        for b in self._own:
            self.fwd.gpu.free(b)
        self._own = []
        self._load(self._upload(path), path)
        if self._reserved:
            self.reserve()

    def _drop_graphs(self) -> None:
        """Forget its graphs (they bind the weights being replaced), freeing the buffers they own."""
        for g in self._graphs.values():
            g.release()
        self._graphs.clear()

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
        """(D1) write every pending row into the head's cache; `next_token` is the last one's token.
        Not waited for: the target step submitted next on the same queue starts with a barrier, so
        it runs after the catch-up and one wait serves both (`settle` collects it)."""
        if self._c == 0:
            return
        self.settle()
        toks = np.asarray(self._tokens + [next_token], np.int32)
        self._set(self.d.model.params, self._p0, toks)
        g = self._catch_graph(self._c)
        if self._async:
            g.submit()
            self._inflight = g
        else:
            g.run()
        self._c = 0

    def settle(self) -> None:
        """Wait for a catch-up still in flight (before the params it reads are rewritten)."""
        g, self._inflight = self._inflight, None
        if g is not None:
            g.wait()

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
        self._chain_graph(j).run()
        return self.d.model.head.read_logits(1, j)[0]

    def warm(self) -> None:
        """Record every graph a decoding round can use (up to k_max + 1 pending rows, fewer when a
        ubatch holds fewer; up to k_max drafted tokens), so that timing sees replays only."""
        for c in range(1, min(self.k_max + 1, self.fwd.ub) + 1):
            self._catch_graph(c).record()
            for k in range(1, self.k_max + 1 if self.device_chain else 2):
                self._round_graph(c, k, self.device_chain).record()
        for j in range(1, self.k_max):
            self._chain_graph(j).record()

    def _catch_graph(self, c: int) -> Graph:
        return self._graph(("catch", c), lambda g: mtp.catch_up(g, self.d, c))

    def _chain_graph(self, j: int) -> Graph:
        return self._graph(("chain", j), lambda g: mtp.chained_row(g, self.d, j))

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
        self.settle()
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
        ids = [int(t) for t in head.read_ids(k)]
        rows = head.read_logits(k) if logits else None
        return Drafted(ids, rows)

    def _set(self, p: StepParams, p0: int, toks: np.ndarray) -> None:
        p.set(p0, toks, self._gather(toks) if self._gather is not None else None)

    def _graph(self, key: tuple[object, ...], build: Callable[[Graph], None], split: bool = False) -> Graph:
        g = self._graphs.get(key)
        if g is None:
            g = Graph(self.fwd.gpu, "mtp." + ".".join(str(x) for x in key), split=split)
            build_checked(g, lambda: build(g))
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
