#!/usr/bin/env python
"""Time the Pallas kernels against their XLA references and jax's bundled paged attention.

    python scripts/bench_kernels.py [--quick] [--json F]

For a GPU (on a CPU every Pallas kernel would run in interpret mode, which measures
nothing; the script says so and times only the XLA references there). Decode
attention over block tables for batch sizes x context lengths at Llama-3-8B's head
layout (32 query / 8 KV heads, head_dim 128, bfloat16, page 16), against the gathering
XLA reference and `jax.experimental.pallas.ops.gpu.paged_attention`; int8 and int4
weight-only matmuls at 4096 x 14336 for 1 to 256 rows against dequantize-then-dot.
Prints time, achieved GB/s (bytes the kernel must read) and TFLOP/s, and the fraction
of the device's peak when --peak-gbps / --peak-tflops are given (H200: 4800 GB/s, 989
dense bf16 TFLOP/s).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pallas_kernels.paged_attention import paged_decode_attention  # noqa: E402
from pallas_kernels.paged_attention.ref import paged_attention_ref  # noqa: E402
from jaxserve.layers.attention import quantize_int8 as quantize_kv  # noqa: E402
from pallas_kernels.quantized_matmul import (int4_matmul, int4_matmul_ref, int8_matmul, int8_matmul_ref,  # noqa: E402
                                             quantize_int4, quantize_int8)


def timed(fn, *args, repeats: int = 20) -> float:
    jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def attention_rows(on_gpu: bool, quick: bool):
    Hq, K, D, PS = 32, 8, 128, 16
    dt = jnp.bfloat16
    rows = []
    for B in ((1, 8) if quick else (1, 8, 32, 64)):
        for ctx in ((512, 2048) if quick else (512, 2048, 8192)):
            P = ctx // PS
            NP = B * P
            key = jax.random.key(0)
            k = jax.random.normal(key, (1, NP, PS, K, D), dt)
            v = jax.random.normal(jax.random.key(1), (1, NP, PS, K, D), dt)
            q = jax.random.normal(jax.random.key(2), (B, Hq, D), dt)
            tables = jnp.arange(NP, dtype=jnp.int32).reshape(B, P)
            lens = jnp.full((B,), ctx, jnp.int32)
            nbytes = 2 * B * ctx * K * D * 2
            flops = 4 * B * Hq * ctx * D
            impls = {"xla-ref": jax.jit(lambda q, k, v, t, n: paged_attention_ref(q[:, None], k, v, t, n,
                                                                                   (n - 1)[:, None])[:, 0])}
            if on_gpu:
                from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention as bundled

                impls["pallas"] = jax.jit(lambda q, k, v, t, n: paged_decode_attention(q, k, v, t, n, 0))
                # the bundled op's layout: k/v [K, NP, PS, D], q [B, Hq, D]
                kb, vb = k[0].transpose(2, 0, 1, 3), v[0].transpose(2, 0, 1, 3)
                impls["jax-bundled"] = jax.jit(lambda q, k, v, t, n: bundled(q, kb, vb, t, n, pages_per_compute_block=8))
            for name, fn in impls.items():
                s = timed(fn, q, k, v, tables, lens)
                rows.append({"kernel": "decode_attention", "impl": name, "B": B, "ctx": ctx, "ms": s * 1e3,
                             "GBps": nbytes / s / 1e9, "TFLOPs": flops / s / 1e12})
            if on_gpu:  # the int8 KV cache's pages (float16 scale per token and head) against bf16's
                (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
                fn = jax.jit(lambda q, k, v, t, n, ks, vs: paged_decode_attention(q, k, v, t, n, 0, k_scales=ks,
                                                                                    v_scales=vs))
                s = timed(fn, q, k8, v8, tables, lens, ks, vs)
                q8_bytes = 2 * B * ctx * K * (D + 2)
                rows.append({"kernel": "decode_attention", "impl": "pallas-int8-kv", "B": B, "ctx": ctx,
                             "ms": s * 1e3, "GBps": q8_bytes / s / 1e9, "TFLOPs": flops / s / 1e12})
    return rows


def matmul_rows(on_gpu: bool, quick: bool):
    K, N = 4096, 14336
    w = jax.random.normal(jax.random.key(3), (K, N), jnp.float32) * 0.02
    q8, s8 = quantize_int8(w)
    q4, s4, z4 = quantize_int4(w)
    rows = []
    for M in ((1, 64) if quick else (1, 16, 64, 256)):
        x = jax.random.normal(jax.random.key(4), (M, K), jnp.bfloat16)
        cases = {("int8", "xla-ref"): (jax.jit(int8_matmul_ref), (x, q8, s8), K * N),
                 ("int4", "xla-ref"): (jax.jit(int4_matmul_ref), (x, q4, s4, z4), K * N // 2)}
        if on_gpu:
            cases[("int8", "pallas")] = (int8_matmul, (x, q8, s8), K * N)
            cases[("int4", "pallas")] = (int4_matmul, (x, q4, s4, z4), K * N // 2)
        for (kind, impl), (fn, args, nbytes) in cases.items():
            s = timed(fn, *args)
            rows.append({"kernel": f"{kind}_matmul", "impl": impl, "M": M, "ms": s * 1e3, "GBps": nbytes / s / 1e9,
                         "TFLOPs": 2 * M * K * N / s / 1e12})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--peak-gbps", type=float)
    ap.add_argument("--peak-tflops", type=float)
    args = ap.parse_args()
    on_gpu = jax.default_backend() == "gpu"
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()})")
    if not on_gpu:
        print("no GPU: Pallas kernels would run in interpret mode; timing the XLA references only")
    rows = attention_rows(on_gpu, args.quick) + matmul_rows(on_gpu, args.quick)
    for r in rows:
        shape = f"B={r['B']} ctx={r['ctx']}" if "B" in r else f"M={r['M']}"
        extra = ""
        if args.peak_gbps:
            extra += f" ({r['GBps'] / args.peak_gbps:.0%} of {args.peak_gbps:.0f} GB/s)"
        if args.peak_tflops:
            extra += f" ({r['TFLOPs'] / args.peak_tflops:.1%} of {args.peak_tflops:.0f} TFLOP/s)"
        print(f"{r['kernel']:>17} {r['impl']:>12} {shape:>18}: {r['ms']:8.3f} ms {r['GBps']:8.1f} GB/s "
              f"{r['TFLOPs']:7.2f} TFLOP/s{extra}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
