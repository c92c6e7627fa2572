"""scripts/quant_quality.py's own functions on the tiny model, so the script BENCHMARKS.md quotes
keeps running as the model code changes (a changed `linear` signature once broke its simulated
W8A8 row without any test noticing)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from jaxserve.checkpoint.load import load_model
from jaxserve.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def quant_quality():
    path = Path(__file__).parent.parent / "scripts" / "quant_quality.py"
    spec = importlib.util.spec_from_file_location("quant_quality", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_model_agrees_with_itself_and_simulated_block_int8_runs(quant_quality, tiny_model_dir):
    """Teacher-forced on its own greedy continuations a model agrees with itself on every token;
    the simulated blockwise-int8 activations run, report a share and put `linear` back."""
    cfg, params = load_model(tiny_model_dir)
    seqs = quant_quality.chat_sequences(Tokenizer(tiny_model_dir), cfg, params, 4)[:3]
    assert quant_quality.agreement(params, cfg, seqs, 4).startswith("top-1 agreement with float32 100.0% (12/12 ")
    plain = quant_quality.llama.linear
    with quant_quality.block_quantized_activations(32):
        assert quant_quality.llama.linear is not plain
        assert "% (" in quant_quality.agreement(params, cfg, seqs, 4)
    assert quant_quality.llama.linear is plain
