"""Prompt logprobs (completions' `echo` with `logprobs`, how evaluation harnesses score text):
the engine's record for prompt token t is the reference forward's log-softmax at position
t - 1, however the prompt was prefilled (in chunks, beside other prompts, after a prefix
another request cached, or again after a preemption by recompute)."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from jaxserve import reference
from jaxserve.engine.engine import LLM
from jaxserve.engine.sequence import SamplingParams

OPTS = dict(max_num_seqs=4, decode_batch_buckets=(1, 4), context_buckets=(256,), max_model_len=256,
            prefill_length_buckets=(32, 128), prefill_batch_buckets=(1, 4), enable_prefix_caching=True,
            prefill_token_budget=128)


def expected(params, cfg, ids: list[int], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The reference's (logprob of each next prompt token [L - 1], its k best ids [L - 1, k],
    the next token's rank in the vocabulary [L - 1])."""
    logp = np.asarray(jax.nn.log_softmax(reference.paged_logits(params, cfg, ids), -1))[:-1]
    chosen = logp[np.arange(len(ids) - 1), ids[1:]]
    return chosen, np.argsort(-logp, axis=-1, kind="stable")[:, :k], 1 + (logp > chosen[:, None]).sum(-1)


def records(completion) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray]:
    r = completion.prompt_logprobs
    return (np.array([x["logprob"] for x in r]), np.array([[t for t, _ in x["top"]] for x in r]),
            [x["token_id"] for x in r], np.array([x["rank"] for x in r]))


def test_prompt_logprobs_equal_the_reference_forward(default_model_dir, default_model):
    cfg, params, tok = default_model
    llm = LLM(default_model_dir, warmup=False, **OPTS)
    prompts = [tok.encode("The capital of France is Paris."),
               tok.encode("A list of rivers: " + ", ".join(["Nile", "Amazon", "Danube", "Rhine", "Volga"] * 12))]
    assert len(prompts[1]) > 128  # prefilled in two chunks under the 128-token budget
    scored = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=3)
    plain = SamplingParams(max_tokens=4, temperature=0)
    outs = llm.generate(prompts + prompts, [scored, scored, plain, plain])  # scored beside plain rows
    for ids, out in zip(prompts, outs[:2]):
        lp, top, targets, rank = records(out)
        want_lp, want_top, want_rank = expected(params, cfg, ids, 3)
        assert targets == ids[1:]
        np.testing.assert_allclose(lp, want_lp, atol=1e-4)
        assert (top == want_top).mean() > 0.99  # near-ties may swap ranks past the first decimals
        assert (top[:, 0] == want_top[:, 0]).all()
        assert (rank == want_rank).mean() > 0.95 and (np.abs(rank - want_rank) <= 0.01 * want_rank + 2).all()
        assert rank.max() > 20 and (rank[top[:, 0] == np.array(targets)] == 1).all()  # ranks past the alternatives
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in outs[2:]]  # scoring does not change a sample
    assert outs[2].prompt_logprobs is None

    # Again, now that the prompts' pages are cached: a scored request takes the records kept
    # for its full pages with the pages (asking for fewer alternatives: the best of them).
    fewer = SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1)
    again = [llm.engine.add_request(p, sp) for p, sp in zip(prompts + prompts, [scored, fewer, plain, plain])]
    llm.engine.run_until_done()
    assert again[0].cached_tokens == 0 and again[1].cached_tokens >= 128  # (the short prompt fills no page)
    assert again[3].cached_tokens >= 128
    np.testing.assert_allclose(records(again[0])[0], records(outs[0])[0], atol=1e-4)  # computed again
    assert again[1].prompt_logprobs[:128] == [{**r, "top": r["top"][:1]} for r in outs[1].prompt_logprobs[:128]]


def test_scored_contexts_are_computed_once_and_each_answer_scored(tiny_model_dir):
    """Four answers after one 60-token context, sent together as an evaluation scores a
    question: the first request computes the context, the others wait a step and take its
    pages and records; every record equals that of an engine without a prefix cache. Asking
    for more alternatives than were kept computes them."""
    rng = random.Random(4)
    context = [rng.randrange(3, 49152) for _ in range(60)]
    prompts = [context + [rng.randrange(3, 49152) for _ in range(rng.randint(3, 6))] for _ in range(4)]
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
    opts = {**OPTS, "prefill_token_budget": 512}  # all four fit in one step: the others must wait
    fresh = LLM(tiny_model_dir, warmup=False, **{**opts, "enable_prefix_caching": False}).generate(prompts, sp)
    llm = LLM(tiny_model_dir, warmup=False, **opts)
    first, *rest = [llm.engine.add_request(p, sp) for p in prompts]
    llm.engine.run_until_done()
    assert first.cached_tokens == 0
    full_pages = (len(context) - 1) // 16  # pages whose every record scores a context token
    assert all(s.cached_tokens == full_pages * 16 for s in rest)
    for out, s in zip(fresh, [first, *rest]):
        np.testing.assert_allclose(records(s)[0], records(out)[0], atol=1e-4)
        assert records(s)[2] == s.prompt_ids[1:]
    more = llm.engine.add_request(prompts[1], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=5))
    llm.engine.run_until_done()
    assert more.cached_tokens == 0 and len(more.prompt_logprobs[0]["top"]) == 5


def test_prompt_logprobs_survive_preemption_by_recompute(tiny_model_dir):
    """12 pages cannot hold six prompts of 40-70 tokens with 20 more each: sequences are
    preempted and recomputed, and each one's prompt logprobs are recorded once, equal to
    those from an ample pool, with the same outputs."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(40, 70))] for _ in range(6)]
    opts = dict(max_num_seqs=6, decode_batch_buckets=(1, 8), context_buckets=(128,), max_model_len=128,
                prefill_length_buckets=(32,), prefill_batch_buckets=(1, 4))
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=2)
    ample = LLM(tiny_model_dir, warmup=False, **opts).generate(prompts, params)
    tight = LLM(tiny_model_dir, warmup=False, num_pages=12, preemption_mode="recompute", **opts)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    for p, a, o in zip(prompts, ample, outs):
        assert o.token_ids == a.token_ids
        assert len(o.prompt_logprobs) == len(p) - 1
        lp, top, targets, rank = records(o)
        want_lp, want_top, _, want_rank = records(a)
        assert targets == p[1:]
        np.testing.assert_allclose(lp, want_lp, atol=1e-5)
        assert (top == want_top).all() and (rank == want_rank).all()


def test_a_one_token_prompt_has_no_prompt_logprobs(tiny_model_dir):
    out = LLM(tiny_model_dir, warmup=False, max_num_seqs=1, decode_batch_buckets=(1,), context_buckets=(64,),
              max_model_len=64, prefill_length_buckets=(16,), prefill_batch_buckets=(1,)).generate(
        [[7]], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1))
    assert out[0].prompt_logprobs == [] and len(out[0].token_ids) == 2


def test_prompt_logprobs_are_bounded_like_logprobs():
    from jaxserve.engine.sequence import InvalidRequest

    with pytest.raises(InvalidRequest, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
