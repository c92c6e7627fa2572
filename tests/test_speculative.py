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

SMALL = dict(max_num_seqs=32, decode_batch_buckets=(1, 4, 32), context_buckets=(256,), max_model_len=256,
             prefill_length_buckets=(32, 128), prefill_batch_buckets=(1, 4), compilation_cache_dir=None)
WORDS = "red green blue cyan amber slate ivory coral olive plum".split()


def test_propose_takes_what_followed_the_latest_longest_match():
    toks = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    assert propose(toks, 3, 2, 3) == [5, 6, 7]  # the latest "1 2 3" is followed by 5 6 7
    assert propose(toks, 10, 2, 3) == [5, 6, 7, 1, 2, 3]  # up to the end, never past it
    assert propose([1, 2, 3, 4, 8, 3, 4], 2, 1, 4) == [8, 3]  # "3 4" matched, n = 2
    assert propose([5, 6, 7], 3, 2, 3) == []  # no earlier occurrence
    assert propose([1, 1, 1, 1], 2, 2, 2) == [1]  # overlapping matches; the latest with a follower
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


def test_greedy_is_token_identical_alone_and_batched(engines):
    plain, spec = engines
    prompts = repetitive_prompts(plain.tokenizer, 16)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    compiled = spec.runner.num_compiled
    before = spec.spec_counts
    expected = [s.output_ids for s in generate(plain, prompts, params)]
    batched = [s.output_ids for s in generate(spec, prompts, params)]
    alone = [generate(spec, [p], params)[0].output_ids for p in prompts[:4]]
    assert batched == expected
    assert alone == expected[:4]
    drafts, draft_tokens, accepted = (a - b for a, b in zip(spec.spec_counts, before))
    assert drafts > 100 and accepted > draft_tokens / 4  # it did speculate, and it paid
    assert spec.runner.num_compiled == compiled  # every verify shape was compiled at warm-up


def test_seeded_sampling_with_every_option_is_token_identical(engines):
    plain, spec = engines
    prompts = repetitive_prompts(plain.tokenizer, 6, seed=1)
    # Penalties on two rows only: they discourage the copying that gets drafts accepted.
    params = [SamplingParams(max_tokens=32, temperature=[0.5, 0.8][i % 2], top_k=[0, 50][i % 2],
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
