"""Quantized KV cache (`[engine] kv_cache_dtype`): capacity, agreement with the float cache,
and the engine paths (batch invariance, prefix caching, swap, no recompilation) with int8 pages."""

from __future__ import annotations

import random
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import ConfigError, EngineConfig
from jaxserve.engine.engine import Engine
from jaxserve.engine.sequence import SamplingParams
from jaxserve.layers.attention import KEY_TRANSFORM


def test_the_same_budget_holds_more_tokens_quantized(default_model_dir):
    """0.25 GiB of KV cache for the default model (30 layers, 3 KV heads of 64): int8 pages
    with float16 scales per token and head take 66 bytes where float32 takes 256."""
    gib = 0.25
    tokens = {}
    for name, options in {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"kv_cache_dtype": "int8"},
                          "fp8_e4m3": {"kv_cache_dtype": "fp8_e4m3"}}.items():
        eng = Engine(default_model_dir, EngineConfig(kv_cache_memory_gib=gib, **options),
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
    fp8 e4m3 (3 mantissa bits, scale 1.0, no calibration) reaches 95.3 % on this 135M model (97.9 %
    calibrated), under the issue's 98 %: the bound here only checks that the fp8 path is right,
    not that it is good enough."""
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


def test_calibrated_key_transforms_lower_the_fp8_kv_caches_error(teacher_forced, default_model):
    """fp8 e4m3 pages with the calibration's key transforms (checkpoint/kv_scales.py) against
    Hadamard-rotated keys, each with its own calibrated scales over the same 1,024 tokens of
    this repository's README: the mean KL divergence from the float cache's next-token
    distribution over the 512 continuation positions falls (by a third in BENCHMARKS.md's
    measurement over 2,048 tokens of calibration; here by at least a fifth)."""
    from pathlib import Path

    from jaxserve.checkpoint import kv_scales
    from jaxserve.reference import paged_logits

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from quant_quality import kl_divergence

    cfg, params, seqs = teacher_forced
    tok = default_model[2]
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    calibration = tok.encode(text, add_special_tokens=False)[:1024]
    hadamard_scales, identity = kv_scales.calibrate(params, cfg, calibration, balance=False)
    assert (identity == np.eye(cfg.head_dim)).all()
    scales, keys = kv_scales.calibrate(params, cfg, calibration)
    balanced = kv_scales.with_key_transforms(params, keys)
    kl = {}
    for name, p, s in (("hadamard", params, hadamard_scales), ("keys", balanced, scales)):
        tails = []  # the positions that predict the continuation
        for prompt, cont, ref in seqs:
            got = paged_logits(p, cfg, prompt + cont, "fp8_e4m3", kv_scales=s)
            tails.append((ref[len(prompt) - 1:-1], got[len(prompt) - 1:-1]))
        kl[name] = np.mean([kl_divergence(want, got) for want, got in tails])
    assert 0 < kl["keys"] <= 0.8 * kl["hadamard"], kl


def test_key_balance_makes_the_query_and_key_sides_one_matrix():
    """key_balance(Q, K) = W: symmetric, determinant 1, and W^-1 Q W^-1 = c W K W, so that the
    expected fp8 score error sum_i (W^-1 Q W^-1)_ii (W K W)_ii (Hadamard-rotated) is below
    Hadamard alone's for queries and keys of different shapes (here queries along few
    directions, keys along all)."""
    from jaxserve.checkpoint import kv_scales
    from jaxserve.layers.rotation import hadamard

    rng = np.random.default_rng(0)
    D = 16
    basis, other = (np.linalg.qr(rng.normal(size=(D, D)))[0] for _ in range(2))
    q2 = basis @ np.diag(np.geomspace(100, 0.01, D)) @ basis.T
    k2 = other @ np.diag(rng.uniform(0.5, 2, D)) @ other.T
    w = kv_scales.key_balance(q2, k2, damping=0.0)
    np.testing.assert_allclose(w, w.T, atol=1e-9)
    assert np.isclose(np.linalg.det(w), 1.0)
    wi = np.linalg.inv(w)
    left, right = wi @ q2 @ wi, w @ k2 @ w
    np.testing.assert_allclose(left / np.trace(left), right / np.trace(right), atol=1e-9)
    h = hadamard(D)

    def cost(a, b):
        return np.sum(np.diag(h @ a @ h) * np.diag(h @ b @ h))

    assert cost(left, right) < 0.75 * cost(q2, k2)  # 0.54 here; W = I would give 1


TINY = dict(max_num_seqs=8, decode_batch_buckets=(1, 8), context_buckets=(128,), max_model_len=128,
            prefill_length_buckets=(64,), prefill_batch_buckets=(4,),
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
                                                  "enable_prefix_caching": False}), warmup=False)
    assert run(swap, prompts, params) == batched
    assert swap.scheduler.preemptions["swap"] > 0


def test_fp8_pages_on_a_cpu_are_uint8_bits_that_no_step_widens(tiny_model_dir):
    """XLA's CPU backend has no float8 scatter: writing a step's tokens into float8 pages widened
    the whole cache to float16 and back, twice per layer (the default server's first decode step
    with fp8 ran past the watchdog's two minutes). On a CPU the pages hold the float8 bits as uint8
    (attention.fp8_bits), which XLA scatters in place: no compiled step holds an array of the
    cache's shape in another type, and swapping the pages out and back gives the same outputs."""
    eng = Engine(tiny_model_dir, EngineConfig(**{**TINY, "kv_cache_dtype": "fp8_e4m3"}), warmup=False)
    k, v = eng.runner.kv_cache
    assert k.dtype == v.dtype == np.uint8 and eng.runner.fp8_bits == jnp.float8_e4m3fn
    cache_shape = re.escape("[" + ",".join(map(str, k.shape)) + "]")
    for key in (eng.runner.buckets()[0], max(eng.runner.buckets(), key=lambda b: b[1])):  # decode, prefill
        hlo = eng.runner._lower(key).compile().as_text()
        assert set(re.findall(r"(\w+)" + cache_shape, hlo)) == {"u8"}, key
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(20, 60))] for _ in range(8)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    batched = run(eng, prompts, params)
    swap = Engine(tiny_model_dir, EngineConfig(**{**TINY, "kv_cache_dtype": "fp8_e4m3", "num_pages": 14,
                                                  "preemption_mode": "swap", "swap_space_gib": 0.01,
                                                  "enable_prefix_caching": False}), warmup=False)
    assert run(swap, prompts, params) == batched
    assert swap.scheduler.preemptions["swap"] > 0


def test_generate_with_a_quantized_kv_cache_runs_the_engine(tiny_model_dir):
    """`jaxserve generate PROMPT --kv-cache-dtype fp8_e4m3` goes through the engine's fp8 pages (the
    plain one-prompt path is the reference forward, with no paged cache: it used to ignore the
    flag): its text is LLM.generate's with that cache, which on this random model differs from
    the float cache's."""
    import subprocess

    from jaxserve.engine.engine import LLM

    def cli(*flags):
        proc = subprocess.run([sys.executable, "-m", "jaxserve", "generate", "--model", str(tiny_model_dir),
                               "The sky is", "--max-tokens", "12", "--temperature", "0", "--max-model-len", "128",
                               *flags],
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    params = SamplingParams(max_tokens=12, temperature=0)
    fp8, float_ = (LLM(tiny_model_dir, max_num_seqs=1, max_model_len=128, context_buckets=(128,), kv_cache_dtype=kv,
                       warmup=False).generate(["The sky is"], params)[0].text for kv in ("fp8_e4m3", "auto"))
    assert fp8 != float_
    assert cli("--kv-cache-dtype", "fp8_e4m3") == fp8 + "\n"
    assert cli() == float_ + "\n"


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


CALIBRATION = 100  # tokens of the calibration text


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory, default_model_dir):
    """The tiny model converted by the command line with `--kv-calibration` over a page of this
    repository's README: (model dir, the calibration tokens)."""
    import shutil
    from pathlib import Path

    from fakes import TOKENIZER_FILES, tiny_hf_model
    from jaxserve.cli import main as cli_main
    from jaxserve.tokenizer import Tokenizer

    root = tmp_path_factory.mktemp("fp8")
    src, dst, text = root / "hf", root / "tiny-fp8", root / "calibration.txt"
    tiny_hf_model().save_pretrained(src)
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_dir / name, src / name)
    text.write_text((Path(__file__).parent.parent / "README.md").read_text()[:6000])
    assert cli_main(["convert", str(src), str(dst), "--kv-calibration", str(text), "--kv-calibration-tokens",
                     str(CALIBRATION), "--quiet"]) == 0
    return dst, Tokenizer(dst).encode(text.read_text(), add_special_tokens=False)[:CALIBRATION]


def _largest_stored(kv, pages: list[int], n: int) -> np.ndarray:
    """[2, L]: the largest |value| each layer's K and V pages hold for the first n tokens on `pages`."""
    out = []
    for cache in kv[:2]:  # [L, NP, PS, K, D]; on a CPU float8 e4m3 bits in uint8 (attention.fp8_bits)
        assert cache.dtype == np.uint8
        cache = jax.lax.bitcast_convert_type(cache, jnp.float8_e4m3fn)
        tokens = np.asarray(cache[:, np.asarray(pages)].astype(np.float32))
        out.append(np.abs(tokens.reshape(cache.shape[0], -1, *cache.shape[3:])[:, :n]).max(axis=(1, 2, 3)))
    return np.stack(out)


def test_fp8_kv_calibration_stores_each_layers_largest_value_at_448(calibrated):
    """`jaxserve convert --kv-calibration` writes kv_scales.json and kv_keys.npy: per layer, the
    calibration text's largest K and V as stored (keys through the layer's key transforms, values
    rotated) divided by 448. Written through the paged path with those scales and transforms,
    that text's largest stored value in every layer is exactly e4m3's largest (448), and read
    back with them the logits are as close to the float cache's as with scale 1.0 (read
    without them, 1/scale times too large, they would not be)."""
    import json

    from jaxserve.checkpoint import kv_scales
    from jaxserve.checkpoint.load import load_model
    from jaxserve.reference import paged_forward, paged_logits

    model_dir, tokens = calibrated
    raw = json.loads((model_dir / "kv_scales.json").read_text())
    assert raw["calibration"] == {"text": "calibration.txt", "tokens": CALIBRATION}
    cfg, params = load_model(model_dir)
    scales, keys = kv_scales.load(model_dir, cfg)
    assert scales.shape == (2, cfg.num_layers) and (scales < 0.1).all()  # the tiny model's K/V are far below 448
    assert raw["keys"] == "kv_keys.npy" and keys.shape == (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)
    got, kv = paged_forward(kv_scales.with_key_transforms(params, keys), cfg, tokens, "fp8_e4m3", kv_scales=scales)
    np.testing.assert_array_equal(_largest_stored(kv, list(range(-(-CALIBRATION // 16))), CALIBRATION), 448.0)
    ref, unit = paged_logits(params, cfg, tokens), paged_logits(params, cfg, tokens, "fp8_e4m3")
    # fp8's 3 mantissa bits cost this random model as much either way (about 2 logits at worst,
    # a quarter of the top-1 choices); the calibrated scales must cost no more than scale 1.0
    assert np.abs(got - ref).mean() <= 1.05 * np.abs(unit - ref).mean()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= (unit.argmax(-1) == ref.argmax(-1)).mean() - 0.02


@pytest.mark.parametrize("attention", ["xla", "pallas"])
def test_the_engine_writes_and_reads_fp8_pages_with_the_checkpoints_scales(calibrated, attention):
    """The engine loads kv_scales.json and kv_keys.npy for an fp8 cache: after prefilling the calibration text
    (two chunks) its pages hold 448 as each layer's largest K and V, and the first token's
    logprobs agree with the reference paged path under the same scales, for the XLA attention
    and the Pallas kernels (interpreted)."""
    from jaxserve.checkpoint import kv_scales
    from jaxserve.checkpoint.load import load_model
    from jaxserve.reference import paged_logits

    model_dir, tokens = calibrated
    eng = Engine(model_dir, EngineConfig(**{**TINY, "kv_cache_dtype": "fp8_e4m3", "num_pages": 64,
                                            "attention_impl": attention, "interpret": attention == "pallas"}),
                 warmup=False)
    scales, keys = kv_scales.load(model_dir, eng.model_cfg)
    np.testing.assert_array_equal(eng.runner.kv_scales, scales)
    seq = eng.add_request(tokens, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, logprobs=5))
    logprobs = []
    while not seq.output_ids:  # prefill, to the first token
        logprobs += [lp for ev in eng.step() for lp in ev.logprobs or ()]
    np.testing.assert_array_equal(_largest_stored(eng.runner.kv_cache, seq.pages, CALIBRATION), 448.0)
    logprobs += [lp for ev in eng.run_until_done() for lp in ev.logprobs or ()]
    first = logprobs[0]
    cfg, params = load_model(model_dir)
    assert KEY_TRANSFORM in eng.runner.params["layers"]
    params = kv_scales.with_key_transforms(params, keys)
    ref = paged_logits(params, cfg, tokens, "fp8_e4m3", kv_scales=scales)[-1].astype(np.float64)
    ref = ref - ref.max() - np.log(np.exp(ref - ref.max()).sum())  # log_softmax
    assert first["token_id"] == int(ref.argmax())
    np.testing.assert_allclose([lp for _, lp in first["top"]], np.sort(ref)[::-1][:5], atol=2e-2)


@pytest.mark.parametrize("content", ['{"k": [1.0, 1.0]}', '{"k": [1.0], "v": [1.0]}', '{"k": [1, 0], "v": [1, 1]}',
                                     '{"k": [1, 1], "v": [1, NaN]}', 'not json'])
def test_a_malformed_kv_scale_file_is_refused_by_name(tmp_path, content):
    from types import SimpleNamespace

    from jaxserve.checkpoint import kv_scales

    cfg = SimpleNamespace(num_layers=2)  # what the scales are checked against
    assert kv_scales.load(tmp_path, cfg) == (None, None)  # none there: scale 1.0
    (tmp_path / "kv_scales.json").write_text(content)
    with pytest.raises(ValueError, match="kv_scales.json"):
        kv_scales.load(tmp_path, cfg)


def test_key_transforms_named_but_missing_or_misshapen_are_refused(tmp_path, tiny_model_dir):
    """kv_scales.json's K scales were calibrated for its key transforms: without the file it
    names, or with one of another shape, the engine refuses rather than read keys through H."""
    import shutil

    from jaxserve.checkpoint import kv_scales
    from jaxserve.config import ModelConfig

    model_dir = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model_dir)
    cfg = ModelConfig.from_dir(model_dir)
    keys = np.broadcast_to(np.eye(cfg.head_dim, dtype=np.float32),
                           (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim))
    kv_scales.save(model_dir, np.ones((2, cfg.num_layers), np.float32), {"text": "by hand", "tokens": 0}, keys)
    np.testing.assert_array_equal(kv_scales.load(model_dir, cfg)[1], keys)
    np.save(model_dir / "kv_keys.npy", keys[:, :, :4])
    with pytest.raises(ValueError, match="kv_keys.npy"):
        kv_scales.load(model_dir, cfg)
    (model_dir / "kv_keys.npy").unlink()
    with pytest.raises(ValueError, match="kv_keys.npy"):
        Engine(model_dir, EngineConfig(**{**TINY, "kv_cache_dtype": "fp8_e4m3", "num_pages": 16}), warmup=False)
