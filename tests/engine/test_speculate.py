"""The speculation loop (engine/speculate.py) over table fakes, without a GPU: greedy rounds give
plain greedy decoding; sampled rounds, by rejection sampling or exact-match verification, give the
generated tokens exactly the plain sampler's joint distribution (Pearson chi-square over thousands
of seeded generations, false-alarm rate 1e-5 per test); the draft-length policy, the livelock guard,
and generate() with rounds of several tokens."""

from __future__ import annotations

from collections import Counter
from itertools import product

import numpy as np
import pytest

from chi2 import chi2_pvalue
from fakes import ArgmaxTableForward, ByteCodec, TableDrafter, VerifyTableForward
from vkflash.engine.api import Finish, SamplingParams, TokenEvent
from vkflash.engine.generate import generate
from vkflash.engine.sampling import Sampler
from vkflash.engine.speculate import GUARD, PROBE, DraftPolicy, SpecConfig, Speculator, agreeing

ALPHA = 1e-5  # false-alarm rate of each statistical test (five such tests run in the suite)


def _tables(rng: np.random.Generator, V: int, noise: float) -> tuple[np.ndarray, np.ndarray]:
    """A target Markov chain's logits table and a draft table that is the target's plus noise."""
    target = rng.normal(0, 1.5, (V, V)).astype(np.float32)
    return target, (target + rng.normal(0, noise, (V, V))).astype(np.float32)


def _speculator(target: np.ndarray, draft: np.ndarray, n_ctx: int, cfg: SpecConfig,
                device_chain: bool = True) -> Speculator:
    return Speculator(VerifyTableForward(target, n_ctx), TableDrafter(draft, 7, device_chain), cfg)  # type: ignore[arg-type]


def _tokens(fwd, prompt: list[int], params: SamplingParams) -> list[int]:
    return [e.token for e in generate(fwd, ByteCodec(eog=-1), prompt, params) if isinstance(e, TokenEvent)]


@pytest.mark.parametrize("k, adapt, chain", [(1, False, True), (4, False, True), (7, False, False), (6, True, True)])
def test_greedy_rounds_are_greedy_decoding(rng, k, adapt, chain):
    """Greedy speculation (device-chained or host-chained drafts, fixed or adaptive length, with
    and without penalties) outputs plain greedy decoding's tokens up to the context end, with the
    head's own drafts and with drafts that agree with the output with probability 0.6."""
    V = 12
    target, draft = _tables(rng, V, 0.8)
    prompt = [int(t) for t in rng.integers(0, V, 5)]
    for params in (SamplingParams(temperature=0.0, ignore_eos=True),
                   SamplingParams(temperature=0.0, repetition_penalty=1.4, ignore_eos=True)):
        want = _tokens(ArgmaxTableForward(target, 80), prompt, params)
        assert len(want) == 75
        for propose in (None, agreeing(want, len(prompt), 0.6, V, rng)):
            sp = _speculator(target, draft, 80, SpecConfig(k, 0.0, True, adapt), chain)
            sp.policy.t_plain = 1.0  # a plain round "costs" 1 s: drafting looks cheap, so it happens
            sp.propose = propose
            assert _tokens(sp, prompt, params) == want
        assert 0 < sp.accepted < sp.drafted


def _joint(target: np.ndarray, prompt: list[int], params: SamplingParams, m: int) -> dict[tuple[int, ...], float]:
    """Exact probabilities of the first m generated tokens under plain sampling of the chain."""
    s = Sampler(params)
    V = len(target)
    out: dict[tuple[int, ...], float] = {}
    for seq in product(range(V), repeat=m):
        p, hist = 1.0, list(prompt)
        for t in seq:
            p *= float(s.probs(target[hist[-1]] + 0.01 * len(hist), hist)[t])
            hist.append(t)
        out[seq] = p
    return out


@pytest.mark.parametrize("stochastic, p_min", [(True, 0.0), (False, 0.0), (True, 0.4)],
                         ids=["rejection", "exact-match", "rejection+pmin"])
@pytest.mark.parametrize("filters", [{}, {"top_k": 3, "repetition_penalty": 1.5, "temperature": 1.3}],
                         ids=["plain", "top_k+penalty"])
def test_sampled_tokens_have_the_plain_distribution(rng, stochastic, p_min, filters):
    """4000 seeded generations of 3 tokens (the last two from speculation rounds of up to 3 drafts
    whose distribution differs from the target's; with DRAFT_PMIN 0.4 some rounds cut short): the
    joint distribution of the 3 tokens equals plain sampling's (chi-square p-value > ALPHA, pooled
    cells expected < 5)."""
    V, n = 5, 4000
    target, draft = _tables(rng, V, 1.0)
    prompt = [int(t) for t in rng.integers(0, V, 3)]
    params = dict(temperature=1.0, max_tokens=3, ignore_eos=True) | filters
    sp = _speculator(target, draft, 16, SpecConfig(3, p_min, stochastic, False))
    counts: Counter[tuple[int, ...]] = Counter()
    for seed in range(n):
        counts[tuple(_tokens(sp, prompt, SamplingParams(seed=seed, **params)))] += 1  # type: ignore[arg-type]
    probs = _joint(target, prompt, SamplingParams(**params), 3)  # type: ignore[arg-type]
    cells = sorted(probs)
    pvalue, df = chi2_pvalue(np.array([counts[c] for c in cells], float), np.array([probs[c] for c in cells]))
    assert sum(counts.values()) == n and set(counts) <= set(cells)
    assert pvalue > ALPHA, f"chi-square p = {pvalue:.2e} with {df} degrees of freedom"
    assert sp.drafter.proposals > 0  # type: ignore[attr-defined]


def test_rejection_sampling_detects_a_wrong_acceptance(rng, monkeypatch):
    """The test above has power: accepting every draft (no p/q test) is caught."""
    import vkflash.engine.speculate as S

    monkeypatch.setattr(S, "_rejection_sample", lambda drafts, qs, rows, sampler, history: (
        len(drafts), sampler.draw(sampler.probs(rows[len(drafts)], [*history, *drafts]))))
    V, n = 5, 4000
    target, draft = _tables(rng, V, 2.0)
    prompt = [int(t) for t in rng.integers(0, V, 3)]
    params = dict(temperature=1.0, max_tokens=3, ignore_eos=True)
    sp = _speculator(target, draft, 16, SpecConfig(3, 0.0, True, False))
    counts: Counter[tuple[int, ...]] = Counter()
    for seed in range(n):
        counts[tuple(_tokens(sp, prompt, SamplingParams(seed=seed, **params)))] += 1  # type: ignore[arg-type]
    probs = _joint(target, prompt, SamplingParams(**params), 3)  # type: ignore[arg-type]
    cells = sorted(probs)
    pvalue, _ = chi2_pvalue(np.array([counts[c] for c in cells], float), np.array([probs[c] for c in cells]))
    assert pvalue < ALPHA


def test_livelock_guard_forces_a_plain_step(rng):
    """Drafts that are always wrong: after GUARD rounds in a row that kept only their first token,
    one plain step; the output is still plain greedy decoding."""
    V = 10
    target, draft = _tables(rng, V, 0.5)
    prompt = [int(t) for t in rng.integers(0, V, 4)]
    params = SamplingParams(temperature=0.0, max_tokens=41, ignore_eos=True)
    want = _tokens(ArgmaxTableForward(target, 64), prompt, params)
    sp = _speculator(target, draft, 64, SpecConfig(3, 0.0, True, False))
    sp.propose = lambda pos, drafts: [(want[pos - len(prompt)] + 1) % V for _ in drafts]
    assert _tokens(sp, prompt, params) == want
    assert sp.accepted == 0 and sp.rounds == 40 and sp.plain == 40 // (GUARD + 1)


def test_policy_lengths():
    """Adaptive length: the cap when drafts are mostly accepted and cheap; shorter when they cost
    more; plain steps when they are rejected, with probes backing off; a plain round first (timing)."""
    p = DraftPolicy(adapt=True)
    assert p.length(6, 10) == 0  # no plain round timed yet
    p.observe(0, 0, 0.01, True)
    p.alpha, p.eps = 0.95, 0.05
    assert p.length(6, 10) == 6 and p.length(6, 3) == 3
    p.eps = 0.6
    assert 0 < p.length(6, 10) < 6
    p.alpha, p.eps = 0.02, 0.2
    ks = [p.length(6, 10) for _ in range(PROBE[0])]
    assert ks == [0] * (PROBE[0] - 1) + [1]
    p.observe(1, 0, 0.01, True)
    assert p.probe_after == 2 * PROBE[0]
    fixed = DraftPolicy(adapt=False)
    assert fixed.length(4, 10) == 4 and fixed.length(4, 0) == 0


def test_generate_with_rounds_of_several_tokens(rng):
    """generate() emits a round's tokens one by one and stops inside a round (max_tokens, a stop
    string, the end token); timings carry the draft counts, only when speculating, and count as
    accepted only the drafts that came out."""
    V = 40
    target = np.full((V, V), -5.0, np.float32)
    for t in range(V):
        target[t, (t + 1) % V] = 5.0  # greedy: 32, 33, … (bytes ' ', '!', …)
    sp = _speculator(target, target, 64, SpecConfig(4, 0.0, True, False))
    evs = list(generate(sp, ByteCodec(eog=-1), [31], SamplingParams(temperature=0.0, max_tokens=7)))
    fin = evs[-1]
    assert isinstance(fin, Finish) and fin.reason == "length" and fin.completion_tokens == 7
    assert [e.token for e in evs[:-1]] == list(range(32, 39))
    assert fin.timings.draft_n == sp.drafted > 0 and fin.timings.draft_n_accepted == sp.accepted
    assert {"draft_n", "draft_n_accepted"} <= set(fin.timings.to_json())
    evs = list(generate(sp, ByteCodec(eog=-1), [31], SamplingParams(temperature=0.0, stop=("#$",))))
    assert "".join(e.text for e in evs) == ' !"' and evs[-1].reason == "stop"  # type: ignore[union-attr]
    sp = _speculator(target, target, 64, SpecConfig(6, 0.0, True, False))
    evs = list(generate(sp, ByteCodec(eog=34), [31], SamplingParams(temperature=0.0)))
    fin = evs[-1]
    assert [e.token for e in evs[:-1]] == [32, 33] and isinstance(fin, Finish) and fin.reason == "stop"
    # the round from 32 drafted 33…38 and kept them all; 33 and the end token 34 came out, 35…38 did not
    assert (fin.timings.draft_n, fin.timings.draft_n_accepted) == (6, 2)
    plain = list(generate(ArgmaxTableForward(target, 64), ByteCodec(eog=-1), [31], SamplingParams(temperature=0.0,
                                                                                                  max_tokens=3)))
    assert "draft_n" not in plain[-1].timings.to_json()  # type: ignore[union-attr]


def test_confidence_cut_off(rng):
    """DRAFT_PMIN: a draft ends at its first token whose top-10 softmax weight is below p_min (a round
    cut to nothing is a plain step); output is still greedy decoding's. The target's greedy output goes
    round a cycle through all V tokens and every draft agrees with it, so without the cut-off every
    round drafts as many tokens as it may and keeps them all (no plain step, fewest rounds). The draft
    row of the first round's token (and of random others, not the next one) picks its token with
    confidence < 0.63, every other row with > 0.99: the cut run's first round is plain, its second
    drafts, and every round stops drafting at the first unconfident row it reaches."""
    V = 12
    cycle = rng.permutation(V)
    succ = np.empty(V, np.int64)
    succ[cycle] = np.roll(cycle, -1)  # greedy decoding's next token after t
    target, draft = _tables(rng, V, 0.8)
    rows, others = np.arange(V), ~np.eye(V, dtype=bool)[succ]
    target[rows, succ] = target.max(axis=1) + 1.0
    prompt = [int(t) for t in rng.integers(0, V, 5)]
    first = succ[prompt[-1]]  # the prefill's token: the first round drafts from its row
    unsure = rng.random(V) < 0.25
    unsure[first], unsure[succ[first]] = True, False
    gap = np.where(unsure, 0.5, 8.0)  # top-10 softmax weight ≤ 1/(1+e^-0.5) < 0.63, or ≥ 1/(1+9e^-8) > 0.99
    draft[rows, succ] = np.where(others, draft, -np.inf).max(axis=1) + gap
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = _tokens(ArgmaxTableForward(target, 64), prompt, params)
    free = _speculator(target, draft, 64, SpecConfig(4, 0.0, True, False))
    cut = _speculator(target, draft, 64, SpecConfig(4, 0.95, True, False))
    assert _tokens(free, prompt, params) == want == _tokens(cut, prompt, params)
    assert free.accepted == free.drafted and cut.accepted == cut.drafted
    assert 0 < cut.drafted < free.drafted and cut.plain > free.plain
    i = 0  # each cut round, from want[i]: its drafts come from confident rows, up to an unconfident one
    for call in cut.fwd.calls[1:]:  # type: ignore[attr-defined]
        d = int(call.split()[1]) - 1 if call.startswith("verify") else 0
        assert not unsure[want[i:i + d]].any() and (unsure[want[i + d]] or d == min(4, len(want) - 2 - i)), call
        i += d + 1
    assert i == len(want) - 1 and cut.fwd.calls[1] == "decode"  # type: ignore[attr-defined]


def test_seeded_sampling_repeats_whatever_the_policy_learned(rng):
    """SPEC_ADAPT=1 picks draft lengths from measured costs, and a round's draws depend on its
    length: a seeded sampled request drafts the fixed length instead, so the same seed gives the same
    tokens whatever the policy's estimates (one that finds drafting worthless, one that finds it cheap)."""
    V = 12
    target, draft = _tables(rng, V, 1.0)
    sp = _speculator(target, draft, 80, SpecConfig(0, 0.0, True, True))
    prompt = [int(t) for t in rng.integers(0, V, 4)]
    params = SamplingParams(seed=int(rng.integers(1 << 31)), temperature=1.0, max_tokens=40, ignore_eos=True)
    outs = []
    for alpha, eps in ((0.05, 3.0), (0.95, 0.01)):
        sp.policy.alpha, sp.policy.eps, sp.policy.t_plain = alpha, eps, 1.0
        outs.append(_tokens(sp, prompt, params))
        assert sp.drafted > 0
    assert outs[0] == outs[1]
