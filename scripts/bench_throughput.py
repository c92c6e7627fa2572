#!/usr/bin/env python
"""Offline throughput benchmark of the batch engine, with physical numbers.

    python scripts/bench_throughput.py [--model DIR] [--num-prompts 64] [--concurrency 64]

Three parts, all on the same engine:
  1. the machine: memory bandwidth (numpy copy) and fp32 matmul peak (jax, 2048^3),
  2. decode scaling: one sequence alone, then `--concurrency` sequences decoding
     together; aggregate decode tok/s of each, over the decode steps in which all of
     them decode (the ramp-up, while prefills of 4 prompts at a time interleave with
     decode steps of fewer sequences, is reported apart); each step timed on the host,
     including the device->host copy of the sampled ids,
  3. a seeded random workload: `--num-prompts` requests with prompt and output lengths
     drawn uniformly from the given ranges, EOS ignored, all submitted at once; reports
     generated and total tok/s.
The engine takes `--config`'s [engine] settings (default: the serving preset, int8 weights)
with the sizes given here, and runs single decode steps. Each decode line also gives decode
attention alone (all layers, with the engine's attention kernel: on a CPU the C++ kernel over the
sequences' pages, with attention_impl "xla" K/V gathered over the context bucket) and its share
of the step.
Achieved weight bandwidth = parameter bytes x decode steps / decode time (each step
reads every weight once); GFLOP/s = 2 x parameters x tokens / time (attention excluded).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.bench.machine import matmul_gflops, memcpy_gbps
from jaxserve.config import load_config_file
from jaxserve.default_model import DEFAULT_DIR
from jaxserve.engine.engine import Engine
from jaxserve.engine.sequence import SamplingParams


def machine_peaks() -> dict:
    return {"memcpy_GBps": memcpy_gbps(), "matmul_fp32_GFLOPs": matmul_gflops()}


class StepTimer:
    """Runs the engine to completion, timing decode and prefill steps apart."""

    def __init__(self, engine: Engine, full: int = 0):
        self.engine = engine
        self.full = full  # decode steps with exactly this many sequences are also timed apart

    def run(self) -> dict:
        eng = self.engine
        t = {"decode_s": 0.0, "decode_tokens": 0, "decode_steps": 0, "prefill_s": 0.0, "prefill_tokens": 0,
             "full_step_s": []}
        t0 = time.perf_counter()
        while eng.has_unfinished:
            batch = eng.scheduler.schedule()
            if batch is None:
                continue
            s = time.perf_counter()
            result = eng.runner.run(batch.items, batch.decode)
            dt = time.perf_counter() - s
            eng.postprocess(batch.items, result)
            if batch.decode:
                t["decode_s"] += dt
                t["decode_tokens"] += len(batch.items)
                t["decode_steps"] += 1
                if len(batch.items) == self.full:
                    t["full_step_s"].append(dt)
            else:
                t["prefill_s"] += dt
                t["prefill_tokens"] += sum(it.length for it in batch.items)
        t["wall_s"] = time.perf_counter() - t0
        return t


def attention_ms(engine: Engine, batch: int, context: int, repeats: int = 5) -> float:
    """Median ms of decode attention alone for `batch` sequences of `context` tokens, all layers,
    over the engine's cache (random pages, without the cache write), with the engine's kernel:
    the C++ kernel reading pages in place ("cpu"), or K/V pages gathered over the context bucket
    and attended as the XLA decode step does."""
    from jaxserve.layers.attention import AttentionMetadata, attend_pages

    runner, cfg = engine.runner, engine.model_cfg
    k_cache, v_cache = runner.kv_cache
    L, NP, PS = k_cache.shape[:3]
    P = min(p for p in runner.context_page_buckets if p * PS >= context)
    rng = np.random.default_rng(0)
    tables = jnp.asarray(rng.permutation(NP)[:batch * P].reshape(batch, P), jnp.int32)
    q = jnp.asarray(rng.standard_normal((batch, 1, cfg.num_heads, cfg.head_dim), dtype=np.float32))
    lens = jnp.full((batch,), context, jnp.int32)
    meta = AttentionMetadata(positions=lens[:, None] - 1, context_lens=lens, block_tables=tables,
                             attention_impl=runner.attention_impl)

    @jax.jit
    def run(q, k_cache, v_cache):
        def layer(x, i):
            return x + attend_pages(q + x, (k_cache, v_cache), meta, i), None
        return jax.lax.scan(layer, jnp.zeros_like(q), jnp.arange(L))[0]

    run(q, k_cache, v_cache).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run(q, k_cache, v_cache).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def decode_run(engine: Engine, n: int, prompt_len: int, out_len: int, seed: int) -> dict:
    rng = random.Random(seed)
    for _ in range(n):
        engine.add_request([rng.randrange(100, 40000) for _ in range(prompt_len)],
                           SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
    return StepTimer(engine, full=n).run()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_DIR))
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", default="32,256", help="min,max prompt tokens")
    ap.add_argument("--output-len", default="32,192", help="min,max output tokens")
    ap.add_argument("--decode-prompt-len", type=int, default=256, help="the serving benchmark's prompts")
    ap.add_argument("--decode-output-len", type=int, default=128)
    ap.add_argument("--config", default="configs/server.toml",
                    help="[engine] settings (quantization, buckets) of this preset, with the sizes above")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--attention-impl", choices=("auto", "xla", "cpu"), help="replace the preset's attention kernel")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)

    peaks = machine_peaks()
    print(f"machine: memcpy {peaks['memcpy_GBps']:.1f} GB/s, fp32 matmul {peaks['matmul_fp32_GFLOPs']:.1f} GFLOP/s")

    _, preset = load_config_file(args.config)
    cfg = dataclasses.replace(
        preset, max_num_seqs=args.concurrency, max_model_len=args.max_model_len,
        decode_batch_buckets=tuple(b for b in preset.decode_batch_buckets if b < args.concurrency) + (args.concurrency,),
        context_buckets=tuple(c for c in preset.context_buckets if c < args.max_model_len) + (args.max_model_len,),
        attention_impl=args.attention_impl or preset.attention_impl)
    t0 = time.perf_counter()
    engine = Engine(args.model, cfg)
    n_params = sum(a.size for a in jax.tree.leaves(engine.runner.params))
    param_bytes = sum(a.nbytes for a in jax.tree.leaves(engine.runner.params))
    print(f"engine: {n_params / 1e6:.1f}M parameters ({param_bytes / 1e9:.2f} GB), {engine.pool.num_pages} pages, "
          f"{len(engine.runner.buckets())} step buckets compiled in {engine.compile_seconds:.1f}s "
          f"(start-up {time.perf_counter() - t0:.1f}s); attention {engine.runner.attention_impl}")

    results = {"peaks": peaks, "compile_s": engine.compile_seconds, "params": n_params}
    for n in (1, args.concurrency):
        r = decode_run(engine, n, args.decode_prompt_len, args.decode_output_len, args.seed)
        # Steady state: the median step while all n sequences decode (the median, because
        # this machine's other tenants make a few steps several times slower).
        step_s = float(np.median(r["full_step_s"]))
        r["full_steps"] = len(r["full_step_s"])
        tps = n / step_s
        gbps = param_bytes / step_s / 1e9
        gflops = 2 * n_params * tps / 1e9
        results[f"decode_{n}"] = {"tok_s": tps, "step_ms": step_s * 1e3, "weight_GBps": gbps, "GFLOPs": gflops,
                                  "full_steps": r["full_steps"], "all_decode_tok_s": r["decode_tokens"] / r["decode_s"]}
        # Attention alone at the middle of the decode contexts, the bucket most steps read.
        attn = attention_ms(engine, n, args.decode_prompt_len + args.decode_output_len // 2)
        results[f"decode_{n}"]["attention_ms"] = attn
        print(f"decode x{n:<3d}: {tps:8.1f} tok/s, {step_s * 1e3:6.1f} ms/step over {r['full_steps']} steps with "
              f"all {n} decoding, weights {gbps:5.1f} GB/s ({gbps / peaks['memcpy_GBps']:.0%} of memcpy), "
              f"{gflops:6.1f} GFLOP/s ({gflops / peaks['matmul_fp32_GFLOPs']:.0%} of matmul peak); "
              f"{r['decode_tokens'] / r['decode_s']:.1f} tok/s over all {r['decode_steps']} decode steps; "
              f"attention alone {attn:.1f} ms = {attn / (step_s * 1e3):.0%} of a step")
    print(f"(step times vary: x{args.concurrency} steps p10-p90 "
          f"{np.percentile(r['full_step_s'], 10) * 1e3:.0f}-{np.percentile(r['full_step_s'], 90) * 1e3:.0f} ms)")
    ratio = results[f"decode_{args.concurrency}"]["tok_s"] / results["decode_1"]["tok_s"]
    results["decode_scaling"] = ratio
    print(f"decode scaling: x{args.concurrency} aggregate / x1 = {ratio:.1f}x")

    rng = random.Random(args.seed)
    pmin, pmax = map(int, args.prompt_len.split(","))
    omin, omax = map(int, args.output_len.split(","))
    n_in = n_out = 0
    for _ in range(args.num_prompts):
        p, o = rng.randint(pmin, pmax), rng.randint(omin, omax)
        engine.add_request([rng.randrange(100, 40000) for _ in range(p)],
                           SamplingParams(max_tokens=o, temperature=0, ignore_eos=True))
        n_in, n_out = n_in + p, n_out + o
    r = StepTimer(engine).run()
    results["workload"] = {"requests": args.num_prompts, "prompt_tokens": n_in, "output_tokens": n_out,
                           "wall_s": r["wall_s"], "output_tok_s": n_out / r["wall_s"],
                           "total_tok_s": (n_in + n_out) / r["wall_s"], "prefill_s": r["prefill_s"],
                           "decode_s": r["decode_s"], "preemptions": engine.scheduler.num_preemptions}
    w = results["workload"]
    print(f"workload: {args.num_prompts} requests, prompts {pmin}-{pmax}, outputs {omin}-{omax} tokens: "
          f"{w['output_tok_s']:.1f} generated tok/s, {w['total_tok_s']:.1f} total tok/s in {w['wall_s']:.1f}s "
          f"(prefill {w['prefill_s']:.1f}s, decode {w['decode_s']:.1f}s, {w['preemptions']} preemptions)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
