"""The Vulkan forward: one sequence of a GGUF model on the GPU behind the engine's Forward protocol.

Step graphs are recorded once per (token count, head) and replayed with the step's positions and
token ids written into the step-params buffer. A prompt is fed in ubatches of UB tokens; a
ubatch that is not a whole recorded size is cut into power-of-two pieces (37 = 32 + 4 + 1), so no
token is ever padded and there is never a per-token loop. A prefill graph is cut into submissions
of at most VKFLASH_SUBMIT_BUDGET_MS estimated GPU time; decode is one replay of the 1-token graph,
never split: one submission, ending in the LM head and a device argmax (greedy reads 4 bytes).
The caches grow with the context and the deep-context guard keeps them inside the memory budget
(engine/guard.py): it runs before every step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from vkflash import settings
from vkflash.engine import graphs
from vkflash.engine.api import InvalidRequest
from vkflash.engine.caches import allocate_kv, cache_type
from vkflash.engine.dump import read_taps, tapped
from vkflash.engine.guard import Draft, Guard, GuardConfig
from vkflash.engine.graphs.common import Head, HeadBuffers, StepModel
from vkflash.engine.prefix import CheckpointBook, common_prefix
from vkflash.engine.state import recurrent_of
from vkflash.engine.step_params import ROW_STEP_MAX, StepParams
from vkflash.engine.weights_gpu import device_embeddable, host_row_gather, upload_weights
from vkflash.formats.gguf_file import GGUFFile
from vkflash.gpu.context import Gpu
from vkflash.gpu.graph import Graph
from vkflash.errors import ConfigError, ModelError
from vkflash.model.hparams import hparams_from_gguf
from vkflash.model.tensors import block_of

LOGITS_BUDGET = 64 << 20
"""Bytes of the all-rows logits buffer (verify / teacher forcing); bounds its rows at large V."""


@dataclass(frozen=True)
class GraphStats:
    """Size of one recorded step graph: dispatches, submissions and barriers per replay."""

    dispatches: int
    submissions: int
    barriers: int


def build_checked(g: Graph, build: Callable[[], None]) -> None:
    """Build a step graph; an op's refusal of a shape (ValueError: no kernel layout, no shared memory
    for it) is this model's shape being beyond the kernels here: one ModelError line, not a traceback."""
    try:
        build()
    except ValueError as e:
        raise ModelError(f"this model's shapes are beyond what vkflash's kernels run here "
                         f"(building {g.name}: {e})") from e


def pieces(n: int, cap: int) -> Iterator[int]:
    """Step sizes covering n tokens: whole `cap`s, then the rest as descending powers of two."""
    while n >= cap:
        yield cap
        n -= cap
    bit = 1 << max(0, n.bit_length() - 1)
    while n:
        if n & bit:
            yield bit
            n -= bit
        bit >>= 1


def steps(total: int, cap: int) -> Iterator[tuple[int, int]]:
    """(start, n) of the steps that feed `total` tokens in pieces(total, cap)."""
    start = 0
    for n in pieces(total, cap):
        yield start, n
        start += n


class StepHooks(Protocol):
    """Host work around every step of a forward: the MTP draft head's bookkeeping (engine/draft.py)."""

    def reset(self) -> None:
        """The sequence starts over."""

    def before(self, p0: int, ids: np.ndarray) -> None:
        """A step of ids at positions p0… is about to run (said again before the same step does
        nothing more): before the guard makes room for it, so work on the last step's rows runs
        with what was in force when that step ran (its ubatch's reserved graphs)."""

    def after(self, p0: int, ids: np.ndarray) -> None:
        """That step ran."""

    def truncated(self, n: int) -> None:
        """The sequence was cut to its first n tokens."""


class GpuForward:
    """One sequence on the GPU: Forward + ArgmaxForward (vkflash.engine.api)."""

    def __init__(self, model_path: str | os.PathLike[str], ctx: int | None = None, ub: int | None = None,
                 kv: str | None = None, gpu: Gpu | None = None, logits_rows: int | None = None,
                 progress: Callable[[int, int], None] | None = None, guard: GuardConfig | None = None,
                 mtp: bool = False, ckpt: int | None = None, ckpt_every: int | None = None) -> None:
        """ctx/ub/kv default to the CTX/UB/KV knobs (CTX 0: the model's context length);
        logits_rows bounds the rows of one all-logits step (default: LOGITS_BUDGET / V);
        progress(done, total) is called with weight bytes uploaded (a load progress bar);
        guard defaults to the DEEPGUARD, GUARD_* and VKFLASH_MEM_BUDGET knobs; `mtp` (qwen4exp):
        keep the file's MTP block and every step's h_nextn rows for the draft head
        (engine/draft.py), else an MTP block in the file is not uploaded; ckpt / ckpt_every: the
        recurrent-state checkpoints kept for prompt reuse and the tokens between them within a
        prefill (default: the CACHE_CKPT / CACHE_CKPT_EVERY knobs; engine/prefix.py)."""
        s = settings.current()
        self.gpu = gpu or Gpu()
        gf = GGUFFile(model_path)
        hp = hparams_from_gguf(gf)
        self.hp = hp
        self.arch = graphs.for_arch(hp.arch)
        self.n_ctx = int((s["CTX"] if ctx is None else ctx) or hp.n_ctx_train)
        self.n_vocab = hp.V
        self.ub = max(1, min(int(s["UB"] if ub is None else ub), self.n_ctx))
        kv_type = cache_type(s["KV"] if kv is None else kv)
        self.guard = Guard(guard or GuardConfig.from_settings(s), self.n_ctx, kv_type, self.ub, self.gpu.caps)
        self.draft: Draft | None = None  # the MTP draft, when one runs (the guard may shrink it)
        table = gf.tensors["token_embd.weight"].ggml_type
        host_embed = not device_embeddable(table)
        # a table the embed kernel cannot decode is gathered on the host; keep it on the GPU only as LM head
        skip = ["token_embd.weight"] if host_embed and "output.weight" in gf.tensors else []
        skip += self.arch.host_tables(hp)
        if mtp and hp.arch != "qwen4exp":
            raise ConfigError(f"MTP drafting needs a qwen4exp model, {Path(model_path).name} is {hp.arch}")
        if not mtp:
            skip += [n for n in gf.tensors if (b := block_of(n)) is not None and b >= hp.L]
        self._gather = host_row_gather(gf, "token_embd.weight") if host_embed else None
        stacks = self.arch.weight_stacks(gf, hp) if self.gpu.options.stack_weights else ()
        weights = upload_weights(self.gpu, gf, hp, skip, progress, self.arch.weight_transforms(gf, hp), stacks)
        rows = logits_rows or max(1, min(self.ub, LOGITS_BUDGET // (4 * hp.V)))
        held = self.guard.held
        kv_caches = allocate_kv(self.gpu, hp, self.n_ctx, kv_type, self.arch.attention_layers(hp), held)
        state = self.arch.allocate_state(self.gpu, gf, hp, self.n_ctx, kv_type, self.ub, held)
        params = StepParams.allocate(self.gpu, self.ub, hp.d if host_embed else 0, self.arch.extra_dim(gf, hp))
        hidden = self.gpu.buffer(4 * self.ub * hp.hc * hp.d, "h_nextn") if mtp else None
        self.model = StepModel(self.gpu, hp, weights, kv_caches, params, HeadBuffers.allocate(self.gpu, hp.V, rows),
                               state, hidden)
        self._graphs: dict[tuple[int, Head], Graph] = {}
        self._reserved = False
        self.hooks: StepHooks | None = None
        self.host_split: dict[str, float] | None = None
        """Set to {} to accumulate host seconds per part of each step (bench model): `prepare` (ids,
        step params, the arch's host rows), `submit` (the queue submission call), `finish` (after the
        GPU: state bookkeeping and the argmax read)."""
        rec = recurrent_of(state)
        slots = int(s["CACHE_CKPT"] if ckpt is None else ckpt) if rec is not None else 0
        if rec is not None:
            rec.allocate_checkpoints(slots)
        self.book = CheckpointBook(slots, int(s["CACHE_CKPT_EVERY"] if ckpt_every is None else ckpt_every))
        self._n = 0
        self._seq: list[int] = []  # the tokens fed (prompt reuse; a recurrent model replays a prefix it cannot restore)
        self.guard.start(self)

    # --- Forward protocol -----------------------------------------------------------------
    @property
    def n_past(self) -> int:
        """Tokens in the sequence so far."""
        return self._n

    @property
    def logits_step(self) -> int:
        """The most tokens one step with every row's logits holds (a verify step): a ubatch, and
        the head's rows."""
        return min(self.ub, self.model.head.rows)

    def reset(self) -> None:
        """Start a new, empty sequence (cache rows past n_kv are never read; recurrent states zeroed;
        the guard's steps undone)."""
        self._n = 0
        self._seq = []
        self.book.clear()
        self.guard.reset(self)
        if self.model.state is not None:
            self.model.state.reset()
        if self.hooks is not None:
            self.hooks.reset()

    def truncate(self, n: int) -> None:
        """Keep the first n tokens: attention-only models just shorten the length; recurrent states
        go back to the state plane a verify step left (engine/state.py), else to the nearest
        checkpoint (or the start) and the rest of the prefix is re-run."""
        n = max(0, min(n, self._n))
        st = self.model.state
        if st is not None and n < self._n and not st.truncate(self._n - n):
            keep = self._seq[:n]
            p = self._restore(self.book.best(n))
            if n > p:
                self._feed(np.asarray(keep[p:], np.int32))
            return
        self._cut(n)

    def reuse(self, ids: Sequence[int], strict: bool = False) -> int:
        """Keep the longest prefix of the sequence that `ids` starts with and that can be restored,
        never all of ids (the caller needs the last one's logits): its length, the tokens of ids
        not to feed again. Attention caches, indexer keys and summary rows are cut by position
        (cells past it are rewritten before they are read; a summary row is pooled when its block
        completes). Recurrent states are kept when the prefix is the whole sequence, rolled back
        when a verify step's planes reach, else restored from the nearest checkpoint at or below
        it (`strict`: below it, for the MTP head, whose cache cell at the restore point was
        written with the old sequence's next token); with none, the sequence starts over (reset,
        guard steps undone). The guard's steps taken within the prefix stay (K/V cells already
        re-quantized stay so); one taken deeper than the prefix starts the sequence over, so that
        a reply does not depend on how deep the requests before it went."""
        c = min(common_prefix(self._seq, [int(t) for t in ids]), len(ids) - 1)
        st = self.model.state
        if c <= 0 or self.guard.taken_beyond(c):
            self.reset()
            return 0
        if c == self._n:
            return c
        if st is None or st.truncate(self._n - c):
            self._cut(c)
            return c
        return self._restore(self.book.best(c - 1 if strict else c))

    def compile_checkpoints(self) -> None:
        """Compile the checkpoint copies now (at load: the first reused prompt should not wait)."""
        rec = recurrent_of(self.model.state)
        if rec is not None:
            rec.compile_checkpoints()

    @property
    def keeps_checkpoints(self) -> bool:
        return recurrent_of(self.model.state) is not None and self.book.slots > 0

    def checkpoint(self) -> None:
        """Keep the recurrent state after the tokens fed so far in a checkpoint (the end of a prompt:
        where the next turn of a conversation goes on); nothing without recurrent state."""
        rec = recurrent_of(self.model.state)
        slot = self.book.take(self._n) if rec is not None else None
        if slot is not None:
            assert rec is not None
            rec.save(slot)

    def _cut(self, n: int) -> None:
        """The sequence is its first n tokens (the states already are)."""
        self._n = n
        del self._seq[n:]
        self.book.drop_after(n)
        if self.hooks is not None:
            self.hooks.truncated(n)

    def _restore(self, at: tuple[int, int] | None) -> int:
        """The recurrent state from checkpoint (position, slot), the sequence cut there; None: a
        new sequence. The tokens kept."""
        if at is None:
            self.reset()
            return 0
        pos, slot = at
        rec = recurrent_of(self.model.state)
        assert rec is not None
        rec.load(slot, np.asarray(self._seq[:pos], np.int64))
        self._cut(pos)
        return pos

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Feed ids; the next-token logits (float32[V]) after the last one."""
        self._feed(self._ids(ids))
        return self.model.head.read_logits(1)[0]

    def decode(self, token: int) -> np.ndarray:
        """Feed one token; its next-token logits."""
        return self.prefill([token])

    def prefill_argmax(self, ids: Sequence[int]) -> int:
        """Feed ids; the greedy next token (device argmax, 4 bytes read back)."""
        t0 = time.perf_counter()
        arr = self._ids(ids)
        if self.host_split is not None:
            self.host_split["prepare"] = self.host_split.get("prepare", 0.0) + time.perf_counter() - t0
        self._feed(arr)
        t0 = time.perf_counter()
        tok = int(self.model.head.read_ids(1)[0])
        if self.host_split is not None:
            self.host_split["finish"] = self.host_split.get("finish", 0.0) + time.perf_counter() - t0
        return tok

    def decode_argmax(self, token: int) -> int:
        """Feed one token; the greedy next token."""
        return self.prefill_argmax([token])

    def prefill_logits(self, ids: Sequence[int]) -> np.ndarray:
        """Feed ids; the logits after every one of them, (len(ids), V) (teacher forcing, verify)."""
        arr = self._ids(ids)
        out = np.empty((len(arr), self.n_vocab), np.float32)
        for start, n in self._steps(arr, lambda: self.logits_step):
            self._run(arr[start:start + n], Head.ALL)
            out[start:start + n] = self.model.head.read_logits(n)
        return out

    def verify(self, ids: Sequence[int], logits: bool = False) -> np.ndarray:
        """Feed ids as one step with logits of every row (a speculation verify step, which a later
        truncate can roll back): every row's argmax (int64, n), or with `logits` the logits (n, V)."""
        arr = self._ids(ids)
        if len(arr) > self.logits_step:
            raise InvalidRequest(f"a verify step holds at most {self.logits_step} tokens")
        self._run(arr, Head.ALL)
        if logits:
            return self.model.head.read_logits(len(arr))
        return self.model.head.read_ids(len(arr))

    def dump_step(self, ids: Sequence[int], names: Iterable[str]) -> dict[str, np.ndarray]:
        """Feed ids as one step with logits for every row; the buffers written by the dispatches
        named in `names`, read right after them (flat float32, engine/dump.py). For verify."""
        arr = self._ids(ids)
        if len(arr) > self.logits_step:
            raise InvalidRequest(f"a dumped step holds at most {self.logits_step} tokens")
        g, taps = tapped(self.graph(len(arr), Head.ALL), names)
        self._run(arr, Head.ALL, g)
        return read_taps(taps)

    # --- steps ----------------------------------------------------------------------------
    def graph(self, n: int, head: Head) -> Graph:
        """The step graph of n tokens with `head`, built on first use (recorded on its first run);
        only graphs of several tokens are split by the submission budget (decode stays one)."""
        key = (n, head)
        g = self._graphs.get(key)
        if g is None:
            if not 1 <= n <= self.ub:
                raise ValueError(f"a step of {n} tokens; this forward's steps hold 1..{self.ub}")
            kind = "verify" if head is Head.ALL and 2 <= n <= ROW_STEP_MAX else head.value  # named in the job log
            g = Graph(self.gpu, f"{self.hp.arch}.{kind}.{n}", split=n > 1)
            build_checked(g, lambda: self.arch.build(g, self.model, n, head))
            self._graphs[key] = g
        return g

    def reserve(self) -> None:
        """Build and place every step graph a run can use (steps of UB and of each smaller power of
        two, with and without the head), so the arena holds from now on what any run needs: the
        compute buffers the memory plan counts; with an MTP draft, its graphs and the verify steps
        too (engine/draft.py). The guard's steps keep it so."""
        self._reserved = True
        sizes = sorted({self.ub} | {1 << k for k in range(self.ub.bit_length()) if 1 << k < self.ub}, reverse=True)
        for n in sizes:
            for head in (Head.NONE, Head.LAST):
                if (n, head) != (1, Head.NONE):  # a 1-token piece is always the last
                    self.graph(n, head).place()
        if self.draft is not None:
            self.draft.reserve()

    def graphs(self) -> list[Graph]:
        """The step graphs built so far."""
        return list(self._graphs.values())

    def drop_graphs(self) -> None:
        """Forget every step graph (the caches they bind changed): built again on use."""
        for g in self._graphs.values():
            g.release()
        self._graphs.clear()
        if self._reserved:
            self.reserve()

    def set_ubatch(self, ub: int) -> None:
        """Prefill in steps of at most ub tokens: the arena's memory returned, the graphs rebuilt."""
        self.ub = ub
        self.gpu.arena.clear()
        self.drop_graphs()

    @property
    def guard_tier(self) -> int:
        """Deep-context guard steps in force (/metrics)."""
        return self.guard.tier

    def graph_stats(self, n: int = 1, head: Head = Head.LAST) -> GraphStats:
        """Dispatches, submissions and barriers of one replay of a step graph (recording it)."""
        g = self.graph(n, head)
        if not g.submissions:
            g.record()
        return GraphStats(len(g.ops), len(g.submissions), g.barriers)

    def _ids(self, ids: Sequence[int]) -> np.ndarray:
        """ids as int32, checked: not empty, inside the vocabulary, fitting the context."""
        if isinstance(ids, list) and len(ids) == 1 and isinstance(ids[0], int):  # decode: no NumPy reductions
            if self._n + 1 > self.n_ctx:
                raise InvalidRequest(f"context full: {self._n} + 1 tokens exceed the context of {self.n_ctx}")
            if not 0 <= ids[0] < self.n_vocab:
                raise InvalidRequest(f"token id outside the vocabulary 0..{self.n_vocab - 1}")
            return np.array(ids, np.int32)
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(arr) == 0:
            raise InvalidRequest("no tokens to feed")
        if self._n + len(arr) > self.n_ctx:
            raise InvalidRequest(f"context full: {self._n} + {len(arr)} tokens exceed the context of {self.n_ctx}")
        if arr.min() < 0 or arr.max() >= self.n_vocab:
            raise InvalidRequest(f"token id outside the vocabulary 0..{self.n_vocab - 1}")
        return arr.astype(np.int32)

    def _steps(self, ids: np.ndarray, cap: Callable[[], int]) -> Iterator[tuple[int, int]]:
        """(start, n) of the steps feeding ids as in steps(); cap() is read before each one, after
        the guard has made room for it (a guard step may lower UB)."""
        start = 0
        while start < len(ids):
            self._before(ids[start:], min(cap(), len(ids) - start))
            n = next(pieces(len(ids) - start, cap()))
            yield start, n
            start += n

    def _before(self, ids: np.ndarray, n: int) -> None:
        """Before a step of n tokens (the first of `ids`): the hooks' work on the last step's rows,
        then the guard's room for n more positions."""
        if self.hooks is not None:
            self.hooks.before(self._n, ids)
        self.guard.before_step(self, self._n + n)

    def _feed(self, ids: np.ndarray) -> None:
        """Run ids in steps of at most UB tokens; only the last step computes logits."""
        for start, n in self._steps(ids, lambda: self.ub):
            self._run(ids[start:start + n], Head.LAST if start + n == len(ids) else Head.NONE)
            if self.book.due(self._n - n, self._n):
                self.checkpoint()

    def _run(self, ids: np.ndarray, head: Head, g: Graph | None = None) -> None:
        """One replay: params for len(ids) tokens at n_past, then the graph (or `g`, a tapped copy)."""
        t0 = time.perf_counter()
        n = len(ids)
        self._before(ids, n)
        emb = self._gather(ids) if self._gather is not None else None
        self.model.params.set(self._n, ids, emb)
        st = self.model.state
        if st is not None:
            st.before_step(self.model.params, ids)
        g = g or self.graph(n, head)
        t1 = time.perf_counter()
        g.submit()
        t2 = time.perf_counter()
        g.wait()
        t3 = time.perf_counter()
        if st is not None:
            st.stepped(ids)
        if self.hooks is not None:
            self.hooks.after(self._n, ids)
        self._n += n
        self._seq.extend(ids.tolist())
        if self.host_split is not None:
            h = self.host_split
            for part, dt in (("prepare", t1 - t0), ("submit", t2 - t1), ("finish", time.perf_counter() - t3)):
                h[part] = h.get(part, 0.0) + dt
