"""Logits parity with Hugging Face transformers on tiny random models.

Each model is built with transformers, saved with save_pretrained (safetensors),
converted by `jaxserve convert` and loaded by jaxserve; float32 logits over a batch
of right-padded prompts of different lengths must agree within atol 1e-4 at every
real (non-padding) position. The engine's paged prefill and decode steps are compared the
same way, by the log-probabilities they report against transformers' on the same tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_models import VARIANTS, build
from jaxserve.checkpoint.load import load_model
from jaxserve.cli import main as cli_main
from jaxserve.models import llama

LENGTHS = [13, 4, 9, 1]


def _batch(vocab, seed=1):
    rng = np.random.default_rng(seed)
    T = max(LENGTHS)
    tokens = np.zeros((len(LENGTHS), T), np.int32)
    for i, n in enumerate(LENGTHS):
        tokens[i, :n] = rng.integers(3, vocab, n)
    return tokens


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant, tmp_path):
    model = build(variant)
    src, dst = tmp_path / "hf", tmp_path / "converted"
    model.save_pretrained(src)
    assert cli_main(["convert", str(src), str(dst), "--quiet"]) == 0

    cfg, params = load_model(dst)
    assert cfg.architecture == model.config.architectures[0]
    tokens = _batch(cfg.vocab_size)
    lengths = np.array(LENGTHS)
    mask = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                    attention_mask=torch.tensor(mask, dtype=torch.long)).logits.numpy()
    ours, _ = llama.forward(params, cfg, tokens, llama.reference_metadata(lengths, tokens.shape[1], cfg))
    ours = np.asarray(ours)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours[mask], ref[mask], atol=1e-4, rtol=0)
    assert np.abs(ref[mask]).max() > 0.1  # the comparison is not between near-zero logits


@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_paged_prefill_and_decode_logprobs_match_transformers(tiny_model_dir, attention):
    """The serving path, not the cache-free forward: four prompts (5 tokens, one page of 16
    exactly, 37, and 70 in three prefill chunks of 32) run batched through the engine's paged
    prefill and multi-step decode steps, sampled with seeds at temperature 1 (so the chosen
    tokens are not all the likeliest), reporting logprobs. Transformers then scores each
    prompt + output whole: at every generated position the chosen token's log-probability
    and the 20 largest log-probabilities agree within atol 1e-4 in float32, for the XLA
    attention and for the Pallas kernels (interpreted on this CPU)."""
    from fakes import tiny_hf_model
    from jaxserve.engine.engine import LLM
    from jaxserve.engine.sequence import SamplingParams

    llm = LLM(tiny_model_dir, max_num_seqs=4, decode_batch_buckets=(4,), context_buckets=(128,), max_model_len=128,
              prefill_length_buckets=(32,), prefill_batch_buckets=(4,), page_size=16, attention_impl=attention,
              interpret=attention == "pallas", warmup=False)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 49152, n).tolist() for n in (5, 16, 37, 70)]
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=i, ignore_eos=True, logprobs=20)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    hf = tiny_hf_model()
    not_likeliest = 0
    for prompt, out in zip(prompts, outs):
        ids, n = prompt + out.token_ids, len(out.token_ids)
        assert n == 12 and len(out.logprobs) == n
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
        ref = ref[len(prompt) - 1:len(prompt) - 1 + n]  # the distributions the output tokens were drawn from
        ours_chosen = np.array([lp["logprob"] for lp in out.logprobs])
        np.testing.assert_allclose(ours_chosen, ref[np.arange(n), out.token_ids], atol=1e-4, rtol=0)
        ours_top = np.array([[v for _, v in lp["top"]] for lp in out.logprobs])
        np.testing.assert_allclose(ours_top, -np.sort(-ref, axis=1)[:, :20], atol=1e-4, rtol=0)
        assert [lp["top"][0][0] for lp in out.logprobs] == ref.argmax(axis=1).tolist()
        not_likeliest += int((np.array(out.token_ids) != ref.argmax(axis=1)).sum())
    assert not_likeliest > 0  # the chosen tokens' logprobs are not only the top-1 values again
