#!/usr/bin/env python
"""Per GPU target and compiled engine step: the compiler's memory analysis and a roofline model.

    .venv-gpu-aot/bin/python scripts/gpu_aot_report.py [--targets sm_80,sm_90] [--steps all|extremes]
                                                       [--csv benchmarks/gpu_aot_report.csv]

Every step bucket of the engine's default configuration (bfloat16, Pallas kernels, the KV cache
the engine would allocate on the target: aot.num_pages_for) is compiled for A100 and H100 as in
scripts/gpu_aot_check.py, for SmolLM2-135M and a Llama-3-8B-shaped model, bfloat16 and int8
weights. From the compiled executable: argument, output and temporary bytes, and whether they fit
in the memory jax's client takes (aot.CLIENT_MEMORY_FRACTION of the device). Then a model, not a
measurement: a lower bound of the step's time, max(flops / peak FLOP/s, bytes / peak bandwidth)
with the datasheet peaks (aot.roofline says what it counts); tokens/s is the rows a step makes over
that time (a decode call's per-step figure). The Pallas kernels read each sequence's own pages, so
under them the engine compiles one context width (max_model_len) and a step's cost follows its
sequences' contexts: each step is modeled with every sequence at the full width (the worst case)
and at a 256-token context. XLA's own cost analysis is not used: the deviceless GPU compile
does not provide one, and on other backends it counts a loop body (the layer scan) once.
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jaxserve import aot  # noqa: E402

aot.compile_only_environment()  # before any backend starts


SHORT = 256  # a short context (tokens per sequence) at which the summary also models decode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--targets", default=",".join(aot.TARGETS))
    ap.add_argument("--steps", choices=("all", "extremes"), default="all")
    ap.add_argument("--csv", default="benchmarks/gpu_aot_report.csv")
    args = ap.parse_args()
    rows, t_all = [], time.perf_counter()
    for target in args.targets.split(","):
        limit = int(aot.CLIENT_MEMORY_FRACTION * aot.device_memory(target))
        peak = aot.PEAKS[aot.TARGET_KIND[target]]
        for model in aot.MODELS:
            for weights in aot.WEIGHTS:
                runner = aot.step_runner(target, model, weights)
                keys = runner.buckets()
                for key in aot.extreme_buckets(keys) if args.steps == "extremes" else keys:
                    t0 = time.perf_counter()
                    compiled = runner._lower(key).compile(compiler_options=aot.compiler_options(target))
                    mem = compiled.memory_analysis()
                    total = mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes \
                        + mem.temp_size_in_bytes
                    row = dict(target=target, model=model, weights=weights, step=runner._label(key),
                               pages=runner.num_pages, args_gib=mem.argument_size_in_bytes / 2**30,
                               temp_mib=mem.temp_size_in_bytes / 2**20, total_gib=total / 2**30,
                               limit_gib=limit / 2**30, fits=total <= limit,
                               **aot.roofline(runner, key, peak),
                               short_ms=aot.roofline(runner, key, peak, SHORT)["model_ms"],
                               compile_s=time.perf_counter() - t0)
                    rows.append(row)
                    fits = "fits" if row["fits"] else "OVER"
                    print(f"{target} {model} {weights:>8} {row['step']:<26} temp {row['temp_mib']:8.1f} MiB  "
                          f"total {row['total_gib']:5.1f}/{row['limit_gib']:.1f} GiB {fits}"
                          f"  model {row['model_ms']:7.3f} ms {row['tok_s']:10.0f} tok/s ({row['bound']}),"
                          f" {row['short_ms']:7.3f} ms at {SHORT} tokens", flush=True)
    Path(args.csv).parent.mkdir(parents=True, exist_ok=True)
    with open(args.csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows({k: f"{v:.4g}" if isinstance(v, float) else v for k, v in r.items()} for r in rows)
    print(f"\n{len(rows)} steps compiled in {time.perf_counter() - t_all:.0f}s; per-bucket rows in {args.csv}\n")
    summary(rows)
    return 0


def summary(rows: list[dict]) -> None:
    """The markdown summary BENCHMARKS.md carries: per target, model and weights, the step with the
    largest temporaries, the peak memory against the client's, and modeled decode/prefill speeds."""
    print("| target | model | weights | KV pages | largest temporaries (step) | peak memory / client's | "
          f"decode B=1, {SHORT}-token context | decode B=64, full context | prefill, largest bucket |")
    print("|---|---|---|---|---|---|---|---|---|")
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["target"], r["model"], r["weights"]), []).append(r)
    for (target, model, weights), rs in groups.items():
        big = max(rs, key=lambda r: r["temp_mib"])
        peak = max(r["total_gib"] for r in rs)
        dec = [r for r in rs if r["step"].startswith("decode")]
        pre = [r for r in rs if r["step"].startswith("prefill")]
        one = min(dec, key=lambda r: (int(r["step"].split("B=")[1].split()[0]), int(r["step"].split("P=")[1])))
        wide = max(dec, key=lambda r: (int(r["step"].split("B=")[1].split()[0]), int(r["step"].split("P=")[1])))
        fill = max(pre, key=lambda r: r["gflop"])

        def speed(r, ms=None):
            ms = ms or r["model_ms"]
            return f"{ms:.3f} ms, {r['tok_s'] * r['model_ms'] / ms:,.0f} tok/s"
        print(f"| {target} | {model} | {weights} | {rs[0]['pages']:,} | {big['temp_mib']:,.0f} MiB ({big['step']}) | "
              f"{peak:.1f} / {rs[0]['limit_gib']:.1f} GiB | {speed(one, one['short_ms'])} ({one['step']}) | "
              f"{speed(wide)} ({wide['step']}) | "
              f"{speed(fill)} ({fill['step']}) |")


if __name__ == "__main__":
    sys.exit(main())
