#!/usr/bin/env python
"""Quality of int8 / int4 weight-only quantization and of quantized KV caches on the default model,
and checkpoint sizes.

    python scripts/quant_quality.py [--out-dir checkpoints] [--tokens 64]

Converts the default model's GGUF four ways (float32, the default checkpoint; int8;
int4 with groups of 128, and of 32, the block size of the GGUF's own Q4_1 weights), lets the float32 model continue 8 chat prompts
greedily for 64 tokens, then teacher-forces each quantized model on exactly those
sequences (one cache-free forward over prompt + continuation) and counts how often its
top-1 prediction at each continuation position equals the float32 token, and the mean
KL divergence from the float32 model's distribution there (W8A8 is the float checkpoint quantized
rotated at load, as the engine does, and the int8 checkpoint run with int8 activations too; a
last row simulates int8 activations per 32-channel block against the float weights). Prints the
agreement and the size of each checkpoint's params/ directory. Then the KV cache rows
(`kv_rows`): int8 and fp8 KV caches against the float32 cache, on the same sequences and on
a 1,500-token passage.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import random
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxserve.checkpoint.convert import convert  # noqa: E402
from jaxserve.checkpoint.load import load_model  # noqa: E402
from jaxserve.checkpoint.quantize import (LAYER_WEIGHTS, dequantize, param_bytes, quantize_at_load,  # noqa: E402
                                          quantize_params)
from jaxserve.default_model import DEFAULT_DIR, ensure_default_model, gguf_path  # noqa: E402
from jaxserve.layers.linear import quantize_rows  # noqa: E402
from jaxserve.models import llama  # noqa: E402
from jaxserve.reference import ReferenceGenerator  # noqa: E402
from jaxserve.tokenizer import Tokenizer  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "Give me three tips for a job interview.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish and German.",
    "Why do cats purr?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def logits(params, cfg, seq: list[int], matmul_impl: str = "xla") -> np.ndarray:
    """[T, V] float32: one cache-free forward over the whole sequence."""
    tokens = jnp.asarray([seq], jnp.int32)
    meta = llama.reference_metadata(np.asarray([len(seq)]), len(seq), cfg)
    meta = dataclasses.replace(meta, matmul_impl=matmul_impl)
    out, _ = llama.forward(params, cfg, tokens, meta)
    return np.asarray(out[0], np.float32)


def kl_divergence(ref: np.ndarray, got: np.ndarray) -> np.ndarray:
    """KL(ref || got) of the next-token distributions of logits [..., V] -> [...]."""
    p, q = jax.nn.log_softmax(jnp.asarray(ref, jnp.float32)), jax.nn.log_softmax(jnp.asarray(got, jnp.float32))
    return np.asarray(jnp.sum(jnp.exp(p) * (p - q), axis=-1))


def agreement(params, cfg, seqs, tokens: int, matmul_impl: str = "xla", ref: list | None = None) -> str:
    """Top-1 agreement with the float model's greedy tokens; with `ref` (the float model's
    logits of each sequence) also the mean KL divergence from its next-token distribution over
    the same positions: a steadier measure than agreement, which turns on the few positions
    whose two best tokens nearly tie."""
    agree = total = 0
    kl = []
    for k, (ids, out) in enumerate(seqs):
        # the prediction at position len(ids) - 1 + i is the model's guess for out[i]
        tail = slice(len(ids) - 1, len(ids) - 1 + len(out))
        got = logits(params, cfg, ids + out, matmul_impl)[tail]
        agree += int(np.sum(got.argmax(-1) == np.asarray(out)))
        total += len(out)
        if ref is not None:
            kl.append(kl_divergence(ref[k][tail], got))
    text = f"top-1 agreement with float32 {agree / total:.1%} ({agree}/{total} tokens, {len(seqs)} prompts x {tokens})"
    return text + (f", mean KL from float32 {np.concatenate(kl).mean():.4f}" if kl else "")


def weight_error(params, ref_params) -> str:
    """Mean squared error of the dequantized layer weights against float32's, over all seven."""
    err = n = 0.0
    for name in LAYER_WEIGHTS:
        want = np.asarray(ref_params["layers"][name], np.float32)
        w = params["layers"][name]
        for i in range(want.shape[0]):
            got = dequantize({k: np.asarray(a[i]) for k, a in w.items()})
            err += float(np.sum((got - want[i]) ** 2))
            n += want[i].size
    return f"layer weights' mean squared error {err / n:.3g}"


@contextlib.contextmanager
def block_quantized_activations(block: int):
    """Within: every decoder matmul with a float weight sees its input rounded to int8 with one
    absmax scale per `block` channels (fake quantization: the product itself stays float)."""
    plain = llama.linear

    def fake(x, w, *args, **kwargs):  # linear's own arguments (impl, mesh, ...) pass through
        if not isinstance(w, dict):
            xq, scale = quantize_rows(x.reshape(-1, block))  # one absmax scale per block
            x = (xq * scale).reshape(x.shape).astype(x.dtype)
        return plain(x, w, *args, **kwargs)

    llama.linear = fake
    try:
        yield
    finally:
        llama.linear = plain


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default=str(ROOT / "checkpoints"))
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kv-only", action="store_true", help="only the KV cache rows (no checkpoints converted)")
    args = ap.parse_args()
    ensure_default_model()
    if args.kv_only:
        cfg, ref_params = load_model(DEFAULT_DIR)
        kv_rows(ref_params, cfg, chat_sequences(Tokenizer(DEFAULT_DIR), cfg, ref_params, args.tokens),
                args.tokens)
        return 0
    dirs = {"float32": DEFAULT_DIR}
    variants = {"int8": ("int8", 128), "int4-g128": ("int4", 128), "int4-g32": ("int4", 32)}
    for name, (mode, group) in variants.items():
        d = Path(args.out_dir) / f"{DEFAULT_DIR.name}-{name}"
        if not (d / "params").is_dir():
            convert(gguf_path(), d, quantize=mode, group_size=group, progress=False)
        dirs[name] = d
    tok = Tokenizer(DEFAULT_DIR)
    cfg, ref_params = load_model(DEFAULT_DIR)
    seqs = chat_sequences(tok, cfg, ref_params, args.tokens)
    ref = [logits(ref_params, cfg, i + o) for i, o in seqs]
    f32_mb = size_mb(dirs["float32"] / "params")
    f32_bytes = param_bytes(ref_params)
    print(f"float32: params/ {f32_mb:.0f} MB on disk, {f32_bytes / 1e6:.0f} MB in memory")
    for mode in variants:
        _, params = load_model(dirs[mode])
        mb = size_mb(dirs[mode] / "params")
        nbytes = param_bytes(params)
        print(f"{mode}: {agreement(params, cfg, seqs, args.tokens, ref=ref)}; params/ {mb:.0f} MB on disk = "
              f"{mb / f32_mb:.0%} of float32, {nbytes / 1e6:.0f} MB in memory = {nbytes / f32_bytes:.0%}; "
              f"{weight_error(params, ref_params)}")
    # W8A8 as `[engine] quantization = "w8a8"` runs it over this float checkpoint: weights
    # quantized at load in the rotated basis, int8 activations (per token, rotated) in every
    # matmul and the lm_head. The teacher-forced forward has one row per position, so every
    # matmul takes the int8 x int8 path. Then the same over the int8 checkpoint, which was
    # quantized unrotated: what the rotation buys.
    rotated = quantize_at_load(ref_params, "w8a8")
    print(f"w8a8 (float checkpoint quantized rotated at load, int8 activations): "
          f"{agreement(rotated, cfg, seqs, args.tokens, 'w8a8', ref=ref)}; {weight_error(rotated, ref_params)}")
    _, params = load_model(dirs["int8"])
    print(f"w8a8 over the int8 checkpoint (unrotated): "
          f"{agreement(params, cfg, seqs, args.tokens, 'w8a8', ref=ref)}")
    # int8 activations per 32-channel block against the float32 weights themselves (the GGUF's
    # Q4_1 blocks are exact small integers, so blockwise int8 x int8 dots would add no weight
    # error). Simulated: each decoder matmul input is rounded to int8 per block and multiplied
    # in float; the tied lm_head stays float.
    with block_quantized_activations(32):
        print(f"int8 activations per 32-channel block, exact weights (simulated): "
              f"{agreement(ref_params, cfg, seqs, args.tokens, ref=ref)}")
    # What the least-squares refinement of int4's scales and lows buys: the same int4-g128
    # with plain min/max scaling (quantized in memory, no checkpoint).
    minmax = quantize_params(jax.tree.map(np.asarray, ref_params), "int4", 128, refine_steps=0)
    print(f"int4-g128 with min/max scales only: {agreement(minmax, cfg, seqs, args.tokens, ref=ref)}; "
          f"{weight_error(minmax, ref_params)}")
    kv_rows(ref_params, cfg, seqs, args.tokens)
    return 0


def chat_sequences(tok, cfg, params, tokens: int) -> list[tuple[list[int], list[int]]]:
    """Each prompt (chat template applied) and the float model's greedy continuation of it. One
    generator for all of them: its cache length is a compiled shape, and a generator per prompt
    compiled both its steps eight times (48 CPU seconds for the 8 x 64 tokens, 33 with one)."""
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    gen = ReferenceGenerator(cfg, params, max_len=max(map(len, prompts)) + tokens)
    return [(ids, list(gen.stream(ids, tokens, temperature=0.0, seed=0, stop_ids=()))) for ids in prompts]


def kv_rows(params, cfg, seqs, tokens: int) -> None:
    """Quantized KV caches against the float32 cache, both through the paged path (every key and
    value written to the cache and read back): teacher-forced top-1 agreement on the chat
    prompts' continuations, the largest logit difference there, the mean KL divergence from the
    float cache's next-token distribution over every position, and a long-context case (a
    1,500-token passage of documentation and the float model's 64-token continuation), where
    KV errors add up over many keys."""
    from jaxserve.bench.dataset import corpus_window, load_tokenizer
    from jaxserve.checkpoint import kv_scales
    from jaxserve.reference import paged_logits

    btok = load_tokenizer(DEFAULT_DIR)
    ids = btok.encode(corpus_window(btok, random.Random(0), 1500), add_special_tokens=False).ids
    gen = ReferenceGenerator(cfg, params, max_len=len(ids) + tokens)
    long = [(ids, list(gen.stream(ids, tokens, temperature=0.0, seed=0, stop_ids=())))]
    # fp8 scales calibrated as `jaxserve convert --kv-calibration` does, on 2,048 tokens of another
    # passage of the same documentation corpus
    calibration = btok.encode(corpus_window(btok, random.Random(1), 2048), add_special_tokens=False).ids
    # (the scales alone: Hadamard-rotated keys; then with the key transforms)
    hadamard_scales, _ = kv_scales.calibrate(params, cfg, calibration, balance=False)
    scales, keys = kv_scales.calibrate(params, cfg, calibration)
    balanced = kv_scales.with_key_transforms(params, keys)
    kinds = [("int8", "int8", None, params), ("fp8_e4m3", "fp8_e4m3", None, params),
             ("fp8_e5m2", "fp8_e5m2", None, params),
             ("fp8_e4m3 calibrated scales", "fp8_e4m3", hadamard_scales, params),
             ("fp8_e5m2 calibrated scales", "fp8_e5m2", hadamard_scales, params),
             ("fp8_e4m3 calibrated scales and keys", "fp8_e4m3", scales, balanced),
             ("fp8_e5m2 calibrated scales and keys", "fp8_e5m2", scales, balanced)]
    for case, group in (("chat prompts", seqs), ("1,500-token passage", long)):
        refs = [paged_logits(params, cfg, i + o) for i, o in group]
        for label, kv, kv_scale, kv_params in kinds:
            agree = total = every = every_total = 0
            worst, kl = 0.0, []
            for (i, o), ref in zip(group, refs):
                got = paged_logits(kv_params, cfg, i + o, kv, kv_scales=kv_scale)
                tail = slice(len(i) - 1, len(i) - 1 + len(o))
                agree += int(np.sum(got[tail].argmax(-1) == ref[tail].argmax(-1)))
                total += len(o)
                every += int(np.sum(got[:-1].argmax(-1) == ref[:-1].argmax(-1)))
                every_total += len(i) + len(o) - 1
                worst = max(worst, float(np.abs(got[tail] - ref[tail]).max()))
                kl.append(kl_divergence(ref[:-1], got[:-1]))
            print(f"KV cache {label}, {case}: top-1 agreement with the float32 cache {agree / total:.1%} "
                  f"({agree}/{total} continuation tokens), {every / every_total:.1%} over every position "
                  f"({every_total}), mean KL there {np.concatenate(kl).mean():.4f}; largest logit difference "
                  f"{worst:.3f}")


if __name__ == "__main__":
    sys.exit(main())
