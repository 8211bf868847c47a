"""The generation loop against forwards with known logits: greedy chain, every stop rule,
UTF-8-safe streaming, cancellation, backend errors, the argmax fast path and timings."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from fakes import ArgmaxTableForward, ByteCodec, ScriptForward, TableForward  # noqa: E402

from vkflash.engine.api import Finish, InvalidRequest, SamplingParams, TokenEvent  # noqa: E402
from vkflash.engine.generate import StopMatcher, generate  # noqa: E402
from vkflash.model.chat import held_suffix  # noqa: E402

V = 300
EOG = 299
GREEDY = SamplingParams(temperature=0.0)


def _run(fwd, prompt, params, cancel=None, ubatch=2048):
    events = list(generate(fwd, ByteCodec(EOG), prompt, params, cancel, ubatch))
    toks = [e for e in events if isinstance(e, TokenEvent)]
    fin = events[-1]
    assert isinstance(fin, Finish) and all(not isinstance(e, Finish) for e in events[:-1])
    return toks, fin, "".join(e.text for e in toks) + fin.text


def _table(rng, no_eog=True):
    t = rng.standard_normal((V, V)).astype(np.float32)
    if no_eog:
        t[:, EOG] = -1e9
    return t


def _greedy_chain(table, prompt, n):
    seq, out = list(prompt), []
    for _ in range(n):
        z = table[seq[-1]] + 0.01 * len(seq)
        out.append(int(np.argmax(z)))
        seq.append(out[-1])
    return out


def test_greedy_chain_and_max_tokens(rng):
    table = _table(rng)
    prompt = list(rng.integers(0, 256, size=int(rng.integers(1, 40))))
    m = int(rng.integers(1, 30))
    fwd = TableForward(table, n_ctx=200)
    toks, fin, _ = _run(fwd, prompt, SamplingParams(temperature=0.0, max_tokens=m))
    assert [e.token for e in toks] == _greedy_chain(table, prompt, m)
    assert fin.reason == "length" and fin.completion_tokens == m and fin.prompt_tokens == len(prompt)
    assert fwd.n_past == len(prompt) + m - 1  # the last token is sampled, never fed


@pytest.mark.parametrize("ubatch", [1, 3, 7, 4096])
def test_prefill_ubatches_do_not_change_output(rng, ubatch):
    table = _table(rng)
    prompt = list(rng.integers(0, 256, size=int(rng.integers(2, 30))))
    fwd = TableForward(table, n_ctx=100)
    toks, _, _ = _run(fwd, prompt, SamplingParams(temperature=0.0, max_tokens=5), ubatch=ubatch)
    assert [e.token for e in toks] == _greedy_chain(table, prompt, 5)
    prefills = [c for c in fwd.calls if c.startswith("prefill")]
    assert [int(c.split()[1]) for c in prefills] == [min(ubatch, len(prompt) - a) for a in range(0, len(prompt), ubatch)]


def test_context_end_is_length_never_overflow(rng):
    n_ctx = int(rng.integers(10, 60))
    prompt = list(rng.integers(0, 256, size=int(rng.integers(1, n_ctx))))
    fwd = TableForward(_table(rng), n_ctx=n_ctx)  # raises if anything is written past n_ctx
    toks, fin, _ = _run(fwd, prompt, SamplingParams(temperature=0.0, max_tokens=10 * n_ctx))
    assert fin.reason == "length" and fin.error is None
    assert len(toks) == n_ctx - len(prompt) == fin.completion_tokens


def test_prompt_that_fills_the_context_is_refused(rng):
    n_ctx = int(rng.integers(4, 30))
    fwd = TableForward(_table(rng), n_ctx=n_ctx)
    with pytest.raises(InvalidRequest):
        _run(fwd, list(rng.integers(0, 256, size=n_ctx)), GREEDY)
    with pytest.raises(InvalidRequest):
        _run(fwd, [], GREEDY)


def _text_script(rng, n_chars):
    alphabet = "abcxyz _-é€中😀\n"
    text = "".join(rng.choice(list(alphabet), size=n_chars))
    return text, list(text.encode("utf-8"))


def test_streamed_text_never_splits_utf8(rng):
    text, script = _text_script(rng, int(rng.integers(5, 40)))
    fwd = ScriptForward(script + [EOG], n_prompt=3, V=V, n_ctx=500)
    toks, fin, streamed = _run(fwd, [1, 2, 3], GREEDY)
    assert streamed == text and fin.reason == "stop"
    assert all("\ufffd" not in e.text for e in toks)
    assert fin.completion_tokens == len(script)  # EOG not counted, not printed


def test_ignore_eos_runs_on(rng):
    fwd = ScriptForward([65, EOG, 66, 67], n_prompt=1, V=V, n_ctx=50)
    toks, fin, _ = _run(fwd, [1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert [e.token for e in toks] == [65, EOG, 66, 67] and fin.reason == "length"


def test_stop_strings_cut_output_and_hold_back(rng):
    text, script = _text_script(rng, int(rng.integers(20, 60)))
    a = int(rng.integers(0, len(text) - 3))
    stop = text[a:a + int(rng.integers(1, 4))]
    decoy = stop + "\x00never"  # shares a prefix with the real stop, never matches
    fwd = ScriptForward(script + [EOG], n_prompt=1, V=V, n_ctx=500)
    toks, fin, streamed = _run(fwd, [7], SamplingParams(temperature=0.0, stop=(decoy, stop)))
    assert fin.reason == "stop"
    assert streamed == text[: text.find(stop)]
    # nothing that was emitted ever contained the stop string's start beyond what survives
    assert all(stop not in e.text for e in toks)


def test_stop_matcher_holds_only_possible_prefixes(rng):
    for _ in range(50):
        stops = ["".join(rng.choice(list("ab"), size=int(rng.integers(1, 5)))) for _ in range(2)]
        text = "".join(rng.choice(list("abc"), size=int(rng.integers(1, 30))))
        m = StopMatcher(stops)
        out, hit = "", False
        for ch in text:
            piece, hit = m.push(ch)
            out += piece
            if hit:
                break
        # streaming semantics: stop at the first stop string to complete, cut where it starts
        done = next((i for i in range(1, len(text) + 1) if any(s in text[:i] for s in stops)), 0)
        first = min([k for k in (text[:done].find(s) for s in stops) if k >= 0], default=-1)
        if first >= 0:
            assert hit and out == text[:first]
        else:
            assert not hit and out + m.flush() == text
            assert held_suffix(text, stops) == len(text) - len(out)


def test_cancel_stops_within_one_token(rng):
    fwd = TableForward(_table(rng), n_ctx=400)
    cancel = threading.Event()
    k = int(rng.integers(1, 20))
    gen = generate(fwd, ByteCodec(EOG), [5, 6], GREEDY, cancel)
    n = 0
    for ev in gen:
        if isinstance(ev, TokenEvent):
            n += 1
            if n == k:
                cancel.set()
        else:
            assert ev.reason == "cancelled" and ev.completion_tokens == k
    assert n == k


def test_backend_error_ends_with_error_finish(rng):
    fail_at = int(rng.integers(8, 20))
    fwd = TableForward(_table(rng), n_ctx=100, fail_at=fail_at)
    toks, fin, _ = _run(fwd, [1, 2, 3], GREEDY)
    assert fin.reason == "error" and isinstance(fin.error, RuntimeError)
    assert len(toks) == fail_at - 3 + 1


def test_argmax_fast_path_matches_logits_path(rng):
    table = _table(rng)
    prompt = list(rng.integers(0, 256, size=int(rng.integers(1, 20))))
    p = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(1, 25)))
    slow, _, _ = _run(TableForward(table, 100), prompt, p)
    fast_fwd = ArgmaxTableForward(table, 100)
    fast, _, _ = _run(fast_fwd, prompt, p)
    assert [e.token for e in fast] == [e.token for e in slow]


def test_seeded_sampling_is_reproducible(rng):
    table = _table(rng) * 0.3  # flat enough that sampling really varies
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=int(rng.integers(0, 2**32)), max_tokens=30)
    a, _, _ = _run(TableForward(table, 100), [1], p)
    b, _, _ = _run(TableForward(table, 100), [1], p)
    assert [e.token for e in a] == [e.token for e in b]


def test_timings_are_consistent(rng):
    ticks = iter(np.cumsum(rng.uniform(0.001, 0.01, size=1000)))
    fwd = TableForward(_table(rng), 100)
    events = list(generate(fwd, ByteCodec(EOG), [1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=6),
                           clock=lambda: float(next(ticks))))
    t = events[-1].timings
    j = t.to_json()
    assert t.prompt_n == 4 and t.predicted_n == 6 and t.prompt_ms > 0 and t.predicted_ms > 0
    assert j["prompt_per_second"] == pytest.approx(4000 / t.prompt_ms)
    assert j["predicted_per_token_ms"] == pytest.approx(t.predicted_ms / 6)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=1.0, repetition_penalty=1.3)])
def test_constraint_masks_every_draw(rng, params):
    """With a grammar the output matches it, greedy included: the device argmax (blind to the mask)
    is never used, and generation ends as soon as the grammar is complete."""
    from vkflash.engine.grammar import Grammar
    from vkflash.model.tokenizer import Tokenizer
    from vkflash.model.vocab_build import tiny_vocab

    pytest.importorskip("llguidance", reason="grammars need llguidance (a dependency; absent from the GPU kit)")
    vm = tiny_vocab(512)
    tok = Tokenizer(vm.tokens, vm.token_types, vm.merges, vm.pre, vm.eos_id, vm.bos_id)
    table = rng.standard_normal((512, 512)).astype(np.float32)
    words = [str(int(x)) for x in rng.integers(0, 1000, size=3)]
    class Blind(ArgmaxTableForward):
        """An argmax fast path that must not be taken."""

        def prefill_argmax(self, ids):
            raise AssertionError("device argmax under a constraint")

        decode_argmax = prefill_argmax

    fwd = Blind(table, n_ctx=300)
    grammar = Grammar.compile("gbnf", "root ::= (" + " | ".join(f'"{w}"' for w in words) + ") \"!\"", tok, 512, "g")
    events = list(generate(fwd, tok, list(rng.integers(0, 400, size=5)), params, constraint=grammar.constraint()))
    fin = events[-1]
    text = "".join(e.text for e in events if isinstance(e, TokenEvent)) + fin.text
    assert fin.reason == "stop" and text in {w + "!" for w in words}, (fin, text)
    assert fwd.calls.count("decode") == fin.completion_tokens - 1  # no step after the grammar's end
