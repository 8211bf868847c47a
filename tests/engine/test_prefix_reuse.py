"""Prompt-prefix reuse through the engine API (GpuForward.reuse, engine/prefix.py) on tiny qwen2,
qwen3next and qwen4exp files: over a conversation whose turn k + 1 extends turn k, then edits an
earlier part, then is a prefix of the cached sequence, each turn keeps the expected number of
tokens (qwen2: the whole common prefix; hybrids: the nearest checkpoint at or below it) and its
logits are bit for bit those of a cold run fed in the same steps (and within MODEL.md's f32 bound
of a one-shot prefill, whose steps differ); the checkpoint book's eviction; the NumPy reference
keeps the same prefix; MTP speculation over a reused prefix is plain decoding; the deep-context
guard's steps stay in force over a reuse."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from fakes import ByteCodec
from hybrid_ref import knobs, rel
from qwen2_tiny import Geometry, write_qwen2
from vkflash.engine.api import Finish, SamplingParams, TokenEvent
from vkflash.engine.generate import generate
from vkflash.engine.gpu_forward import GpuForward, steps
from vkflash.engine.guard import GuardConfig, Kind
from vkflash.engine.prefix import CheckpointBook, common_prefix
from vkflash.engine.reference_backend import ReferenceForward
from vkflash.engine.speculate import Speculator
from vkflash.engine.state import recurrent_of
from vkflash.gpu.budget import Budget
from vkflash.gpu.ops.attention import CacheType
from vkflash.model.make_model import make_model
from vkflash.model.weights import load_model

UB, EVERY, SLOTS = 8, 8, 32  # enough slots that the conversation below never evicts one
EXACT = 1e-3  # MODEL.md §7.10: max|Δ| ≤ 1e-3·std(logits) in f32


def _model(arch: str, tmp: Path, rng: np.random.Generator) -> Path:
    seed = int(rng.integers(1 << 31))
    if arch == "qwen2":
        path = tmp / f"q2-{seed}.gguf"
        write_qwen2(path, rng, Geometry(d=96, H=3, H_kv=1, Dh=32, F=160, V=301, L=2))
        return path
    return make_model(arch, "tiny", "F32", seed, tmp / f"{arch}-{seed}.gguf")[0]


@dataclass
class Conversation:
    """A forward and how its sequence was fed (each call's first position and tokens), so a cold
    run can be fed in the same steps and the expected checkpoints known."""

    fwd: GpuForward
    other: GpuForward  # the cold runs'
    calls: list[tuple[int, list[int]]] = field(default_factory=list)
    marks: set[int] = field(default_factory=set)  # positions a checkpoint holds

    def feed(self, ids: list[int], prompt_end: bool = False) -> np.ndarray:
        """Feed ids as one call; a checkpoint after every step that crosses a multiple of EVERY and
        at a prompt's end (recurrent models)."""
        p0 = self.fwd.n_past
        out = self.fwd.prefill(ids)
        self.calls.append((p0, list(ids)))
        for s, n in steps(len(ids), UB):
            if (p0 + s + n) // EVERY > (p0 + s) // EVERY:
                self.marks.add(p0 + s + n)
        if prompt_end:
            self.fwd.checkpoint()
            self.marks.add(self.fwd.n_past)
        return out

    def turn(self, prompt: list[int], recurrent: bool) -> tuple[int, np.ndarray]:
        """One request: reuse, then the rest of the prompt; (tokens kept, logits)."""
        c = min(common_prefix(self.fwd._seq, prompt), len(prompt) - 1)
        want = c if not recurrent or rolls_back(self.fwd, c) else max((m for m in self.marks if m <= c), default=0)
        n = self.fwd.reuse(prompt)
        assert n == want
        self.calls = [(p0, ids[:n - p0]) for p0, ids in self.calls if p0 < n]
        self.marks = {m for m in self.marks if m <= n} if n else set()
        return n, self.feed(prompt[n:], prompt_end=True)

    def cold(self, n: int) -> np.ndarray:
        """A new sequence on the other forward fed in this one's steps: the kept calls, then the
        rest of the prompt (the last call)."""
        self.other.reset()
        out = None
        for _, ids in self.calls:
            if ids:
                out = self.other.prefill(ids)
        assert out is not None
        return out


def rolls_back(fwd: GpuForward, c: int) -> bool:
    """Whether a cut to c keeps the live recurrent state: c is the whole sequence, or the last step
    was verify-sized (a prefill's tail piece of 2..7 tokens) and its state planes reach c (a row of
    such a step is bit for bit a decode step: docs/DESIGN.md §5)."""
    rec = recurrent_of(fwd.model.state)
    return c == fwd.n_past or (rec is not None and fwd.n_past - c < rec.valid_slots)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen2", "qwen3next", "qwen4exp"])
def test_multi_turn_reuse_is_a_cold_run(gpu, rng, tmp_path, arch):
    """Turn 2 extends turn 1 (prompt + some of its decoded output + a new message), turn 3 edits
    an earlier token, turn 4 is a prefix of the cached sequence: each keeps the expected prefix and
    its logits equal a cold run fed in the same steps bit for bit — except on qwen2 where the cut
    lands inside an earlier multi-token step: its kept cells were attended in a step of other
    length than the cold run's (the key chunks of a multi-row attention depend on the step's last
    row), so rounding differs, within MODEL.md's f32 bound. Every turn is within that bound of a
    one-shot prefill of its whole prompt."""
    path = _model(arch, tmp_path, rng)
    fwd, other = (GpuForward(path, ctx=160, ub=UB, kv="f32", gpu=gpu, ckpt=SLOTS, ckpt_every=EVERY) for _ in "ab")
    recurrent = arch != "qwen2"
    V = fwd.n_vocab
    conv = Conversation(fwd, other)

    def new(lo: int, hi: int) -> list[int]:
        return [int(t) for t in rng.integers(0, V, int(rng.integers(lo, hi)))]

    A = new(20, 40)
    n, _ = conv.turn(A, recurrent)
    assert n == 0
    out = new(3, 6)
    for t in out:  # decoded output: one-token steps
        conv.feed([t])
    B = A + out[:int(rng.integers(1, len(out)))] + new(8, 20)
    C = B[:int(rng.integers(1, len(A)))] + new(6, 16)  # an earlier message edited
    turns = [B, C, None]
    for prompt in turns:
        if prompt is None:  # a prefix of the cached sequence
            prompt = fwd._seq[:int(rng.integers(2, fwd.n_past))]
        ends = {p0 + len(ids) for p0, ids in conv.calls}
        n, got = conv.turn(prompt, recurrent)
        want = conv.cold(n)
        if recurrent or n in ends:
            assert np.array_equal(got, want), f"reuse of {n} tokens: {rel(got, want):.2e}·std off a cold run"
        else:
            assert rel(got, want) <= EXACT
        other.reset()
        assert rel(got, other.prefill(prompt)) <= EXACT


def test_checkpoint_book_thins_evenly(rng):
    """A full book gives up its densest checkpoint, never the newest; best() is the nearest at or
    below a limit; due() fires on crossing a multiple of `every`; drop_after forgets later ones."""
    slots = int(rng.integers(2, 6))
    book = CheckpointBook(slots, int(rng.integers(8, 64)))
    pos = 0
    for _ in range(40):
        pos += int(rng.integers(1, 100))
        before = dict(book.held)
        slot = book.take(pos)
        assert slot is not None and book.held[pos] == slot and len(book.held) <= slots
        if len(before) == slots:
            ps = sorted(before)
            gaps = [(ps[i] - (ps[i - 1] if i else 0), ps[i]) for i in range(len(ps) - 1)]
            assert set(before) - set(book.held) == {min(gaps)[1]}
    assert book.take(pos) is None and max(book.held) == pos
    limit = int(rng.integers(0, pos + 1))
    below = [p for p in book.held if p <= limit]
    assert book.best(limit) == ((max(below), book.held[max(below)]) if below else None)
    book.drop_after(limit)
    assert all(p <= limit for p in book.held)
    k = book.every * int(rng.integers(1, 5))
    assert book.due(k - 1, k) and not book.due(k, k + book.every - 1)


def test_reference_keeps_the_same_prefix(rng, tmp_path):
    """The NumPy reference forward reuses as the GPU one does (checkpoint at a prompt's end and each
    multiple of the interval), and its logits after a reuse match a cold run fed in the same steps."""
    path = _model("qwen3next", tmp_path, rng)
    ref = ReferenceForward(load_model(path), 128, ckpt=SLOTS, ckpt_every=EVERY)
    V = ref.n_vocab
    A = [int(t) for t in rng.integers(0, V, int(rng.integers(20, 40)))]
    assert ref.reuse(A) == 0
    ref.prefill(A)
    ref.checkpoint()
    k = int(rng.integers(1, len(A) + 1))
    B = A[:k] + [int(t) for t in rng.integers(0, V, 8)]
    c = min(common_prefix(A, B), len(B) - 1)  # k, or more where a new token repeats A's
    n = ref.reuse(B)
    assert n == (c if c == len(A) else EVERY * (c // EVERY))
    got = ref.prefill(B[n:])
    ref.reset()  # a cold run in the same steps: when all of A is kept, A's last step ended off the interval
    if n:
        ref.prefill(B[:n])
    assert rel(got, ref.prefill(B[n:])) <= 1e-9


@pytest.mark.gpu
def test_mtp_speculation_after_reuse_is_plain_decoding(gpu, rng, tmp_path):
    """Turn 2 of a conversation under MTP speculation restarts from turn 1's prompt end (strictly
    below the common prefix: the head's cache cell there is right), and its greedy output is token
    for token plain decoding's after the same reuse (the generation loop, cache_n counted)."""
    seed = int(rng.integers(1 << 31))
    path = make_model("qwen4exp", "tiny", "F32", seed, tmp_path / f"m{seed}.gguf", mtp_block=True)[0]
    with knobs(SPEC_ADAPT="0", DRAFT="3"):  # draft every round, even on random weights
        sp = Speculator.open(path, None, None, ctx=128, ub=8, kv="f16", gpu=gpu)
    plain = GpuForward(path, ctx=128, ub=8, kv="f16", gpu=gpu, ckpt=4, ckpt_every=0)
    V = plain.n_vocab
    params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(8, 14)), ignore_eos=True)

    def run(fwd, prompt: list[int]) -> tuple[list[int], Finish]:
        evs = list(generate(fwd, ByteCodec(eog=-1), prompt, params, ubatch=16))
        fin = evs[-1]
        assert isinstance(fin, Finish) and fin.reason == "length"
        return [e.token for e in evs if isinstance(e, TokenEvent)], fin

    A = [int(t) for t in rng.integers(0, V, int(rng.integers(18, 30)))]
    out, _ = run(plain, A)
    assert run(sp, A)[0] == out
    B = A + out[:int(rng.integers(1, len(out) - 2))] + [int(t) for t in rng.integers(0, V, int(rng.integers(4, 12)))]
    want, fin = run(plain, B)
    got, fin_sp = run(sp, B)
    assert fin.timings.cache_n == fin_sp.timings.cache_n == len(A)
    assert got == want and sp.drafted > 0


@pytest.mark.gpu
def test_reuse_keeps_the_guards_steps(gpu, rng, tmp_path):
    """With the deep-context guard's steps forced early (K/V re-quantized to q8_0 at 40, UB halved
    at 64), turn 2 restarts from a checkpoint past them: bit for bit a cold run fed in the same
    steps, whose guard steps at the same depths (they stay in force); turn 3 shares a prefix short
    of them, which alone would not have taken them: it starts over with the boot f16 cache and UB,
    bit for bit a fresh forward's prefill, whatever the turns before it did."""
    path = _model("qwen3next", tmp_path, rng)
    when = {Kind.DRAFT: "auto", Kind.KV: 40, Kind.UB: 64}
    fwd, other = (GpuForward(path, ctx=256, ub=16, kv="f16", gpu=gpu.with_options(gpu.options, own_arena=True),
                             ckpt=SLOTS, ckpt_every=16, guard=GuardConfig(when=when, budget=Budget(0, "none")))
                  for _ in "ab")
    V = fwd.n_vocab
    A = [int(t) for t in rng.integers(0, V, int(rng.integers(100, 120)))]
    fwd.reuse(A)
    fwd.prefill(A)
    fwd.checkpoint()
    events = [(e.depth, e.kind) for e in fwd.guard.events]
    assert [k for _, k in events] == [Kind.KV, Kind.UB] and fwd.ub == 8
    k = int(rng.integers(80, len(A)))
    B = A[:k] + [int(t) for t in rng.integers(0, V, 12)]
    c = min(common_prefix(A, B), len(B) - 1)
    want = c if rolls_back(fwd, c) else 16 * (c // 16)
    n = fwd.reuse(B)
    assert n == want and fwd.model.kv.type is CacheType.Q8_0
    got = fwd.prefill(B[n:])
    other.reset()
    other.prefill(A[:n])
    assert [(e.depth, e.kind) for e in other.guard.events] == events
    assert np.array_equal(got, other.prefill(B[n:]))
    j = int(rng.integers(16, 32))
    C = A[:j] + [(A[j] + 1) % V] + [int(t) for t in rng.integers(0, V, 12)]  # diverges at j
    assert fwd.reuse(C) == 0 and fwd.guard_tier == 0 and fwd.model.kv.type is CacheType.F16 and fwd.ub == 16
    got = fwd.prefill(C)
    other.reset()
    assert np.array_equal(got, other.prefill(C))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["gpu", "reference"])
def test_generate_keeps_the_state_at_checkpoint_at(gpu, rng, tmp_path, backend):
    """generate(checkpoint_at=k) stops its prefill at k for the checkpoint (none at the prompt's end),
    its tokens are those of a run that prefills in one go, and a next prompt that leaves the first
    one right after k restarts there (cache_n = k)."""
    path = _model("qwen4exp", tmp_path, rng)

    def forward():
        if backend == "gpu":
            return GpuForward(path, ctx=128, ub=UB, kv="f16", gpu=gpu, ckpt=4, ckpt_every=0)
        return ReferenceForward(load_model(path), 128, ckpt=4, ckpt_every=0)

    fwd, cold = forward(), forward()
    V = fwd.n_vocab
    params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(3, 7)), ignore_eos=True)

    def run(f, prompt: list[int], keep: int | None) -> tuple[list[int], Finish]:
        evs = list(generate(f, ByteCodec(eog=-1), prompt, params, ubatch=UB, checkpoint_at=keep))
        assert isinstance(evs[-1], Finish)
        return [e.token for e in evs if isinstance(e, TokenEvent)], evs[-1]

    A = [int(t) for t in rng.integers(0, V, int(rng.integers(2 * UB + 1, 4 * UB)))]
    k = len(A) - int(rng.integers(1, 6))  # a generation prompt's worth of tokens before the end
    out, _ = run(fwd, A, k)
    assert set(fwd.book.held) == {k}
    assert out == run(cold, A, None)[0]
    B = A[:k] + [(A[k] + 1) % V] + [int(t) for t in rng.integers(0, V, int(rng.integers(1, 9)))]
    _, fin = run(fwd, B, None)
    assert fin.timings.cache_n == k
