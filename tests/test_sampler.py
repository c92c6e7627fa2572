"""On-device sampler on small hand-made logits, where the right answer can be worked out."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.engine.sampler import SamplingArrays, apply_logit_bias, apply_penalties, sample


def arrays(B, V, H=4, **over):
    base = dict(temperature=np.zeros(B, np.float32), top_k=np.zeros(B, np.int32), top_p=np.ones(B, np.float32),
                min_p=np.zeros(B, np.float32), presence_penalty=np.zeros(B, np.float32),
                frequency_penalty=np.zeros(B, np.float32), repetition_penalty=np.ones(B, np.float32),
                seeds=np.arange(B, dtype=np.uint32), counters=np.zeros(B, np.int32),
                history=np.full((B, H), -1, np.int32), prompt_lens=np.zeros(B, np.int32),
                logprobs=np.ones(B, np.bool_), bias_ids=np.full((B, 3), -1, np.int32),
                bias_values=np.zeros((B, 3), np.float32))
    for k, v in over.items():
        base[k] = np.asarray(v, dtype=base[k].dtype)
    return SamplingArrays(**base)


def test_greedy_picks_argmax_and_reports_raw_logprobs():
    logits = jnp.array([[0.0, 2.0, 1.0, -1.0]])
    out = sample(logits, arrays(1, 4))
    assert int(out.tokens[0]) == 1
    expected = 2.0 - np.log(np.exp([0.0, 2.0, 1.0, -1.0]).sum())
    np.testing.assert_allclose(float(out.logprobs[0]), expected, rtol=1e-6)
    assert list(np.asarray(out.top_ids[0, :4])) == [1, 2, 0, 3]


def test_penalties_by_hand():
    """Token 1 appears in the prompt once; token 2 twice in the output; token 0 never.

    repetition 2: seen positive logits are halved, negative ones doubled -> [1, 1, -2, 3]
    then frequency 0.5 * count(output) and presence 1 * (count > 0): token 2 -> -2 - 1 - 1 = -4.
    """
    logits = jnp.array([[1.0, 2.0, -1.0, 3.0]])
    s = arrays(1, 4, H=4, history=[[1, 2, 2, -1]], prompt_lens=[1], repetition_penalty=[2.0],
               frequency_penalty=[0.5], presence_penalty=[1.0])
    np.testing.assert_allclose(np.asarray(apply_penalties(logits, s))[0], [1.0, 1.0, -4.0, 3.0])


def test_top_k_one_and_tiny_top_p_are_greedy():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 50)).astype(np.float32))
    greedy = np.asarray(jnp.argmax(logits, -1))
    for over in (dict(top_k=[1] * 6), dict(top_p=[1e-6] * 6), dict(min_p=[1.0] * 6)):
        out = sample(logits, arrays(6, 50, temperature=[1.5] * 6, **over))
        np.testing.assert_array_equal(np.asarray(out.tokens), greedy)


def test_top_k_restricts_and_seed_reproduces():
    logits = jnp.tile(jnp.arange(10, dtype=jnp.float32)[None, :] * 0.1, (64, 1))  # nearly flat
    s = arrays(64, 10, temperature=np.ones(64), top_k=np.full(64, 3), seeds=np.arange(64))
    tokens = np.asarray(sample(logits, s).tokens)
    assert set(tokens) <= {7, 8, 9} and len(set(tokens)) == 3  # only the top 3, and more than one of them
    np.testing.assert_array_equal(np.asarray(sample(logits, s).tokens), tokens)  # same seeds, same draws


def test_row_result_does_not_depend_on_batch():
    """Row 0 with seed 5 draws the same token alone and beside 7 other rows."""
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(8, 100)).astype(np.float32)
    for counter in range(5):
        batch = sample(jnp.asarray(logits), arrays(8, 100, temperature=np.ones(8), seeds=[5] + [9] * 7,
                                                   counters=[counter] * 8))
        alone = sample(jnp.asarray(logits[:1]), arrays(1, 100, temperature=[1.0], seeds=[5], counters=[counter]))
        assert int(batch.tokens[0]) == int(alone.tokens[0])


def test_logit_bias_by_hand():
    """Logits [0, 2, 1, -1]. Row 0: bias -100 on token 1 -> [0, -98, 1, -1], greedy 2. Row 1:
    +100 on token 3 and +0.5 on token 0 -> [0.5, 2, 1, 99], greedy 3. Row 2: no bias, greedy 1.
    Logprobs stay those of the raw logits."""
    logits = jnp.array([[0.0, 2.0, 1.0, -1.0]] * 3)
    s = arrays(3, 4, bias_ids=[[1, -1, -1], [3, 0, -1], [-1, -1, -1]],
               bias_values=[[-100, 0, 0], [100, 0.5, 0], [0, 0, 0]])
    np.testing.assert_allclose(np.asarray(apply_logit_bias(logits, s)),
                               [[0, -98, 1, -1], [0.5, 2, 1, 99], [0, 2, 1, -1]])
    out = sample(logits, s)
    assert list(np.asarray(out.tokens)) == [2, 3, 1]
    raw = np.log(np.exp([0.0, 2.0, 1.0, -1.0]) / np.exp([0.0, 2.0, 1.0, -1.0]).sum())
    np.testing.assert_allclose(np.asarray(out.logprobs), raw[[2, 3, 1]], rtol=1e-5)
    # the greedy-only fast path must not skip a biased row
    plain = sample(logits, arrays(3, 4, logprobs=np.zeros(3), bias_ids=s.bias_ids, bias_values=s.bias_values))
    assert list(np.asarray(plain.tokens)) == [2, 3, 1]


def test_w8a8_matmul_against_the_float_product():
    """W8A8 against x @ dequantized(w): the only extra error is the activations' rounding to
    int8 per row, at most half a step (absmax / 127 / 2) per element, so the error is bounded
    by sum_k |w_kn| * step_m / 2, at every row count (below W8A8_MIN_ROWS rows the same
    integers are multiplied in float32)."""
    import numpy as np
    import pytest

    from jaxserve.layers.linear import W8A8_MIN_ROWS, linear, quantize_rows
    from pallas_kernels.quantized_matmul.ref import quantize_int8

    rng = np.random.default_rng(0)
    w = rng.standard_normal((96, 40)).astype(np.float32)
    q, s = quantize_int8(w)
    wd = np.asarray(q, np.float32) * np.asarray(s)
    for rows in (1, W8A8_MIN_ROWS - 1, W8A8_MIN_ROWS, 33):
        x = rng.standard_normal((rows, 96)).astype(np.float32) * 3
        got = np.asarray(linear(jnp.asarray(x), {"q8": q, "scale": s}, "w8a8"))
        want = x @ wd
        step = np.abs(x).max(axis=1, keepdims=True) / 127
        bound = (step / 2) @ np.abs(wd).sum(axis=0, keepdims=True) + 1e-4
        assert np.all(np.abs(got - want) <= bound)
        assert np.abs(got - want).max() > 1e-6, rows  # the activations really were rounded (it is not exact)
    xq, xs = quantize_rows(jnp.asarray([[0.0, 0.0], [-2.0, 1.0]]))
    assert xq.dtype == jnp.int8 and np.asarray(xq).tolist() == [[0, 0], [-127, 64]]
    assert np.asarray(xs)[:, 0].tolist() == pytest.approx([1.0, 2 / 127])


@pytest.mark.parametrize("K", [576, 1536])
def test_w8a8_gives_a_row_the_same_bits_at_every_row_count(K):
    """Batch invariance of W8A8: below W8A8_MIN_ROWS rows the int8 values are multiplied in
    float32, from W8A8_BF16_ROWS in bfloat16, over chunks of K whose sums float32 holds
    exactly, so a row's output is the int8 dot's, bit for bit, whatever number of rows shares
    the call (1536: two chunks). The same for the tied lm_head. And the worst case, every
    product 127 * 127 over 1041 terms (past 2**24, an odd integer float32 cannot hold), is
    still exact on both float paths."""
    import jax
    import numpy as np

    from jaxserve.layers.linear import (EXACT_F32_TERMS, W8A8_BF16_ROWS, W8A8_MIN_ROWS, _exact_int_dot, linear,
                                        tied_logits)
    from pallas_kernels.quantized_matmul.ref import quantize_int8

    rng = np.random.default_rng(K)
    q, s = quantize_int8(rng.standard_normal((K, 64)).astype(np.float32))
    tq, ts = quantize_int8(rng.standard_normal((K, 5000)).astype(np.float32))  # a [V, D] table, transposed
    mm = jax.jit(lambda x: linear(x, {"q8": q, "scale": s}, "w8a8"))
    head = jax.jit(lambda x: tied_logits(x, {"q8": tq.T, "scale": ts}, "w8a8"))
    x = jnp.asarray(rng.standard_normal((W8A8_BF16_ROWS + 5, K)).astype(np.float32) * 3)
    for f in (mm, head):
        many = np.asarray(f(x))  # the bfloat16 path (the head's: int8 x int8)
        for rows in (1, 2, W8A8_MIN_ROWS - 1, W8A8_MIN_ROWS, W8A8_BF16_ROWS - 1):
            assert np.array_equal(np.asarray(f(x[:rows])), many[:rows]), (f, rows)
    n = EXACT_F32_TERMS + 1
    assert n * 127 * 127 > 2**24 and (n * 127 * 127) % 2 == 1
    for via in (jnp.float32, jnp.bfloat16):
        got = _exact_int_dot(jnp.full((1, n), 127, jnp.int8), jnp.full((n, 3), 127, jnp.int8), via)
        assert got.dtype == jnp.int32 and np.asarray(got).tolist() == [[n * 127 * 127] * 3]


def _filtered_distribution(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                           min_p: float) -> np.ndarray:
    """What a row should be drawn from, worked out in float64 in HF's order: divide by the
    temperature; keep the top_k most likely; of those, the smallest set whose mass (before a
    token) is under top_p; of those, each token at least min_p times the likeliest; renormalise."""
    order = np.argsort(-logits, kind="stable")
    z = logits[order].astype(np.float64) / temperature

    def softmax(alive):
        e = np.where(alive, np.exp(z - z.max()), 0.0)
        return e / e.sum()

    alive = np.arange(len(z)) < (top_k if top_k > 0 else len(z))
    probs = softmax(alive)
    if top_p < 1:  # 1 is off (the mass before the last token may round to 1)
        alive &= np.cumsum(probs) - probs < top_p
    probs = softmax(alive)
    alive &= probs >= min_p * probs[0]
    out = np.zeros(len(z))
    out[order] = softmax(alive)
    return out


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (0.5, 0, 1.0, 0.0), (2.0, 5, 1.0, 0.0), (1.5, 0, 0.7, 0.0), (1.0, 0, 1.0, 0.3), (1.8, 10, 0.85, 0.12)])
def test_seeded_draws_follow_the_filtered_softmax(temperature, top_k, top_p, min_p):
    """20,000 rows with the same logits and seeds 0..19,999: the counts of each token pass a
    chi-square test against the distribution above (p > 1e-3), and no filtered-out token is
    ever drawn. A sampler that ignored the temperature, applied the filters in another order
    or before the temperature, or mapped ranks back to the wrong tokens fails here."""
    from scipy.stats import chisquare

    n, values = 20_000, np.array([2.0, 1.6, 1.3, 1.1, 0.8, 0.5, 0.3, 0.0, -0.2, -0.5, -0.9, -1.2, -1.6, -2.0, -2.5, -3.0])
    logits = np.random.default_rng(0).permutation(values).astype(np.float32)  # ranks in no token order
    V = len(logits)
    s = arrays(n, V, temperature=np.full(n, temperature), top_k=np.full(n, top_k), top_p=np.full(n, top_p),
               min_p=np.full(n, min_p), seeds=np.arange(n), logprobs=np.zeros(n))
    tokens = np.asarray(sample(jnp.tile(jnp.asarray(logits)[None], (n, 1)), s).tokens)
    counts = np.bincount(tokens, minlength=V)
    p = _filtered_distribution(logits, temperature, top_k, top_p, min_p)
    kept = p > 0
    assert counts[~kept].sum() == 0, counts
    assert kept.sum() >= 3  # the test has room to see a wrong shape
    result = chisquare(counts[kept], n * p[kept])
    assert result.pvalue > 1e-3, (result, counts, np.round(n * p))


def test_the_sort_free_filters_keep_what_the_sorted_reference_keeps():
    """The top-k / top-p / min-p cuts come from each row's 64 largest logits, or, when a row
    needs more, from radix selections over the logits' bits (sampler._filter_threshold): never
    a sort. On 64 rows of 1,000 random logits with mixed settings, each row keeps exactly the
    tokens the sorted float64 reference keeps, by either route alone and by the two together.
    A wrong bit order (negative logits), an off-by-one k, a top-p cut one token early or late,
    or a row called decided by the candidates when it is not fails here."""
    import jax

    from jaxserve.engine.sampler import _cuts_by_radix, _cuts_from_candidates, _filtered, _threshold

    rng = np.random.default_rng(3)
    B, V = 64, 1000
    logits = (rng.normal(size=(B, V)) * rng.uniform(0.5, 4, (B, 1))).astype(np.float32)
    temperature = rng.uniform(0.3, 2, B).astype(np.float32)
    top_k = rng.choice([0, 1, 7, 50, 64, 65, 999, 1000, 1200], B)
    top_p = rng.choice([1.0, 0.95, 0.6, 0.2, 1e-4], B).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.02, 0.3], B).astype(np.float32)
    s = arrays(B, V, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    expected = np.stack([_filtered_distribution(logits[b], temperature[b], top_k[b], top_p[b], min_p[b]) > 0
                         for b in range(B)])
    scaled = jnp.asarray(logits / temperature[:, None])

    def kept(k_cut, p_cut):
        return np.asarray(scaled >= _threshold(scaled, k_cut, p_cut, jnp.asarray(min_p))[:, None])

    radix = kept(*jax.jit(_cuts_by_radix)(scaled, s))
    *cuts, decided = jax.jit(_cuts_from_candidates)(scaled, s)
    candidates, decided = kept(*cuts), np.asarray(decided)
    both = np.isfinite(np.asarray(_filtered(jnp.asarray(logits), s)))
    assert 16 <= decided.sum() < B  # both routes are exercised
    for b in range(B):
        row = (b, top_k[b], top_p[b], min_p[b], expected[b].sum())
        assert (radix[b] == expected[b]).all(), ("radix", *row, radix[b].sum())
        assert not decided[b] or (candidates[b] == expected[b]).all(), ("candidates", *row, candidates[b].sum())
        assert (both[b] == expected[b]).all(), ("together", *row, both[b].sum())


def test_top_k_in_rounds_of_16_equals_one_top_k():
    """The logprobs' top 20 come from two top-k calls of at most 16 (sampler.top_k): the same
    values and ids as jax.lax.top_k(x, 20), ties broken towards the lower id."""
    import jax

    from jaxserve.engine.sampler import top_k

    x = np.round(np.random.default_rng(4).normal(size=(5, 300)) * 2).astype(np.float32)  # many ties
    for k in (3, 16, 17, 20):
        got, want = top_k(jnp.asarray(x), k), jax.lax.top_k(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))


def test_a_large_batch_samples_each_row_as_it_would_alone():
    """On a CPU a batch of more than 32 rows is sampled 16 rows at a time (sampler.in_row_chunks):
    with every option mixed over 64 rows, each row's token, top logprob ids and Gumbel noise (on
    the token stream and a draft's) are bit for bit what the row gets alone, its logprobs within
    rounding (rows that asked for them). A chunking that mixed
    up rows or chunks, or a stage that looked across rows, fails here."""
    from jaxserve.engine.sampler import ROW_CHUNK, gumbel_noise

    rng = np.random.default_rng(5)
    B, V = 4 * ROW_CHUNK, 300
    logits = (rng.normal(size=(B, V)) * 3).astype(np.float32)
    over = dict(temperature=rng.choice([0.0, 0.7, 1.3], B), top_k=rng.choice([0, 5, 100], B),
                top_p=rng.choice([1.0, 0.9], B), min_p=rng.choice([0.0, 0.1], B),
                repetition_penalty=rng.choice([1.0, 1.2], B), seeds=np.arange(B) * 7919, counters=np.arange(B) % 5,
                history=rng.integers(-1, V, (B, 4)), prompt_lens=np.full(B, 2), logprobs=np.arange(B) % 2 == 0)
    s = arrays(B, V, **over)
    batch = sample(jnp.asarray(logits), s)
    noise = [np.asarray(gumbel_noise(s, V, stream)) for stream in (0, 1)]
    for b in (0, ROW_CHUNK - 1, ROW_CHUNK, 2 * ROW_CHUNK + 3, B - 1):
        one = arrays(1, V, **{k: np.asarray(v)[b:b + 1] for k, v in over.items()})
        alone = sample(jnp.asarray(logits[b:b + 1]), one)
        assert int(batch.tokens[b]) == int(alone.tokens[0]), b
        if not over["logprobs"][b]:  # its logprob fields are whatever its chunk computed (zeros alone)
            continue
        assert np.array_equal(np.asarray(batch.top_ids)[b], np.asarray(alone.top_ids)[0]), b
        for field in ("logprobs", "top_logprobs"):  # a log-softmax over [1, V] and [16, V] may round apart
            np.testing.assert_allclose(np.asarray(getattr(batch, field))[b], np.asarray(getattr(alone, field))[0],
                                       rtol=0, atol=1e-6, err_msg=f"{b} {field}")
        for stream in (0, 1):
            assert np.array_equal(noise[stream][b], np.asarray(gumbel_noise(one, V, stream))[0]), (stream, b)


def test_min_tokens_bans_a_rows_stop_ids_until_it_has_made_them():
    """Row 0 has made 1 of its 2 min_tokens: its stop ids 1 and 3 are out, so greedy picks 2.
    Row 1 has made its 2: nothing is banned, it picks 1. The logprobs stay the raw model's."""
    logits = jnp.array([[0.0, 3.0, 2.0, 2.5], [0.0, 3.0, 2.0, 2.5]])
    s = arrays(2, 4, counters=[1, 2]).replace(min_tokens=np.array([2, 2], np.int32),
                                              stop_ids=np.array([[1, 3, -1], [1, 3, -1]], np.int32))
    out = sample(logits, s)
    assert list(np.asarray(out.tokens)) == [2, 1]
    raw = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(np.asarray(out.logprobs), [raw[0, 2], raw[1, 1]], rtol=1e-6)
    sampled = sample(logits, s.replace(temperature=np.ones(2, np.float32)))
    assert int(sampled.tokens[0]) in (0, 2)
