"""Speculative decoding by prompt lookup: the proposer, and exactness through the engine.

Expected outputs are the same engine's with speculation off: greedy and seeded sampling
(with penalties, logit bias, top-k / top-p and logprobs) must give the same tokens, since
every verified position is sampled exactly as a decode step would sample it.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.sequence import SamplingParams
from jaxserve.engine.speculative import accepted_lengths, propose

SMALL = dict(max_num_seqs=32, decode_batch_buckets=(1, 4, 8, 32), context_buckets=(256,), max_model_len=256,
             prefill_length_buckets=(32, 128), prefill_batch_buckets=(1, 4))
WORDS = "red green blue cyan amber slate ivory coral olive plum".split()
ALONE = 12  # of the 32 batched prompts, how many also run alone (one at a time is the slow part)


def test_propose_takes_what_followed_the_latest_longest_match():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    assert propose(toks, 3, 2, 3) == [5, 6, 7]  # the latest "1 2 3" is followed by 5 6 7
    # past the end of the text the match goes on as it did: "5 6 7 1 2 3" then again "5 6 7 1"
    assert propose(toks, 10, 2, 3) == [5, 6, 7, 1, 2, 3, 5, 6, 7, 1]
    assert propose([1, 2, 3, 4, 8, 3, 4], 2, 1, 4) == [8, 3]  # "3 4" matched, n = 2
    assert propose([1, 2, 3, 4, 8, 3, 4], 5, 1, 4) == [8, 3, 4, 8, 3]  # a loop of period 3
    assert propose([5, 6, 7], 3, 2, 3) == []  # no earlier occurrence
    assert propose([1, 1, 1, 1], 3, 2, 2) == [1, 1, 1]  # overlapping matches; the latest with a follower
    assert propose([7, 8, 9, 7, 8], 4, 2, 2) == [9, 7, 8, 9]
    assert propose([1, 2], 0, 1, 2) == []


def test_accepted_lengths_keep_the_samples_up_to_the_first_disagreement():
    sampled = np.array([[5, 6, 7, 8], [5, 9, 7, 8], [4, 6, 7, 8], [5, 6, 7, 8]])
    drafts = np.array([[5, 6, 7], [5, 6, 7], [5, 6, 7], [5, 6, 0]])
    num = np.array([3, 3, 3, 2])
    # all three kept (+ the bonus); first kept, second differs; none kept; two of two kept
    assert accepted_lengths(sampled, drafts, num).tolist() == [4, 2, 1, 3]


def test_speculation_config_is_checked():
    from jaxserve.config import ConfigError

    with pytest.raises(ConfigError, match="method"):
        EngineConfig(speculative={"method": "medusa"})
    with pytest.raises(ConfigError, match="ngram_min"):
        EngineConfig(speculative={"method": "ngram", "ngram_min": 3, "ngram_max": 2})
    assert EngineConfig(speculative={"method": "ngram"}).speculative.num_speculative_tokens == 8


def test_speculation_flags_reach_the_engine_config(tiny_model_dir, tmp_path):
    from jaxserve.cli import build_parser, serve_configs
    from jaxserve.config import ConfigError

    serve = ["serve", "--model", str(tiny_model_dir), "--speculative-method", "draft"]
    args = build_parser().parse_args(serve + [
        "--draft-model", str(tiny_model_dir), "--num-speculative-tokens", "5", "--ngram-min", "1", "--ngram-max", "3",
        "--speculative-disable-above-batch-size", "2"])
    spec = serve_configs(args)[1].speculative
    assert (spec.method, spec.draft_model, spec.num_speculative_tokens, spec.ngram_min, spec.ngram_max,
            spec.disable_above_batch_size) == ("draft", str(tiny_model_dir), 5, 1, 3, 2)
    with pytest.raises(ConfigError, match="needs draft_model"):
        serve_configs(build_parser().parse_args(serve))
    with pytest.raises(ConfigError, match="not a converted model directory"):
        serve_configs(build_parser().parse_args(serve + ["--draft-model", str(tmp_path)]))


@pytest.fixture(scope="module")
def engines(default_model_dir):
    """The default model, which copies text it is asked to repeat: drafts get accepted, so the
    verify path really decides tokens (a random model accepts almost none)."""
    plain = Engine(default_model_dir, EngineConfig(**SMALL))
    spec = Engine(default_model_dir, EngineConfig(**SMALL, speculative={
        "method": "ngram", "num_speculative_tokens": 4, "ngram_min": 1, "ngram_max": 3,
        "disable_above_batch_size": 32}))
    return plain, spec


def repetitive_prompts(tok, n: int, seed: int = 0) -> list[list[int]]:
    """Requests to repeat a list of words, as input-grounded work repeats its prompt."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        phrase = ", ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10)))
        out.append(tok.encode_chat([{"role": "user", "content": f"Repeat this list three times: {phrase}"}]))
    return out


def generate(engine: Engine, prompts, params) -> list:
    seqs = [engine.add_request(p, params[i] if isinstance(params, list) else params) for i, p in enumerate(prompts)]
    engine.run_until_done()
    assert engine.pool.num_used == 0
    return seqs


def test_greedy_is_token_identical_for_32_prompts_batched_and_12_alone(engines):
    plain, spec = engines
    prompts = repetitive_prompts(plain.tokenizer, 32)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    compiled = spec.runner.num_compiled
    before = spec.spec_counts
    expected = [s.output_ids for s in generate(plain, prompts, params)]
    batched = [s.output_ids for s in generate(spec, prompts, params)]
    alone = [generate(spec, [p], params)[0].output_ids for p in prompts[:ALONE]]
    assert batched == expected
    assert alone == expected[:ALONE]
    drafts, draft_tokens, accepted = (a - b for a, b in zip(spec.spec_counts, before))
    assert drafts > 100 and accepted > draft_tokens / 4  # it did speculate, and it paid
    assert spec.runner.num_compiled == compiled  # every verify shape was compiled at warm-up


def test_seeded_sampling_with_every_option_is_token_identical(engines):
    plain, spec = engines
    prompts = repetitive_prompts(plain.tokenizer, 6, seed=1)
    # Penalties on two rows only: they discourage the copying that gets drafts accepted. Rows 3
    # and 5 end at a comma (a stop token id) or " blue" (a stop string), but not in their first
    # 10 tokens (min_tokens).
    comma = plain.tokenizer.encode(",", add_special_tokens=False)[0]
    params = [SamplingParams(max_tokens=32, temperature=[0.5, 0.8][i % 2], top_k=[0, 50][i % 2],
                             min_tokens=10 if i in (3, 5) else 0, stop_token_ids=(comma,) if i == 3 else (),
                             top_p=[1.0, 0.9][i % 3 == 0], seed=100 + i,
                             repetition_penalty=1.3 if i == 1 else 1.0, presence_penalty=0.5 if i == 4 else 0.0,
                             frequency_penalty=0.2 if i == 1 else 0.0, logit_bias=((5, 2.0),) if i % 4 == 0 else (),
                             logprobs=2 if i % 3 == 0 else None, stop=(" blue",) if i == 5 else (),
                             ignore_eos=True) for i in range(len(prompts))]
    before = spec.spec_counts
    expected = generate(plain, prompts, params)
    got = generate(spec, prompts, params)
    for e, g in zip(expected, got):
        assert g.output_ids == e.output_ids and g.output_text == e.output_text and g.finish_reason == e.finish_reason
    accepted = spec.spec_counts[2] - before[2]
    assert accepted >= 20, accepted  # drafts accepted while sampling (30 here): the verify path chose tokens


def test_logprobs_under_speculation_match(engines):
    plain, spec = engines
    prompt = repetitive_prompts(plain.tokenizer, 1, seed=3)[0]
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=3, ignore_eos=True)
    lp = {}
    for name, eng in (("plain", plain), ("spec", spec)):
        eng.add_request(prompt, params, request_id=f"lp-{name}")
        lp[name] = [r for ev in eng.run_until_done() if ev.logprobs for r in ev.logprobs]
    assert [r["token_id"] for r in lp["spec"]] == [r["token_id"] for r in lp["plain"]]
    np.testing.assert_allclose([r["logprob"] for r in lp["spec"]], [r["logprob"] for r in lp["plain"]], atol=1e-4)


def test_a_request_can_opt_out_and_max_tokens_is_kept(engines):
    _, spec = engines
    prompt = repetitive_prompts(spec.tokenizer, 1, seed=4)[0]
    before = spec.spec_counts
    seq = generate(spec, [prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True,
                                                  speculative=False))[0]
    assert spec.spec_counts == before and len(seq.output_ids) == 20
    for n in (1, 2, 3, 7):  # drafts never run past max_tokens
        assert len(generate(spec, [prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0]
                   .output_ids) == n


# Draft-model speculation ------------------------------------------------------------------

TINY = dict(max_num_seqs=32, decode_batch_buckets=(1, 32), context_buckets=(128,), max_model_len=128,
            prefill_length_buckets=(64,), prefill_batch_buckets=(4,))


def draft_config(draft_dir, k: int = 4, **extra) -> EngineConfig:
    return EngineConfig(**{**TINY, **extra}, speculative={
        "method": "draft", "draft_model": str(draft_dir), "num_speculative_tokens": k,
        "disable_above_batch_size": 32})


@pytest.fixture(scope="module")
def tiny_engines(tmp_path_factory, tiny_model_dir, default_model_dir):
    """tiny_model_dir without speculation, drafting for itself (every draft accepted), and with
    a second random tiny model (same tokenizer) as its draft (almost every draft rejected)."""
    from fakes import make_tiny_model

    other = make_tiny_model(tmp_path_factory.mktemp("draft") / "tiny-1", default_model_dir, seed=1)
    return (Engine(tiny_model_dir, EngineConfig(**TINY)), Engine(tiny_model_dir, draft_config(tiny_model_dir)),
            Engine(tiny_model_dir, draft_config(other)))


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def test_draft_model_greedy_is_token_identical_for_32_prompts_batched_and_12_alone(tiny_engines):
    plain, *specs = tiny_engines
    prompts = random_prompts(32)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [s.output_ids for s in generate(plain, prompts, params)]
    for spec, same in zip(specs, (True, False)):
        compiled = (spec.runner.num_compiled, spec.draft.num_compiled)
        before = spec.spec_counts
        batched = [s.output_ids for s in generate(spec, prompts, params)]
        alone = [generate(spec, [p], params)[0].output_ids for p in prompts[:ALONE]]
        assert batched == expected and alone == expected[:ALONE]
        rows, drafted, accepted = (a - b for a, b in zip(spec.spec_counts, before))
        assert rows > 200
        assert accepted == drafted if same else accepted < drafted / 10
        assert (spec.runner.num_compiled, spec.draft.num_compiled) == compiled  # all compiled at warm-up


def test_a_draft_model_needs_the_targets_vocabulary(tmp_path, tiny_model_dir, default_model_dir):
    from fakes import make_tiny_model

    small = make_tiny_model(tmp_path / "v8", default_model_dir, vocab_size=8)
    with pytest.raises(ValueError, match="vocabulary has 8 tokens"):
        Engine(tiny_model_dir, draft_config(small), warmup=False)
    with pytest.raises(ValueError, match="not a model directory"):
        Engine(tiny_model_dir, draft_config(tmp_path / "nowhere"), warmup=False)


def test_draft_model_under_preemption_by_swap_and_recompute_is_token_identical(tiny_engines, tiny_model_dir):
    """A pool too small for the batch: sequences are preempted (by swap when they have computed
    48 tokens, else by recompute) and resumed while drafting; the draft's cache of them is
    rebuilt and the output does not change."""
    plain = tiny_engines[0]
    prompts = random_prompts(8, seed=5)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    expected = [s.output_ids for s in generate(plain, prompts, params)]
    spec = Engine(tiny_model_dir, draft_config(tiny_model_dir, num_pages=14, page_size=16, preemption_mode="auto",
                                               swap_space_gib=0.01, swap_min_tokens=48), warmup=False)
    assert [s.output_ids for s in generate(spec, prompts, params)] == expected
    assert spec.scheduler.preemptions["swap"] > 0 and spec.scheduler.preemptions["recompute"] > 0
    assert spec.spec_counts[2] > 100


# The sampling law, on an 8-token vocabulary ----------------------------------------------------

V8_PROMPT = [3, 4, 5, 3, 4, 5, 3, 4]  # repeats itself, so n-gram lookup proposes


@pytest.fixture(scope="module")
def v8_models(tmp_path_factory, default_model_dir):
    """Two random tiny models over an 8-token vocabulary: a target and a draft that disagrees with it."""
    from fakes import make_tiny_model

    root = tmp_path_factory.mktemp("v8")
    return [make_tiny_model(root / f"v8-{s}", default_model_dir, seed=s, vocab_size=8) for s in (0, 1)]


def pair_distribution(engine: Engine) -> np.ndarray:
    """P(t2, t3) [8, 8] of the engine's model after V8_PROMPT at temperature 1:
    sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2), from full-vocabulary logprobs."""
    def dists(suffixes):
        params = SamplingParams(max_tokens=1, temperature=0, logprobs=8)
        ids = [engine.add_request(V8_PROMPT + list(x), params).request_id for x in suffixes]
        top = {ev.request_id: ev.logprobs[0]["top"] for ev in engine.run_until_done() if ev.logprobs}
        out = np.zeros((len(ids), 8))
        for i, rid in enumerate(ids):
            for t, lp in top[rid]:
                out[i, t] = np.exp(lp)
        return out

    p1 = dists([()])[0]
    p2 = dists([(a,) for a in range(8)])
    p3 = dists([(a, b) for a in range(8) for b in range(8)]).reshape(8, 8, 8)
    return np.einsum("a,ab,abc->bc", p1, p2, p3)


def sampled_pairs(engine: Engine, n: int) -> np.ndarray:
    """Counts [8, 8] of (t2, t3) over n seeded requests (4 tokens each, temperature 1)."""
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=i, ignore_eos=True) for i in range(n)]
    counts = np.zeros((8, 8), np.int64)
    for s in generate(engine, [V8_PROMPT] * n, params):
        counts[s.output_ids[1], s.output_ids[2]] += 1
    return counts


def tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


def chi2_pvalue(counts: np.ndarray, p: np.ndarray) -> float:
    from scipy.stats import chisquare

    keep = p.ravel() > 0
    f = counts.ravel()[keep]
    return float(chisquare(f, p.ravel()[keep] / p.ravel()[keep].sum() * f.sum()).pvalue)


def test_speculative_sampling_draws_from_the_target_distribution(v8_models):
    """Seeded requests sampled through each proposer: the empirical law of the two tokens after
    the first (both decided by verify steps) matches the target's exact law as well as plain
    sampling does at the same sample size, and its distance shrinks as samples grow; the
    draft's own law is far from it, so a verifier that kept drafts unjudged would fail."""
    target, draft = v8_models
    cfg = dict(TINY, max_model_len=32, context_buckets=(32,), prefill_length_buckets=(16,))
    plain = Engine(target, EngineConfig(**cfg), warmup=False)
    exact = pair_distribution(plain)
    exact_q = pair_distribution(Engine(draft, EngineConfig(**cfg), warmup=False))
    assert 0.5 * np.abs(exact - exact_q).sum() > 0.2  # the proposers' own law is far from the target's
    spec = {"ngram": Engine(target, EngineConfig(**cfg, speculative={
                "method": "ngram", "num_speculative_tokens": 2, "ngram_min": 1, "ngram_max": 2,
                "disable_above_batch_size": 32}), warmup=False),
            "draft": Engine(target, EngineConfig(**cfg, speculative={
                "method": "draft", "draft_model": str(draft), "num_speculative_tokens": 2,
                "disable_above_batch_size": 32}), warmup=False)}
    small, large = 500, 2000  # simulated: each comparison below fails by chance well under 0.1 % of the time
    base = {n: sampled_pairs(plain, n) for n in (small, large)}
    for name, eng in spec.items():
        before = eng.spec_counts
        got = {n: sampled_pairs(eng, n) for n in (small, large)}
        rows, drafted, accepted = (a - b for a, b in zip(eng.spec_counts, before))
        assert rows >= large and 0.1 * drafted < accepted < drafted, (name, rows, drafted, accepted)
        assert tv(got[large], exact) < tv(got[small], exact)
        for n in (small, large):  # as close as plain sampling (plus noise of a second sample)
            assert tv(got[n], exact) < 1.5 * tv(base[n], exact) + 0.02, (name, n)
        assert chi2_pvalue(got[large], exact) > 1e-3, name
        assert chi2_pvalue(got[large], exact_q) < 1e-9, name
    assert chi2_pvalue(base[large], exact) > 1e-3
