"""MTP self-speculative decoding (MODEL.md §5.10 D1–D4) over the GPU forward.

A round, with x the token to feed next and n tokens in the sequence:
  1. length: k drafted tokens (`DraftPolicy`: DRAFT, 0 meaning 6 at temperature 0 and 4 otherwise;
     the context and the tokens still wanted; the livelock guard; with SPEC_ADAPT=1 the k that
     maximizes expected tokens per unit of measured round cost; not for a seeded sampled request,
     whose draws must not depend on timings: the same seed gives the same tokens). k = 0 is a plain
     decode step;
  2. draft: the pending catch-up rows, the draft row and k − 1 chained rows (engine/draft.py) —
     one submission, drafted tokens fed on the device, when the drafts are argmax picks; chained
     on the host's draws for rejection sampling. DRAFT_PMIN cuts the draft at its first row whose
     top token's confidence (softmax over the top K_d = 10 draft logits, read at the top one) is
     lower: decided before the row's draw, so rejection sampling's drafts stay distributed as q;
  3. verify: the target runs [x, d_1..d_k] as one step, with the argmax or logits of every row;
  4. accept: at temperature 0, or sampling with SPEC_STOCH=0, the longest prefix where the
     target's own pick equals the draft, then the target's pick at the first mismatch. With
     SPEC_STOCH=1, d_i is accepted with probability min(1, p_i(d_i)/q_i(d_i)) (q_i the draft's
     distribution it was drawn from, p_i the target's, both through the request's sampler), a
     rejection draws from norm(max(0, p_i − q_i)), and after k acceptances one token is drawn
     from p_{k+1}: every token is distributed as plain sampling's (lossless);
  5. rollback (D3, D4): the target's recurrent states go back to the last kept token's plane
     (engine/state.py), attention, indexer and MTP cells past it are never read again before
     they are rewritten.
Greedy output is token for token that of plain decoding: verify rows compute exactly what decode
steps do (engine/step_params.py ROW_STEP_MAX).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from vkflash.engine.api import PrefixForward
from vkflash.engine.draft import MtpDrafter
from vkflash.engine.gpu_forward import GpuForward
from vkflash.engine.graphs.common import Head
from vkflash.engine.sampling import Sampler
from vkflash.engine.state import n_draft
from vkflash.gpu.graph import Graph
from vkflash.model.mtp import confidence
from vkflash.settings import current

DRAFT_TOP_K = 10
"""K_d of D1: the draft's confidence is the softmax over its top K_d logits, read at the token."""
GUARD = 3
"""Livelock guard: after this many rounds in a row that kept only their own first token, one plain step."""
PROBE = (8, 128)
"""SPEC_ADAPT=1: when drafting does not pay, a round still drafts one token (a probe) after this
many plain rounds: the first, doubled after every probe that is rejected, up to the second."""
EMA = 0.3
"""Weight of the newest round in the acceptance and cost estimates."""

Propose = Callable[[int, list[int]], list[int]]
"""(position of the first drafted token, drafted tokens) → the tokens to verify instead (bench)."""


@dataclass(frozen=True)
class SpecConfig:
    """The speculation knobs, read once when the speculator is made."""

    draft: int  # DRAFT (0: 6 at temperature 0, 4 otherwise)
    p_min: float  # DRAFT_PMIN
    stochastic: bool  # SPEC_STOCH
    adapt: bool  # SPEC_ADAPT

    @classmethod
    def from_settings(cls) -> "SpecConfig":
        s = current()
        return cls(int(s["DRAFT"]), float(s["DRAFT_PMIN"]), bool(s["SPEC_STOCH"]), bool(s["SPEC_ADAPT"]))

    def cap(self, greedy: bool) -> int:
        """Most tokens a round drafts: DRAFT, or 6 at temperature 0 and 4 when sampling."""
        return self.draft or (6 if greedy else 4)


@dataclass
class DraftPolicy:
    """The next round's draft length. Estimates (exponential averages over rounds): `alpha`, the
    probability that a drafted token is accepted given the ones before it were, and `eps`, the cost
    of one more drafted token relative to a plain round (`t_plain` seconds, timed on plain rounds)."""

    adapt: bool
    alpha: float = 0.7
    eps: float = 0.2
    t_plain: float | None = None
    first_only: int = 0  # rounds in a row that kept only their own first token
    plain_run: int = 0  # plain rounds in a row chosen by the estimate
    probe_after: int = PROBE[0]
    probing: bool = False  # the round under way is a probe

    def length(self, cap: int, room: int, adapt: bool = True) -> int:
        """k for the next round, at most `cap` and `room` (0: a plain step); `adapt` False: the
        estimates are not used for this round (the livelock guard is)."""
        if self.first_only >= GUARD:  # livelock guard
            self.first_only = 0
            return 0
        cap = min(cap, room)
        if cap <= 0 or not (self.adapt and adapt):
            return max(0, cap)
        if self.t_plain is None:  # a plain round first, to time one
            return 0
        gain = [sum(self.alpha ** i for i in range(k + 1)) / (1 + k * self.eps) for k in range(cap + 1)]
        k = int(np.argmax(gain))
        if k == 0:
            self.plain_run += 1
            if self.plain_run >= self.probe_after:
                self.plain_run, self.probing = 0, True
                return 1
            return 0
        self.plain_run = 0
        self.probe_after = PROBE[0]
        return k

    def observe(self, k: int, accepted: int, seconds: float, timed: bool) -> None:
        """A round drafted k (0: plain), kept `accepted` drafts and took `seconds` (`timed`: no
        graph was recorded in it, so the time is a replay's)."""
        if k == 0:
            if timed:
                self.t_plain = seconds if self.t_plain is None else self.t_plain + EMA * (seconds - self.t_plain)
            return
        self.first_only = self.first_only + 1 if accepted == 0 else 0
        if self.probing and accepted == 0:  # a rejected probe: wait longer for the next
            self.probe_after = min(2 * self.probe_after, PROBE[1])
        self.probing = False
        rate = accepted / min(accepted + 1, k)
        self.alpha += EMA * (rate - self.alpha)
        if timed and self.t_plain:
            extra = max(0.01, (seconds - self.t_plain) / (k * self.t_plain))
            self.eps += EMA * (extra - self.eps)


@dataclass
class Round:
    """What one round did: tokens drafted (after the cut-off) and accepted, whether it was timed."""

    drafted: int = 0
    accepted: int = 0
    timed: bool = True
    tokens: list[int] = field(default_factory=list)


class Speculator:
    """Forward + ArgmaxForward (vkflash.engine.api) over a GpuForward built with mtp=True, and
    `speculate`, one round. Since the last reset: `drafted` / `accepted` draft tokens, `rounds`,
    `plain` rounds among them (no draft)."""

    def __init__(self, fwd: GpuForward, drafter: MtpDrafter, cfg: SpecConfig) -> None:
        self.fwd, self.drafter, self.cfg = fwd, drafter, cfg
        self.propose: Propose | None = None  # set by benches and tests: replaces each round's drafts before the verify
        self.n_ctx, self.n_vocab = fwd.n_ctx, fwd.n_vocab
        self.policy = DraftPolicy(cfg.adapt)
        self.drafted = self.accepted = self.rounds = self.plain = 0

    @classmethod
    def open(cls, model_path: str | os.PathLike[str], draft_path: str | os.PathLike[str] | None = None,
             small_path: str | os.PathLike[str] | None = None, **forward: object) -> "Speculator":
        """A speculator for a qwen4exp GGUF: its own MTP block, or the MTP-only GGUF `draft_path`;
        `small_path` (MODEL_DRAFT_SMALL) the smaller quant the deep-context guard may switch the
        draft to; `forward` goes to GpuForward (ctx, ub, kv, gpu, progress, guard)."""
        cfg = SpecConfig.from_settings()
        fwd = GpuForward(model_path, mtp=True, **forward)  # type: ignore[arg-type]
        return cls(fwd, MtpDrafter(fwd, draft_path, n_draft(), small_path), cfg)

    def describe(self) -> str:
        """One line for startup: what drafts, how many tokens, how verified and rolled back."""
        cfg, d = self.cfg, self.drafter
        cap = cfg.draft or "6 (temperature 0) or 4 (sampling)"
        return (f"MTP: drafting up to {cap} tokens a round ({'adaptive' if cfg.adapt else 'fixed'} length) with "
                f"{d.source}{'' if d.device_chain else ', embedding gathered on the host'}"
                f"{f' ({d.small.name} when the deep-context guard needs its memory)' if d.small else ''}; "
                f"{'rejection sampling' if cfg.stochastic else 'exact-match verification'} at temperature > 0; "
                f"{'in-place' if self.fwd.model.state.rec.in_place else 'copy'} rollback")

    def warm(self) -> None:
        """Record every graph a decoding round can use (draft rounds, verify steps, plain decode)."""
        self.drafter.warm()
        for n in range(1, min(self.drafter.k_max + 1, self.fwd.logits_step) + 1):
            self.fwd.graph_stats(n, Head.ALL if n > 1 else Head.LAST)

    # --- Forward protocol -----------------------------------------------------------------
    @property
    def n_past(self) -> int:
        return self.fwd.n_past

    def reset(self) -> None:
        """A new sequence (and new draft counts)."""
        self.fwd.reset()
        self.drafted = self.accepted = self.rounds = self.plain = 0
        self.policy.first_only = 0

    def reuse(self, ids: Sequence[int]) -> int:
        """Keep the prefix ids share with the sequence (GpuForward.reuse, strictly below the common
        prefix when a checkpoint is restored: the head's cache cell there must be right), new draft
        counts; a forward without reuse starts over."""
        if not isinstance(self.fwd, PrefixForward):
            self.reset()
            return 0
        self.drafted = self.accepted = self.rounds = self.plain = 0
        self.policy.first_only = 0
        n = self.fwd.reuse(ids, strict=True)  # type: ignore[call-arg]
        self.drafter.truncated(n)
        return n

    @property
    def keeps_checkpoints(self) -> bool:
        return isinstance(self.fwd, PrefixForward) and self.fwd.keeps_checkpoints

    def checkpoint(self) -> None:
        if isinstance(self.fwd, PrefixForward):
            self.fwd.checkpoint()

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        return self.fwd.prefill(ids)

    def prefill_argmax(self, ids: Sequence[int]) -> int:
        return self.fwd.prefill_argmax(ids)

    def decode(self, token: int) -> np.ndarray:
        return self.fwd.decode(token)

    def decode_argmax(self, token: int) -> int:
        return self.fwd.decode_argmax(token)

    def truncate(self, n: int) -> None:
        self.fwd.truncate(n)
        self.drafter.truncated(n)  # again when it is the forward's step hooks: the same cut

    # --- speculation ----------------------------------------------------------------------
    def speculate(self, x: int, sampler: Sampler, history: Sequence[int], limit: int) -> list[int]:
        """One round from the token x (the last of `history`, not yet fed): the tokens it produces,
        at least one, at most `limit` (≥ 1) and never past the context."""
        greedy = sampler.params.greedy
        room = min(self.n_ctx - self.fwd.n_past - 1, limit - 1, self.fwd.logits_step - 1)
        seeded = not greedy and sampler.params.seed is not None  # its draws may not depend on timings
        k = self.policy.length(self.cfg.cap(greedy), room, adapt=not seeded)
        records, t0 = Graph.records, time.perf_counter()
        r = self._round(x, k, sampler, history) if k else Round(tokens=[self._plain(x, sampler, history)])
        self.policy.observe(r.drafted, r.accepted, time.perf_counter() - t0, r.timed and Graph.records == records)
        self.drafted += r.drafted
        self.accepted += r.accepted
        self.rounds += 1
        self.plain += r.drafted == 0
        return r.tokens

    def _plain(self, x: int, sampler: Sampler, history: Sequence[int]) -> int:
        """A plain decode step (the draft head catches its pending rows up in the step's hook)."""
        if sampler.plain_greedy:
            return self.fwd.decode_argmax(x)
        return sampler.sample(self.fwd.decode(x), history)

    def _round(self, x: int, k: int, sampler: Sampler, history: Sequence[int]) -> Round:
        """Draft k, verify, accept, roll back."""
        n = self.fwd.n_past
        rejection = self.cfg.stochastic and not sampler.params.greedy
        usual = self.drafter.pending <= k + 1  # not the first round after a prompt (its whole last ubatch)
        history = _window(history, sampler)
        drafts, qs = self._draft(x, k, sampler, history, rejection)
        if self.propose is not None:
            drafts = self.propose(n + 1, drafts)
        r = Round(drafted=len(drafts), timed=len(drafts) == k and usual)
        if not drafts:  # cut to nothing: the pending rows are in the cache, so this is a plain step
            r.tokens = [self._plain(x, sampler, history)]
            return r
        ids = [x, *drafts]
        if sampler.plain_greedy:
            picks = self.fwd.verify(ids)
            a, last = _exact_match(drafts, lambda i: int(picks[i]))
        else:
            rows = self.fwd.verify(ids, logits=True)
            if rejection:
                a, last = _rejection_sample(drafts, qs, rows, sampler, history)
            else:  # the target's own pick at each row, drawn in order
                a, last = _exact_match(drafts, lambda i: sampler.sample(rows[i], [*history, *drafts[:i]]))
        r.tokens, r.accepted = [*drafts[:a], last], a
        if a < len(drafts):
            self.truncate(n + 1 + a)
        return r

    def _draft(self, x: int, k: int, sampler: Sampler, history: Sequence[int],
               rejection: bool) -> tuple[list[int], list[np.ndarray]]:
        """k drafted tokens (fewer after the confidence cut-off) and, for rejection sampling, the
        distribution each was drawn from."""
        p_min = self.cfg.p_min
        if self.drafter.device_chain and not rejection:
            dr = self.drafter.draft(x, k, logits=p_min > 0)
            drafts = dr.ids
            if dr.logits is not None:
                confident = [_confidence(row, d) >= p_min for row, d in zip(dr.logits, drafts)]
                drafts = drafts[:confident.index(False)] if False in confident else drafts
            return drafts, []
        drafts, qs = [], []
        row = self.drafter.first(x)
        for j in range(k):
            top = int(np.argmax(row))
            if p_min > 0 and _confidence(row, top) < p_min:  # before the draw: the cut may not depend on it
                break
            if rejection:
                q = sampler.probs(row, [*history, *drafts])
                d = sampler.draw(q)
                qs.append(q)
            else:
                d = top
            drafts.append(d)
            if j + 1 < k:
                row = self.drafter.next(j + 1, d)
        return drafts, qs


def agreeing(truth: Sequence[int], first: int, p: float, V: int, rng: np.random.Generator) -> Propose:
    """A `propose` whose drafts are the known continuation's tokens (truth[i] at position first + i)
    with probability p each, else another token: forced acceptance for benches and tests (random
    weights accept almost nothing)."""
    def propose(pos: int, drafts: list[int]) -> list[int]:
        out = []
        for j in range(len(drafts)):
            i = pos - first + j
            t = truth[i] if i < len(truth) else 0
            out.append(t if rng.random() < p else (t + 1 + int(rng.integers(V - 1))) % V)
        return out
    return propose


def _confidence(row: np.ndarray, token: int) -> float:
    """D1's confidence of `token`: its softmax weight among the top K_d logits (0 outside them;
    all of them in a vocabulary of fewer than K_d)."""
    k = min(DRAFT_TOP_K, len(row))
    top = np.argpartition(row, -k)[-k:]
    return confidence(row, token, k) if token in top else 0.0


def _window(history: Sequence[int], sampler: Sampler) -> list[int]:
    """The end of `history` the sampler's penalties look at (all a round's picks need)."""
    n = sampler.params.penalty_last_n
    return list(history[-n:]) if n and sampler.params.penalized else []


def _exact_match(drafts: list[int], pick: Callable[[int], int]) -> tuple[int, int]:
    """(drafts equal to the target's pick at their row, counted from the first; the target's pick
    at the first mismatch, or after the last draft), each row's pick made once and in order."""
    for i, d in enumerate(drafts):
        y = pick(i)
        if y != d:
            return i, y
    return len(drafts), pick(len(drafts))


def _rejection_sample(drafts: list[int], qs: list[np.ndarray], rows: np.ndarray, sampler: Sampler,
                      history: Sequence[int]) -> tuple[int, int]:
    """(accepted drafts, the token after them) by rejection sampling against the target rows."""
    for i, (d, q) in enumerate(zip(drafts, qs)):
        p = sampler.probs(rows[i], [*history, *drafts[:i]])
        if sampler.uniform() < min(1.0, p[d] / q[d]):
            continue
        residual = np.maximum(p - q, 0.0)
        return i, sampler.draw(residual if residual.any() else p)  # p ≤ q everywhere: only by rounding
    return len(drafts), sampler.draw(sampler.probs(rows[len(drafts)], [*history, *drafts]))
