"""Quantized KV cache (`[engine] kv_cache_dtype`): capacity, agreement with the float cache,
and the engine paths (batch invariance, prefix caching, swap, no recompilation) with int8 pages."""

from __future__ import annotations

import random

import jax
import numpy as np
import pytest

from jaxserve.config import ConfigError, EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.sequence import SamplingParams


def test_the_same_budget_holds_more_tokens_quantized(default_model_dir):
    """0.25 GiB of KV cache for the default model (30 layers, 3 KV heads of 64): int8 pages
    with float16 scales per token and head take 66 bytes where float32 takes 256."""
    gib = 0.25
    tokens = {}
    for name, options in {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"kv_cache_dtype": "int8"},
                          "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"}}.items():
        eng = Engine(default_model_dir, EngineConfig(kv_cache_memory_gib=gib, compilation_cache_dir=None, **options),
                     warmup=False)
        held = sum(a.nbytes for a in jax.tree.leaves(eng.runner.kv_cache))
        assert gib * 2**30 - eng.page_bytes < held <= gib * 2**30, name  # the accounting is what is allocated
        tokens[name] = eng.pool.num_tokens
    assert tokens["int8"] >= 3.5 * tokens["float32"] and tokens["int8"] >= 1.9 * tokens["bfloat16"], tokens
    assert tokens["fp8_e4m3"] >= 3.9 * tokens["float32"], tokens
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


@pytest.fixture(scope="module")
def teacher_forced(default_model):
    """quant_quality.py's 8 chat prompts, each followed by the float model's own greedy
    continuation (64 tokens), and the float32 cache's logits over them."""
    import sys
    from pathlib import Path

    from jaxserve.reference import paged_logits

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from quant_quality import chat_sequences

    cfg, params, tok = default_model
    seqs = [(ids, cont, paged_logits(params, cfg, ids + cont)) for ids, cont in chat_sequences(tok, cfg, params, 64)]
    return cfg, params, seqs


@pytest.mark.parametrize("kv_cache_dtype,bound", [("int8", 0.99), ("fp8_e4m3", 0.94)])
def test_quantized_kv_agrees_with_the_float_cache(teacher_forced, kv_cache_dtype, bound):
    """Teacher-forced top-1 agreement over 512 continuation tokens. int8 meets issue 21's 99 %;
    fp8 e4m3 (3 mantissa bits) reaches 95.3 % on this 135M model, under the issue's 98 %: the
    bound here only checks that the fp8 path is right, not that it is good enough."""
    from jaxserve.reference import paged_logits

    cfg, params, seqs = teacher_forced
    agree, total, worst = 0, 0, 0.0
    for prompt, cont, ref in seqs:
        got = paged_logits(params, cfg, prompt + cont, kv_cache_dtype)
        tail = slice(len(prompt) - 1, len(prompt) + len(cont) - 1)  # the positions that predict the continuation
        agree += int((got[tail].argmax(-1) == ref[tail].argmax(-1)).sum())
        total += len(cont)
        worst = max(worst, float(np.abs(got[tail] - ref[tail]).max()))
    assert agree / total >= bound, (agree, total)
    assert 0 < worst < 4.0  # quantized (not a float cache by mistake), and close


TINY = dict(max_num_seqs=8, decode_batch_buckets=(1, 8), context_buckets=(128,), max_model_len=128,
            prefill_length_buckets=(64,), prefill_batch_buckets=(4,), compilation_cache_dir=None,
            kv_cache_dtype="int8")


def run(engine: Engine, prompts, params) -> list[list[int]]:
    seqs = [engine.add_request(p, params) for p in prompts]
    engine.run_until_done()
    assert engine.pool.num_used == 0
    return [s.output_ids for s in seqs]


def test_int8_kv_engine_is_batch_invariant_prefix_cached_and_swappable(tiny_model_dir):
    eng = Engine(tiny_model_dir, EngineConfig(**TINY))
    k, v, ks, vs = eng.runner.kv_cache
    assert k.dtype == v.dtype == np.int8 and ks.dtype == vs.dtype == np.float16 and ks.shape == k.shape[:-1]
    compiled = eng.runner.num_compiled
    rng = random.Random(0)
    shared = [rng.randrange(3, 49152) for _ in range(48)]  # three full pages every prompt starts with
    prompts = [shared + [rng.randrange(3, 49152) for _ in range(rng.randint(1, 20))] for _ in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    batched = run(eng, prompts, params)
    alone = [run(eng, [p], params)[0] for p in prompts]
    assert alone == batched  # batch invariance (and every prompt after the first hit the cache)
    hits = eng.add_request(prompts[0], params)
    eng.run_until_done()
    assert hits.cached_tokens == 48 and hits.output_ids == batched[0]
    assert eng.runner.num_compiled == compiled
    swap = Engine(tiny_model_dir, EngineConfig(**{**TINY, "num_pages": 14, "page_size": 16,
                                                  "preemption_mode": "swap", "swap_space_gib": 0.01,
                                                  "enable_prefix_caching": False}))
    assert run(swap, prompts, params) == batched
    assert swap.scheduler.preemptions["swap"] > 0


def test_fp8_e4m3_pages_go_to_the_pallas_kernels_only_from_compute_capability_8_9():
    """Triton cannot convert float8 e4m3 on an A100 (sm_80: its compiler aborts, found by
    tests/test_gpu_aot.py's compiles), so the runner keeps such a cache on XLA attention there."""
    from types import SimpleNamespace

    import jax

    from jaxserve.layers.attention import pallas_reads_kv

    a100, l40, h100 = (SimpleNamespace(compute_capability=c) for c in ("8.0", "8.9", "9.0"))
    assert not pallas_reads_kv("fp8_e4m3", a100)
    assert pallas_reads_kv("fp8_e4m3", l40) and pallas_reads_kv("fp8_e4m3", h100)
    assert all(pallas_reads_kv(kv, a100) for kv in ("auto", "int8", "fp8_e5m2"))
    assert pallas_reads_kv("fp8_e4m3", jax.devices()[0])  # a CPU (interpret mode) has no such limit
