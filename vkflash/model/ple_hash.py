"""PLE host hashing (MODEL.md §5.3 P1–P3) and the HF derivation of its constants (§8, §9).

Everything is uint64 (products exceed 2⁵³ and 2³²). `ple_rows` works on a token history so
that prefill of a whole ubatch and token-by-token decode give identical rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MASK64 = (1 << 64) - 1
SPLITMIX_GAMMA = 0x9E3779B97F4A7C15
SPLITMIX_M1 = 0xBF58476D1CE4E5B9
SPLITMIX_M2 = 0x94D049BB133111EB
PRIME_1 = 10007  # HF: per-PLE-layer seed stride
DEFAULT_SEED = 1234


@dataclass(frozen=True)
class PleHashParams:
    """The integer PLE constants of one file: N, h_g, EOS, m_0..m_{N−1}, o_h, P_h."""

    ngram_size: int  # N
    heads_per_ngram: int  # h_g
    eos: int  # ple.eos_token_id (not the tokenizer's stop token)
    multipliers: np.ndarray  # uint64 (≥ N,), only the first N are used
    head_offsets: np.ndarray  # uint64 (≥ n_p,)
    head_vocab_sizes: np.ndarray  # uint64 (≥ n_p,)

    @property
    def n_heads(self) -> int:
        """n_p = (N−1)·h_g."""
        return (self.ngram_size - 1) * self.heads_per_ngram


def splitmix64(v: int) -> int:
    """One splitmix64 step on a Python int (mod 2⁶⁴), as HF `_splitmix64`."""
    v = (v + SPLITMIX_GAMMA) & MASK64
    v = ((v ^ (v >> 30)) * SPLITMIX_M1) & MASK64
    v = ((v ^ (v >> 27)) * SPLITMIX_M2) & MASK64
    return v ^ (v >> 31)


def build_layer_multipliers(vocab_size: int, ngram_size: int, ple_layer_index: int = 0,
                            seed: int = DEFAULT_SEED) -> list[int]:
    """HF `_build_layer_multipliers`: N odd multipliers m_i < (2⁶³−1)/V, so tok·m_i fits in int64."""
    half = max(1, (((1 << 63) - 1) // max(vocab_size, 1)) // 2)
    base = seed + PRIME_1 * ple_layer_index
    return [2 * (splitmix64((base + SPLITMIX_GAMMA * (i + 1)) & MASK64) % half) + 1
            for i in range(ngram_size)]


def is_prime(n: int) -> bool:
    """Deterministic primality for n < 3.3·10²⁴ (Miller–Rabin with fixed bases)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d, s = d // 2, s + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def find_nth_prime_after(start: int, n: int) -> int:
    """HF `_find_nth_prime_after`: the n-th prime strictly greater than start (n ≥ 1)."""
    p = start
    for _ in range(n):
        p += 1
        while not is_prime(p):
            p += 1
    return p


def head_vocab_sizes(vocab_base: int, n_heads: int, ple_layer_index: int = 0) -> list[int]:
    """P_h = the (ℓ·n_p + h + 1)-th prime after vocab_base − 1: distinct primes ≥ vocab_base."""
    first = ple_layer_index * n_heads
    sizes, p = [], vocab_base - 1
    p = find_nth_prime_after(p, first) if first else p
    for _ in range(n_heads):
        p = find_nth_prime_after(p, 1)
        sizes.append(p)
    return sizes


def head_offsets(sizes: list[int]) -> list[int]:
    """o_h = Σ_{h'<h} P_h' (exclusive prefix sum)."""
    return [int(x) for x in np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64)])]


def make_params(vocab_size: int, ngram_size: int, heads_per_ngram: int, eos: int,
                vocab_base: int) -> PleHashParams:
    """All PLE hash constants from the HF derivation, PLE layer 0 and the default seed (used by the
    test-model generator)."""
    n_p = (ngram_size - 1) * heads_per_ngram
    sizes = head_vocab_sizes(vocab_base, n_p)
    return PleHashParams(
        ngram_size=ngram_size, heads_per_ngram=heads_per_ngram, eos=eos,
        multipliers=np.array(build_layer_multipliers(vocab_size, ngram_size), dtype=np.uint64),
        head_offsets=np.array(head_offsets(sizes), dtype=np.uint64),
        head_vocab_sizes=np.array(sizes, dtype=np.uint64))


def ngram_contexts(tokens: np.ndarray, history: np.ndarray, hp: PleHashParams) -> np.ndarray:
    """(P1) c[t, s] for s < N: the token at p_t − s, or EOS from the first missing/EOS predecessor on.

    `history` holds the tokens immediately before tokens[0] in the same sequence (the last
    N−1 are used); fewer than N−1 means the sequence starts there.
    """
    N = hp.ngram_size
    hist = np.asarray(history, dtype=np.int64)[-(N - 1):] if N > 1 else np.zeros(0, np.int64)
    seq = np.concatenate([hist, np.asarray(tokens, dtype=np.int64)])
    T, h0 = len(seq) - len(hist), len(hist)
    c = np.full((T, N), hp.eos, dtype=np.int64)
    c[:, 0] = seq[h0:]
    alive = np.ones(T, dtype=bool)
    j = np.arange(h0, h0 + T)
    for s in range(1, N):
        idx = j - s
        ok = idx >= 0
        prev = np.where(ok, seq[np.maximum(idx, 0)], hp.eos)
        alive &= ok & (prev != hp.eos)
        c[:, s] = np.where(alive, prev, hp.eos)
    return c


def ple_rows(tokens: np.ndarray, history: np.ndarray, hp: PleHashParams) -> np.ndarray:
    """(P1)–(P3): int32 (T, n_p) PLE table rows, bigram heads first, for a ubatch of one sequence."""
    c = ngram_contexts(tokens, history, hp).astype(np.uint64)
    N, hg = hp.ngram_size, hp.heads_per_ngram
    m = np.asarray(hp.multipliers, dtype=np.uint64)[:N]
    terms = c * m[None, :]  # wraps mod 2⁶⁴
    mu = np.bitwise_xor.accumulate(terms, axis=1)  # mu[:, n−1] = μ_n
    P = np.asarray(hp.head_vocab_sizes, dtype=np.uint64)[: hp.n_heads]
    o = np.asarray(hp.head_offsets, dtype=np.uint64)[: hp.n_heads]
    mu_h = np.repeat(mu[:, 1:N], hg, axis=1)  # head h = (n−2)·h_g + g
    rows = mu_h % P[None, :] + o[None, :]
    return rows.astype(np.int32)


def ple_row_one(token: int, history: np.ndarray, hp: PleHashParams) -> list[int]:
    """ple_rows of one token as Python ints (a decode step's n_p rows without NumPy's per-call cost;
    the same uint64 arithmetic, so the same rows)."""
    N, hg = hp.ngram_size, hp.heads_per_ngram
    hist = [int(t) for t in history[len(history) - min(len(history), N - 1):]] if N > 1 else []
    ctx, alive = [int(token)], True
    for s in range(1, N):  # (P1): the token s back, or EOS from the first missing/EOS predecessor on
        prev = hist[-s] if s <= len(hist) else hp.eos
        alive = alive and s <= len(hist) and prev != hp.eos
        ctx.append(prev if alive else hp.eos)
    c = _CONSTANTS.get(id(hp))
    if c is None or c[0] is not hp:
        c = _CONSTANTS[id(hp)] = (hp, [int(v) for v in hp.multipliers[:N]],
                                  [int(v) for v in hp.head_vocab_sizes[:hp.n_heads]],
                                  [int(v) for v in hp.head_offsets[:hp.n_heads]])
    _, m, P, o = c
    mu, rows = 0, []
    for n in range(N):
        mu ^= (ctx[n] * m[n]) & MASK64
        if n >= 1:
            for h in range((n - 1) * hg, n * hg):
                rows.append(mu % P[h] + o[h])
    return rows


_CONSTANTS: dict[int, tuple[PleHashParams, list[int], list[int], list[int]]] = {}
"""ple_row_one's constants as Python ints, per PleHashParams (kept alive with it, checked by identity)."""


def next_history(history: np.ndarray, tokens: np.ndarray, hp: PleHashParams) -> np.ndarray:
    """The PLE token history after accepting `tokens`: the last N−1 tokens of the sequence."""
    keep = hp.ngram_size - 1
    seq = np.concatenate([np.asarray(history, np.int64), np.asarray(tokens, np.int64)])
    return seq[len(seq) - min(keep, len(seq)):]
