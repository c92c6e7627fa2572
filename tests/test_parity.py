"""Logits parity with Hugging Face transformers on tiny random models.

Each model is built with transformers, saved with save_pretrained (safetensors),
converted by `jaxserve convert` and loaded by jaxserve; float32 logits over a batch
of right-padded prompts of different lengths must agree within atol 1e-4 at every
real (non-padding) position.
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
