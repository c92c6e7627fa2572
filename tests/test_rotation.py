"""W8A8's rotated weights (jaxserve/layers/rotation.py): an exact change of basis, read the same
way by every matmul path, the embedding lookup and the tied lm_head, and worth having: it is
what brings int8 activations with outlier channels close to the float product."""

from __future__ import annotations

import logging

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxserve.checkpoint.load import load_model
from jaxserve.checkpoint.quantize import LAYER_WEIGHTS, dequantize, quantize_at_load, quantize_params
from jaxserve.layers import parallel
from jaxserve.layers.linear import W8A8_MIN_ROWS, embed, linear, tied_logits
from jaxserve.layers.rotation import (block_size, input_signs, rotate_inputs, rotate_weight, unrotate_rows,
                                      unrotate_weight)


@pytest.mark.parametrize("K", [576, 1536, 96, 12])
def test_rotation_is_an_exact_change_of_basis(K):
    """(x R) @ (R^T W) = x @ W, and each rotation undoes: R is orthonormal, blocks of at most 64."""
    rng = np.random.default_rng(K)
    x, w = rng.standard_normal((5, K)).astype(np.float32), rng.standard_normal((K, 7)).astype(np.float32)
    s = input_signs(K)
    assert block_size(K) == min(K & -K, 64) and set(np.unique(s)) == {-1.0, 1.0}
    xr = np.asarray(rotate_inputs(jnp.asarray(x)))
    np.testing.assert_allclose(xr @ rotate_weight(w, s), x @ w, atol=1e-4 * np.sqrt(K))
    np.testing.assert_allclose(np.linalg.norm(xr, axis=1), np.linalg.norm(x, axis=1), rtol=1e-5)
    np.testing.assert_allclose(unrotate_weight(rotate_weight(w, s), s), w, atol=1e-5)
    np.testing.assert_allclose(np.asarray(unrotate_rows(jnp.asarray(xr))), x, atol=1e-5)
    assert not np.allclose(xr, x)  # it did rotate


def test_rotation_brings_outlier_activations_close_to_the_float_product():
    """Activations whose few channels are 50x the rest (what a decoder's look like): with one
    absmax scale per token the other channels keep a few int8 levels, unless R spreads them."""
    rng = np.random.default_rng(0)
    K, N = 576, 64
    x = rng.standard_normal((16, K)).astype(np.float32)
    x[:, [3, 100, 400]] *= 50
    w = rng.standard_normal((K, N)).astype(np.float32) / np.sqrt(K)
    want = x @ w
    plain = quantize_params({"layers": {n: w[None] for n in LAYER_WEIGHTS}, "embed": w.T}, "int8")
    rotated = quantize_params({"layers": {n: w[None] for n in LAYER_WEIGHTS}, "embed": w.T}, "int8", rotate=True)
    err = {}
    for name, params in (("plain", plain), ("rotated", rotated)):
        wq = {k: a[0] for k, a in params["layers"]["wq"].items()}
        err[name] = np.abs(np.asarray(linear(jnp.asarray(x), wq, "w8a8")) - want).mean()
    assert err["rotated"] < 0.25 * err["plain"], err


def test_rotated_weights_serve_every_path(tiny_model_dir):
    """quantization="w8a8" over a float checkpoint: every layer weight and the tied table carry
    their signs; dequantizing gives the float weight back (int8 error only), and the weight-only
    dot, the int8 x int8 dot, the Pallas kernel, the lookup and the lm_head all equal their
    float counterparts within int8 rounding."""
    cfg, params = load_model(tiny_model_dir)
    rot = quantize_at_load(params, "w8a8")
    plain = quantize_at_load(params, "int8")
    assert "signs" not in plain["layers"]["wq"] and "signs" not in plain["embed"]
    L = cfg.num_layers
    for name in LAYER_WEIGHTS:
        w, f = rot["layers"][name], np.asarray(params["layers"][name])
        assert w["signs"].shape == (L, f.shape[1]) and w["q8"].dtype == jnp.int8
        assert np.all(np.asarray(w["signs"]) == input_signs(f.shape[1]))  # the basis rotate_inputs uses
        got = dequantize({k: np.asarray(a[0]) for k, a in w.items()})
        # rounding in the rotated basis is at most half a step per element; R keeps column norms
        bound = np.sqrt(f.shape[1]) * np.asarray(w["scale"][0]) / 2 * (1 + 1e-4) + 1e-6
        assert np.all(np.linalg.norm(got - f[0], axis=0) <= bound), name
        assert np.linalg.norm(got - f[0]) > 0  # int8, not the float weight
    rng = np.random.default_rng(1)
    f = np.asarray(params["layers"]["w_up"][0])
    w = {k: a[0] for k, a in rot["layers"]["w_up"].items()}
    for rows in (1, W8A8_MIN_ROWS + 3):
        x = rng.standard_normal((rows, f.shape[0])).astype(np.float32)
        want = x @ f
        tol = 0.05 * np.abs(want).max()
        for impl in ("xla", "w8a8", "pallas"):
            got = np.asarray(linear(jnp.asarray(x), w, impl, interpret=True))
            assert np.abs(got - want).max() < tol, (impl, rows)
    table = np.asarray(params["embed"])
    tokens = jnp.asarray([[0, 5, 77]])
    got = np.asarray(embed(rot["embed"], tokens))[0]
    bound = np.sqrt(table.shape[1]) * np.asarray(rot["embed"]["scale"])[[0, 5, 77]] / 2 * (1 + 1e-4) + 1e-6
    assert np.all(np.linalg.norm(got - table[[0, 5, 77]], axis=1) <= bound)
    h = rng.standard_normal((3, table.shape[1])).astype(np.float32)
    for impl in ("xla", "w8a8"):
        got = np.asarray(tied_logits(jnp.asarray(h), rot["embed"], impl))
        assert np.abs(got - h @ table.T).max() < 0.05 * np.abs(h @ table.T).max(), impl


def test_w8a8_over_an_int8_checkpoint_runs_it_unrotated_and_says_so(tiny_model_dir, caplog):
    cfg, params = load_model(tiny_model_dir)
    int8 = quantize_at_load(params, "int8")
    with caplog.at_level(logging.WARNING, logger="jaxserve.checkpoint.quantize"):
        assert quantize_at_load(int8, "w8a8") is int8
    assert "quantized unrotated" in caplog.text


def test_signs_are_whole_on_every_device():
    """Under tensor parallelism a rotated weight's signs are replicated; its int8 weight and
    scales split as an unrotated one's do."""
    w = {"q8": np.zeros((2, 8, 6), np.int8), "scale": np.ones((2, 6), np.float32), "signs": np.ones((2, 8), np.float32)}
    column, row = parallel.weight_specs("column", w, 2), parallel.weight_specs("row", w, 2)
    assert column["signs"] == P() and row["signs"] == P()
    assert column["q8"] == parallel.weight_specs("column", {"q8": w["q8"], "scale": w["scale"]}, 2)["q8"] != P()
    assert row["q8"] != P() and row["scale"] == P()
    params = {"layers": {"wq": w}, "embed": {"q8": np.zeros((10, 8), np.int8), "scale": np.ones(10, np.float32),
                                             "signs": np.ones(8, np.float32)}}
    specs = parallel.param_specs(params, 2)
    assert specs["embed"]["signs"] == P() and specs["embed"]["q8"] != P()


def test_w8a8_engine_is_batch_invariant_and_drafting_for_itself_is_always_accepted(tiny_model_dir):
    """Through the engine: with quantization "w8a8" a request's greedy tokens alone (decode
    steps of one row, under W8A8_MIN_ROWS) equal its tokens among 12 (steps of 16 rows, the
    int8 x int8 dot), and the model drafting for itself under W8A8 (draft steps of one row,
    verify steps of 5 rows per sequence) has every draft accepted: the same numbers on both paths."""
    import random

    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine
    from jaxserve.engine.sequence import SamplingParams

    base = dict(max_num_seqs=16, decode_batch_buckets=(1, 16), context_buckets=(128,), max_model_len=128,
                prefill_length_buckets=(64,), prefill_batch_buckets=(1, 4),
                quantization="w8a8")
    plain = Engine(tiny_model_dir, EngineConfig(**base), warmup=False)
    spec = Engine(tiny_model_dir, EngineConfig(**base, speculative={
        "method": "draft", "draft_model": str(tiny_model_dir), "num_speculative_tokens": 4,
        "disable_above_batch_size": 16}), warmup=False)
    assert "signs" in plain.runner.params["layers"]["wq"]  # rotated W8A8 weights
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 40))] for _ in range(12)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)

    def run(engine, prompts):
        seqs = [engine.add_request(p, params) for p in prompts]
        engine.run_until_done()
        return [s.output_ids for s in seqs]

    batched = run(plain, prompts)
    assert [run(plain, [p])[0] for p in prompts] == batched
    before = spec.spec_counts
    assert run(spec, prompts) == batched
    rows, drafted, accepted = (a - b for a, b in zip(spec.spec_counts, before))
    assert drafted > 100 and accepted == drafted
