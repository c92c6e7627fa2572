#!/usr/bin/env python
"""End-to-end generation with attention/matmul `pallas` against `xla`, on random weights.

    python scripts/device_e2e.py [--shapes smollm2-135m,llama-3-8b] [--tokens 32] [--interpret]
                                 [--tensor-parallel N]

For the GPU check (scripts/device_check.sh), where no checkpoint can be carried: each
model is built with random weights at a real model's shapes (SmolLM2-135M; Llama-3-8B,
bfloat16, 4 layers unless --full-depth), run through the engine's ModelRunner (paged
KV cache, bucketed prefill and decode steps) greedily for a batch of prompts with
attention_impl = matmul_impl = "xla" and then "pallas", int8 weights too; prints
whether the tokens agree and the decode step time of each. With --tensor-parallel N > 1 the
pallas and xla runs are split over N devices (layers/parallel.py) and compared with xla on one.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve.checkpoint.quantize import quantize_params  # noqa: E402
from jaxserve.config import EngineConfig, ModelConfig  # noqa: E402
from jaxserve.engine.pages import PagePool  # noqa: E402
from jaxserve.engine.runner import ModelRunner, ScheduledItem, _bucket  # noqa: E402
from jaxserve.engine.sequence import SamplingParams, Sequence  # noqa: E402
from jaxserve.layers import parallel  # noqa: E402

SHAPES = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, dtype="float32"),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=4,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False, dtype="bfloat16"),
}


def random_params(cfg: ModelConfig, dtype) -> dict:
    rng = np.random.default_rng(0)
    D, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    Hq, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    def w(*shape, s=0.05):
        return (rng.standard_normal(shape, np.float32) * s).astype(dtype)

    p = {"embed": w(V, D, s=1.0), "final_norm": np.ones(D, dtype),
         "layers": {"attn_norm": np.ones((L, D), dtype), "mlp_norm": np.ones((L, D), dtype),
                    "wq": w(L, D, Hq * Dh), "wk": w(L, D, K * Dh), "wv": w(L, D, K * Dh), "wo": w(L, Hq * Dh, D),
                    "w_gate": w(L, D, F), "w_up": w(L, D, F), "w_down": w(L, F, D)}}
    if not cfg.tie_word_embeddings:
        p["lm_head"] = w(D, V)
    return p


def generate(cfg: ModelConfig, params: dict, dtype: str, impl: str, interpret: bool, prompts, tokens: int,
             tp: int = 1):
    ecfg = EngineConfig(max_num_seqs=8, max_model_len=256, decode_batch_buckets=(8,), context_buckets=(256,),
                        prefill_batch_buckets=(1,), prefill_length_buckets=(64,), num_pages=160, dtype=dtype,
                        attention_impl=impl, matmul_impl=impl, interpret=interpret, compilation_cache_dir=None)
    runner = ModelRunner(cfg, jax.tree.map(jnp.asarray, params), ecfg, ecfg.num_pages, parallel.make_mesh(tp))
    pool = PagePool(ecfg.num_pages, ecfg.page_size)
    seqs = [Sequence(f"r{i}", list(p), SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
            for i, p in enumerate(prompts)]
    for s in seqs:
        s.pages = pool.allocate(-(-(len(s.prompt_ids) + tokens) // ecfg.page_size))
        out = runner.run([ScheduledItem(s, 0, len(s.prompt_ids))], decode=False)
        s.output_ids.append(int(out.tokens[0, 0]))
    step_times = []
    for _ in range(tokens - 1):
        items = [ScheduledItem(s, s.num_tokens - 1, 1) for s in seqs]
        t0 = time.perf_counter()
        out = runner.run(items, decode=True)
        step_times.append(time.perf_counter() - t0)
        for s, t in zip(seqs, out.tokens[:, 0]):
            s.output_ids.append(int(t))
    return [s.output_ids for s in seqs], float(np.median(step_times[1:] or step_times)), modeled_ms(runner, items)


def modeled_ms(runner, items) -> float | None:
    """jaxserve/aot.py's roofline lower bound of the last decode call's bucket and context on this device
    (None where its peaks are not known, e.g. a CPU): the model checked against the measurement."""
    from jaxserve import aot

    peak = aot.peaks(jax.devices()[0].device_kind)
    if peak is None:
        return None
    B = _bucket(len(items), runner.decode_batches)  # as runner._launch_decode picks them for one step
    context = max(it.start for it in items) + 1
    P = _bucket(-(-context // runner.page_size), runner.context_page_buckets)
    return aot.roofline(runner, (B, 0, P), peak, context)["model_ms"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="smollm2-135m,llama-3-8b")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--interpret", action="store_true", help="Pallas in interpret mode (a CPU smoke test)")
    ap.add_argument("--full-depth", action="store_true", help="all 32 layers of Llama-3-8B")
    ap.add_argument("--tensor-parallel", type=int, default=1, metavar="N", help="split both runs over N devices")
    args = ap.parse_args()
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
    ok = True
    for name in args.shapes.split(","):
        spec = dict(SHAPES[name])
        dtype = spec.pop("dtype")
        if args.full_depth and name == "llama-3-8b":
            spec["num_hidden_layers"] = 32
        cfg = ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192,
                                   "rms_norm_eps": 1e-5, "rope_theta": 500000.0, **spec})
        np_dtype = np.float32 if dtype == "float32" else jnp.bfloat16
        params = random_params(cfg, np_dtype)
        rng = np.random.default_rng(1)
        prompts = [rng.integers(10, cfg.vocab_size - 10, n).tolist() for n in (5, 17, 40, 64)]
        for weights, p in (("float", params), ("int8", quantize_params(params, "int8"))):
            tp = args.tensor_parallel
            base, t_one, _ = generate(cfg, p, dtype, "xla", False, prompts, args.tokens)
            runs = {"pallas": generate(cfg, p, dtype, "pallas", args.interpret, prompts, args.tokens, tp)}
            if tp > 1:
                runs["xla"] = generate(cfg, p, dtype, "xla", False, prompts, args.tokens, tp)
            for impl, (got, t, model) in runs.items():
                same = sum(a == b for x, y in zip(base, got) for a, b in zip(x, y))
                total = sum(len(x) for x in base)
                ok &= same == total
                where = f" on {tp} devices" if tp > 1 else ""
                print(f"{name} {weights:>5}: {impl}{where} tokens equal xla on one device {same}/{total}; "
                      f"decode step B=4 xla (one device) {t_one * 1e3:.2f} ms, {impl}{where} {t * 1e3:.2f} ms"
                      + (f" (roofline model of the bucket on one device: {model:.3f} ms)" if model else ""))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
