"""The generation loop of DESIGN §3: prefill in ubatches, then one decode per token (or, with a
speculative forward, one speculation round per few tokens), incremental detokenization, and every
stop rule (EOS/EOT, stop strings, max_tokens, the context end, cancel).

The prompt plus the output always fits in n_ctx: output stops with "length" when it would not,
so no backend is ever asked to write past its cache.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from vkflash.engine.api import ArgmaxForward, Finish, Forward, InvalidRequest, PrefixForward, SamplingParams, \
    SpeculativeForward, TextCodec, Timings, TokenEvent
from vkflash.engine.grammar import Constraint
from vkflash.engine.sampling import Sampler
from vkflash.model.chat import held_suffix


@dataclass
class StopMatcher:
    """Streams text through, holding back any tail that might begin a stop string."""

    stops: Sequence[str]
    _pending: str = field(default="", init=False)

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to emit, whether a stop string was found; the emit ends just before it)."""
        buf = self._pending + text
        hits = [k for k in (buf.find(s) for s in self.stops) if k >= 0]
        if hits:
            self._pending = ""
            return buf[: min(hits)], True
        keep = held_suffix(buf, self.stops)
        self._pending = buf[len(buf) - keep:]
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back tail, at the end of generation without a stop match."""
        rest, self._pending = self._pending, ""
        return rest


def check_prompt(n_prompt: int, n_ctx: int) -> None:
    """A prompt must be non-empty and leave room for at least one output token."""
    if n_prompt == 0:
        raise InvalidRequest("the prompt is empty (0 tokens)", "prompt")
    if n_prompt >= n_ctx:
        raise InvalidRequest(f"the prompt has {n_prompt} tokens; the context holds {n_ctx} "
                             f"(prompt + output must fit)", "messages")


def generate(fwd: Forward, codec: TextCodec, prompt: Sequence[int], params: SamplingParams,
             cancel: threading.Event | None = None, ubatch: int = 2048,
             clock: Callable[[], float] = time.perf_counter,
             constraint: Constraint | None = None, checkpoint_at: int | None = None) -> Iterator[TokenEvent | Finish]:
    """Yield one TokenEvent per generated token, then exactly one Finish.

    With params.cache_prompt and a PrefixForward, the prefix the prompt shares with the last
    sequence is kept (Timings.cache_n), else the sequence starts over; either way a checkpoint
    marks the state after the prompt's first `checkpoint_at` tokens (default: all of them;
    engine/prefix.py), for a later request that comes back there. A chat prompt puts it where its
    generation prompt begins: the next turn repeats the conversation up to there, not the
    generation prompt itself (a template may drop its empty think block from the history, and the
    reply's first characters may merge with its last token). Backend exceptions end the stream with
    Finish(reason="error", error=exc); a set `cancel` event ends it with "cancelled" within one token
    (or one ubatch of prefill). With a `constraint` every token is drawn from the logits it masks (no
    device argmax, no speculation), and the output stops once the grammar is complete.
    """
    cancel = cancel or threading.Event()
    prompt = [int(t) for t in prompt]
    check_prompt(len(prompt), fwd.n_ctx)
    sampler = Sampler(params)
    fast = sampler.plain_greedy and isinstance(fwd, ArgmaxForward) and constraint is None
    spec = fwd if isinstance(fwd, SpeculativeForward) and constraint is None else None
    ahead: deque[int] = deque()  # tokens a speculation round produced that are not out yet
    detok = codec.streamer()
    stops = StopMatcher(params.stop)
    budget = fwd.n_ctx - len(prompt)  # prompt + output ≤ n_ctx
    if params.max_tokens is not None:
        budget = min(budget, params.max_tokens)
    history = list(prompt)
    prefix = fwd if isinstance(fwd, PrefixForward) else None
    n_cached = 0
    n_out, t0 = 0, clock()
    t_prefill_end = t0

    def pick(logits: np.ndarray) -> int:
        """The next token from logits (masked by the constraint, if any)."""
        return sampler.sample(logits if constraint is None else constraint.mask(logits), history)

    def finish(reason: str, tail: str = "", error: BaseException | None = None) -> Finish:
        t_end = clock()
        if reason != "stop":
            emitted, _ = stops.push(detok.flush())
            tail += emitted + stops.flush()
        # accepted drafts still ahead were never output (the round's last token is the target's own)
        drafts = (spec.drafted, spec.accepted - max(0, len(ahead) - 1)) if spec is not None else (None, None)
        return Finish(reason, tail, len(prompt), n_out,  # type: ignore[arg-type]
                      Timings(len(prompt) - n_cached, (t_prefill_end - t0) * 1e3, n_out,
                              (t_end - t_prefill_end) * 1e3, *drafts, cache_n=n_cached), error)

    try:
        if prefix is not None and params.cache_prompt:
            n_cached = prefix.reuse(prompt)
        else:
            fwd.reset()
        keep = len(prompt) if checkpoint_at is None else min(max(checkpoint_at, 1), len(prompt))
        if keep < n_cached or prefix is None or not prefix.keeps_checkpoints:
            keep = len(prompt)  # past the kept sequence, or nothing to keep: the prompt in one go
        nxt: int | None = None
        pos = n_cached
        for end in (keep, len(prompt)) if n_cached < keep < len(prompt) else (len(prompt),):
            while pos < end:
                if cancel.is_set():
                    yield finish("cancelled")
                    return
                chunk = prompt[pos:min(pos + ubatch, end)]
                pos += len(chunk)
                if pos == len(prompt) and fast:
                    nxt = fwd.prefill_argmax(chunk)  # type: ignore[attr-defined]
                elif pos == len(prompt):
                    nxt = pick(fwd.prefill(chunk))
                else:
                    fwd.prefill(chunk)
            if prefix is not None and end == keep:
                prefix.checkpoint()  # a later request may come back here, whether or not this one reused
        t_prefill_end = clock()
        assert nxt is not None
        while True:
            if cancel.is_set():
                yield finish("cancelled")
                return
            token = nxt
            n_out += 1
            history.append(token)
            if constraint is not None:
                constraint.accept(token)
            if codec.is_eog(token) and not params.ignore_eos:
                n_out -= 1  # the end token is not output text; llama-server does not count it either
                text, _ = stops.push(detok.flush())
                yield finish("stop", text + stops.flush())
                return
            text, hit = stops.push(detok.push(token))
            if hit:
                yield TokenEvent(token, text)
                yield finish("stop")
                return
            if constraint is not None and constraint.done:  # the grammar is complete: nothing may follow
                yield TokenEvent(token, text + stops.push(detok.flush())[0] + stops.flush())
                yield finish("stop")
                return
            yield TokenEvent(token, text)
            if n_out >= budget:
                yield finish("length")
                return
            if spec is not None:
                if not ahead:
                    ahead.extend(spec.speculate(token, sampler, history, budget - n_out))
                nxt = ahead.popleft()
            else:
                nxt = fwd.decode_argmax(token) if fast else pick(fwd.decode(token))  # type: ignore[attr-defined]
    except Exception as e:  # noqa: BLE001 — any backend failure ends this request, reported to the caller
        yield finish("error", error=e)
