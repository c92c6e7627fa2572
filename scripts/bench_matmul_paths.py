#!/usr/bin/env python
"""Which matmul path is fastest at each row count: the numbers behind W8A8_MIN_ROWS.

    python scripts/bench_matmul_paths.py [--rows 1,4,8,16,64,256] [--repeats 15]

A stack shaped like the default model's decoder (30 layers of its seven projections,
d = 576, F = 1536, lax.scan over stacked weights, random weights) run through
`jaxserve.layers.linear.linear` three ways: float32 weights; int8 weights widened inside
the dot ("xla"); W8A8 with the int8 x int8 path forced at every row count; W8A8 over
weights quantized rotated (each matmul's input rotated first: jaxserve/layers/rotation.py),
forced the same way; and that as the engine's "w8a8" runs it ("served": below
W8A8_MIN_ROWS rows the int8 values multiplied exactly in float32, from W8A8_BF16_ROWS in
bfloat16). Then the tied lm_head ([49152, 576]) the same ways.
Median ms per call.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jaxserve.layers.linear as lin  # noqa: E402
from jaxserve.checkpoint.quantize import quantize_params  # noqa: E402
from pallas_kernels.quantized_matmul.ref import quantize_int8  # noqa: E402

L, D, F, HQ, K, DH, V = 30, 576, 1536, 9, 3, 64, 49152
SHAPES = {"wq": (D, HQ * DH), "wk": (D, K * DH), "wv": (D, K * DH), "wo": (HQ * DH, D),
          "w_gate": (D, F), "w_up": (D, F), "w_down": (F, D)}


def stack(impl: str, served: bool = False):
    """The decoder stack, jitted; W8A8 as the engine runs it (`served`: its path picked by row
    count) or with its int8 x int8 dot at every row count, to time that path."""
    mm = functools.partial(lin.linear, impl=impl)

    def body(x, p):
        h = mm(x, p["wq"]) + mm(x, p["wk"]).sum() + mm(x, p["wv"]).sum()
        x = x + mm(h, p["wo"])
        x = x + mm(jax.nn.silu(mm(x, p["w_gate"])) * mm(x, p["w_up"]), p["w_down"])
        return x * 0.5, None

    def run(x, w):  # traced once, on the first call: the thresholds are read while tracing
        saved = lin.W8A8_MIN_ROWS, lin.W8A8_BF16_ROWS
        if not served:
            lin.W8A8_MIN_ROWS, lin.W8A8_BF16_ROWS = 1, 1 << 30
        try:
            return jax.lax.scan(body, x, w)[0]
        finally:
            lin.W8A8_MIN_ROWS, lin.W8A8_BF16_ROWS = saved

    return jax.jit(run)


def median_ms(f, *args, repeats: int) -> float:
    f(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(*args).block_until_ready()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16,64,256")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    wf = {n: jnp.asarray(rng.standard_normal((L, *s), dtype=np.float32) * 0.02) for n, s in SHAPES.items()}
    wq = {}
    for n, w in wf.items():
        parts = [quantize_int8(w[i]) for i in range(L)]
        wq[n] = {"q8": jnp.stack([p[0] for p in parts]), "scale": jnp.stack([p[1] for p in parts])}
    table = jnp.asarray(rng.standard_normal((V, D), dtype=np.float32) * 0.02)
    tq, ts = quantize_int8(table.T)
    tab8 = {"q8": tq.T, "scale": ts}
    rot = quantize_params({"layers": {n: np.asarray(w) for n, w in wf.items()}, "embed": np.asarray(table)}, "int8",
                          rotate=True)
    rot = jax.tree.map(jnp.asarray, rot)
    # The tables are arguments, not closed-over constants: XLA would fold a constant's widening
    # at compile time and time a float32 head under the int8 name.
    head = {"xla": jax.jit(lambda x, t: lin.tied_logits(x, t, "xla")),
            "w8a8": jax.jit(lambda x, t: lin.tied_logits(x, t, "w8a8"))}
    heads = {"float32": (head["xla"], table), "int8 widened": (head["xla"], tab8), "w8a8": (head["w8a8"], tab8),
             "w8a8 rotated": (head["w8a8"], rot["embed"])}
    stacks = {"float32": (stack("xla"), wf), "int8 widened": (stack("xla"), wq), "w8a8": (stack("w8a8"), wq),
              "w8a8 rotated": (stack("w8a8"), rot["layers"]),
              "w8a8 rot. served": (stack("w8a8", served=True), rot["layers"])}
    print(f"{'rows':>5} | " + " ".join(f"{'stack ' + k:>20}" for k in stacks) + " | "
          + " ".join(f"{'head ' + k:>19}" for k in heads) + "   (ms)")
    for rows in map(int, args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, D), dtype=np.float32))
        n = max(3, args.repeats if rows <= 64 else args.repeats // 4)
        s = [median_ms(f, x, w, repeats=n) for f, w in stacks.values()]
        h = [median_ms(f, x, t, repeats=n) for f, t in heads.values()]
        print(f"{rows:>5} | " + " ".join(f"{v:20.1f}" for v in s) + " | " + " ".join(f"{v:19.1f}" for v in h),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
