"""PLE hashing: published constants (MODEL.md §8, §9), an independent big-int oracle, decode = prefill."""

import numpy as np
import pytest

from vkflash.model import ple_hash as ph


def test_flash_next_published_constants():
    """§8: multipliers, the 16 primes from 2·10⁷ and cumulative offsets, 320,001,536 rows."""
    assert ph.build_layer_multipliers(248320, 3, 0, 1234) == [23703573157769, 20109073645365, 8052911324071]
    sizes = ph.head_vocab_sizes(20_000_000, 16)
    assert sizes[0] == 20000003 and sizes[-1] == 20000171 and len(set(sizes)) == 16
    assert all(ph.is_prime(p) for p in sizes)
    offs = ph.head_offsets(sizes)
    assert offs[:2] == [0, 20000003] and offs[2] == 40000026 and offs[-1] == 300001275
    assert offs[-1] + sizes[-1] == 320001446  # 320,001,536 rows after padding to 128
    assert -(-(offs[-1] + sizes[-1]) // 128) * 128 == 320001536


def test_tiny_published_constants():
    """§9 qwen4exp-tiny: V = 512 multipliers, sizes and offsets."""
    assert ph.build_layer_multipliers(512, 3, 0, 1234) == [4295158889763781, 17440218147737327, 1270917961434445]
    sizes = ph.head_vocab_sizes(1009, 4)
    assert sizes == [1009, 1013, 1019, 1021]
    assert ph.head_offsets(sizes) == [0, 1009, 2022, 3041]


def test_primes_against_sieve():
    """is_prime and find_nth_prime_after agree with a sieve on a random window."""
    rng = np.random.default_rng()
    lo = int(rng.integers(0, 10**6))
    n = 5000
    sieve = np.ones(lo + n, dtype=bool)
    sieve[:2] = False
    for i in range(2, int((lo + n) ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i::i] = False
    primes = [p for p in range(lo, lo + n) if sieve[p]]
    assert [p for p in range(lo, lo + n) if ph.is_prime(p)] == primes
    assert ph.find_nth_prime_after(lo - 1, 3) == primes[2]


def _oracle_rows(seq: list[int], hp: ph.PleHashParams) -> np.ndarray:
    """HF formulation with Python ints: shift right by s never crossing an earlier EOS,
    with an initial history of N−1 EOS, then XOR-hash mod 2⁶⁴."""
    N, eos = hp.ngram_size, hp.eos
    m = [int(x) for x in hp.multipliers[:N]]
    out = []
    for t in range(len(seq)):
        last_eos = max([i for i in range(t) if seq[i] == eos], default=-1)
        ctx = [seq[t]] + [seq[t - s] if t - s > last_eos else eos for s in range(1, N)]
        row = []
        for n in range(2, N + 1):
            mu = 0
            for i in range(n):
                mu ^= (ctx[i] * m[i]) & ph.MASK64
            for g in range(hp.heads_per_ngram):
                h = (n - 2) * hp.heads_per_ngram + g
                row.append(mu % int(hp.head_vocab_sizes[h]) + int(hp.head_offsets[h]))
        out.append(row)
    return np.array(out, dtype=np.int64)


@pytest.mark.parametrize("N,hg,V", [(3, 2, 512), (3, 8, 248320), (2, 3, 1000), (5, 1, 70000)])
def test_rows_match_oracle_and_decode_equals_prefill(N, hg, V):
    """Rows equal the HF-style oracle, EOS cuts (incl. EOS at 0, 1 and twice in a row),
    and any chunking with a carried history gives the same rows."""
    rng = np.random.default_rng()
    eos = int(rng.integers(0, V))
    hp = ph.make_params(V, N, hg, eos, vocab_base=int(rng.integers(1000, 5000)))
    T = int(rng.integers(40, 90))
    seq = rng.integers(0, V, T)
    seq[rng.random(T) < 0.15] = eos
    seq[0] = eos if rng.random() < 0.5 else seq[0]
    seq[5:7] = eos
    want = _oracle_rows([int(x) for x in seq], hp)
    got = ph.ple_rows(seq, np.zeros(0, np.int64), hp)
    assert got.dtype == np.int32 and got.shape == (T, hp.n_heads)
    np.testing.assert_array_equal(got, want)
    lo = hp.head_offsets[: hp.n_heads].astype(np.int64)
    assert np.all(got >= lo) and np.all(got < lo + hp.head_vocab_sizes[: hp.n_heads].astype(np.int64))
    # chunked: ragged chunks incl. size 1 (decode) with the history carried along
    hist, parts, i = np.zeros(0, np.int64), [], 0
    while i < T:
        n = int(rng.choice([1, 1, 2, 5, 13]))
        parts.append(ph.ple_rows(seq[i:i + n], hist, hp))
        hist = ph.next_history(hist, seq[i:i + n], hp)
        assert len(hist) == min(N - 1, i + len(seq[i:i + n]))
        i += n
    np.testing.assert_array_equal(np.concatenate(parts), want)
    # token by token through the decode path's Python-int hash (ple_row_one)
    hist, one = np.zeros(0, np.int64), []
    for t in seq:
        one.append(ph.ple_row_one(int(t), hist, hp))
        hist = ph.next_history(hist, np.array([t]), hp)
    np.testing.assert_array_equal(np.array(one, np.int64), want)


def test_eos_current_token_does_not_cut_itself():
    """A token after EOS sees EOS as c_1; the EOS token itself keeps its real predecessor."""
    hp = ph.make_params(512, 3, 2, eos=2, vocab_base=1009)
    c = ph.ngram_contexts(np.array([7, 9, 2, 11, 13]), np.zeros(0, np.int64), hp)
    assert c.tolist() == [[7, 2, 2], [9, 7, 2], [2, 9, 7], [11, 2, 2], [13, 11, 2]]
