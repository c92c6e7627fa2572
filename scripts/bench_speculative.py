#!/usr/bin/env python
"""Speculative decoding (n-gram prompt lookup), measured: on against off against llama-server.

    python scripts/bench_speculative.py                       # everything below
    python scripts/bench_speculative.py --skip llama-server   # jaxserve only

1. Grounded, single stream: `jaxserve bench --dataset grounded --endpoint chat` (copy out a
   passage of --input-len tokens, lightly edited; --output-len tokens, greedy, EOS ignored),
   one request at a time, against jaxserve with `--speculative-method ngram`, jaxserve
   without, and llama-server; output tok/s and the acceptance rate jaxserve's /metrics report.
   The two jaxserve servers run side by side (one request at a time in all, so the idle one
   costs nothing) and take turns: --rounds rounds of --prompts / --rounds requests each (by
   default one), new prompts every round, the order alternating. This machine has slow spells
   of seconds to minutes in which a step takes up to 3x its usual time; taking turns puts both
   sides in the same minutes, so the ratio measures speculation rather than the spells. Each
   side's output tok/s is all its tokens over all its time; beside it, each round's on / off
   ratio (the same prompts, back to back) and their median, which a spell in one turn moves
   little.
2. Ordinary load: `--dataset fixed` 256-token prompts, 128 out, concurrency 64, against both
   jaxserve servers (--load-repeats rounds, each starting both servers, the order alternating,
   compared by their mean): speculation must turn itself off where it does not pay.

Both jaxserve servers use configs/server.toml; under load (2.) they run one after the other
(this machine has two cores). Results go between the bench-speculative markers of BENCHMARKS.md and to
benchmarks/speculative.json.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_compare import bench_once, start_server, stop, write_benchmarks_md  # noqa: E402

from jaxserve.bench import report  # noqa: E402
from jaxserve.bench.machine import describe  # noqa: E402
from jaxserve.config import SpeculativeConfig  # noqa: E402

START, END = "<!-- bench-speculative:start -->", "<!-- bench-speculative:end -->"
ON, OFF, LLAMA = "jaxserve, ngram speculation", "jaxserve, no speculation", "llama-server"
SERVERS = {ON: ("jaxserve", ["--speculative-method", "ngram"]), OFF: ("jaxserve", []), LLAMA: ("llama-server", [])}


def start(label: str, out: Path):
    name, extra = SERVERS[label]
    return start_server(name, label, extra, 64, 2048, out / f"speculative-{re.sub(r'[^a-z]+', '-', label)}.log")


def spec_counters(url: str) -> dict[str, float]:
    """vllm:spec_decode_* totals from a jaxserve server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            if s.name.startswith("vllm:spec_decode_") and s.name.endswith("_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="grounded requests, one at a time")
    ap.add_argument("--rounds", type=int, default=8, help="turns the two jaxserve servers take at the grounded run")
    ap.add_argument("--input-len", type=int, default=192)
    ap.add_argument("--output-len", type=int, default=192)
    ap.add_argument("--load-prompts", type=int, default=128, help="requests of the concurrency-64 run")
    ap.add_argument("--load-repeats", type=int, default=2, help="concurrency-64 rounds (both servers each)")
    ap.add_argument("--num-speculative-tokens", type=int, default=8, help="the speculating server's K")
    ap.add_argument("--skip", default="", help="comma list: llama-server, load")
    ap.add_argument("--out-dir", default="benchmarks")
    ap.add_argument("--markdown", default="BENCHMARKS.md")
    args = ap.parse_args()
    SERVERS[ON] = ("jaxserve", ["--speculative-method", "ngram", "--num-speculative-tokens",
                                str(args.num_speculative_tokens)])
    os.chdir(ROOT)
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out_dir)
    out.mkdir(exist_ok=True)
    machine, t_all = describe(), time.monotonic()
    if args.prompts % args.rounds:
        ap.error("--prompts must be a multiple of --rounds")
    grounded = ["--dataset", "grounded", "--endpoint", "chat", "--num-prompts", str(args.prompts // args.rounds),
                "--max-concurrency", "1", "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    load = ["--num-prompts", str(args.load_prompts), "--max-concurrency", "64", "--input-len", "256",
            "--output-len", "128", "--warmup", "2"]
    single, rounds, heavy, accept, commands = {}, {ON: [], OFF: []}, {}, {}, {}
    servers = {}
    try:
        for label in (ON, OFF):
            servers[label] = start(label, out)
            commands[label] = servers[label][2]
        before = spec_counters(servers[ON][1])
        for r in range(args.rounds):
            for label in in_turn(r):
                warm = ["--warmup", "1" if r == 0 else "0"]  # each server's first turn warms it
                rounds[label].append(bench_once(servers[label][1], label, *grounded, *warm, "--seed", str(r)))
        after = spec_counters(servers[ON][1])
        accept[ON] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    finally:
        for proc, _, _ in servers.values():
            stop(proc)
    for label, runs in rounds.items():
        single[label] = combined(runs)
    if "llama-server" not in skip:
        proc, url, commands[LLAMA] = start(LLAMA, out)
        try:
            single[LLAMA] = combined([bench_once(url, LLAMA, *grounded, "--warmup", "1" if r == 0 else "0", "--seed", str(r))
                                      for r in range(args.rounds)])
        finally:
            stop(proc)
    # The load ratio's two sides differ by a few %, about this machine's run-to-run spread: each
    # round starts both servers afresh, the other one first in the next round, on new prompts.
    for r in range(0 if "load" in skip else args.load_repeats):
        for label in in_turn(r):
            proc, url, commands[label] = start(label, out)
            try:
                heavy.setdefault(label, []).append(bench_once(url, label, *load, "--seed", str(r)))
            finally:
                stop(proc)
    wall = time.monotonic() - t_all
    report.save_json(out / "speculative.json", {"machine": machine, "grounded": single, "grounded_rounds": rounds,
                                                "load": heavy,
                                                "acceptance": accept,
                                                "commands": {k: shlex.join(v) for k, v in commands.items()}})
    write_benchmarks_md(markdown(machine, single, heavy, accept, commands, args, wall), Path(args.markdown),
                        START, END)
    print(f"wrote {args.markdown} and {out}/speculative.json in {wall / 60:.1f} min", file=sys.stderr)
    return 0


def in_turn(r: int) -> tuple[str, str]:
    """The two jaxserve servers in round r's order: who goes first alternates."""
    return (ON, OFF) if r % 2 == 0 else (OFF, ON)


def combined(runs: list[dict]) -> dict:
    """Rounds of one server as one result: output tok/s is all their tokens over all their time;
    the latency figures are the median of the rounds' p50s (each round has few requests)."""
    tokens, seconds = sum(r["output_tokens"] for r in runs), sum(r["duration_s"] for r in runs)
    return {"output_tokens": tokens, "duration_s": seconds, "output_throughput": tokens / seconds,
            "rounds": [r["output_throughput"] for r in runs],
            "ttft": {"p50": statistics.median(r["ttft"]["p50"] for r in runs)},
            "tpot": {"p50": statistics.median(r["tpot"]["p50"] for r in runs)}}


def markdown(machine: dict, single: dict, heavy: dict, accept: dict, commands: dict, args, wall: float) -> str:
    ms = 1e3
    lines = [START, "", "## Speculative decoding: n-gram prompt lookup (issue 20)", "",
             f"One run of `python scripts/bench_speculative.py` on {time.strftime('%Y-%m-%d')}: {machine['cpu']}, "
             f"{machine['cores']} cores ({wall / 60:.1f} min).", "",
             f"Grounded, one request at a time: {args.prompts} chat requests that each give a {args.input_len}-token "
             "passage and ask for it copied out again, lightly edited (`jaxserve bench --dataset grounded`), "
             f"{args.output_len} tokens out, greedy, EOS ignored; in {args.rounds} rounds of "
             f"{args.prompts // args.rounds} request(s), new prompts each round. The two jaxserve servers ran side by "
             "side and took turns (the order alternating per round); llama-server ran the same rounds after them. "
             "Output tok/s: all of a server's tokens over all its time; TTFT and TPOT: the median of the rounds' p50s.", "",
             "| server | output tok/s | per round | TTFT p50 (ms) | TPOT p50 (ms) |",
             "| --- | ---: | --- | ---: | ---: |"]
    for label, r in single.items():
        per_round = " / ".join(f"{x:.1f}" for x in r["rounds"])
        lines.append(f"| {label} | {r['output_throughput']:.1f} | {per_round} | {r['ttft']['p50'] * ms:.0f} "
                     f"| {r['tpot']['p50'] * ms:.1f} |")
    if ON in single and OFF in single:
        lines += ["", f"Output tok/s, speculation on / off: **{single[ON]['output_throughput'] / single[OFF]['output_throughput']:.2f}x**"
                  + (f"; on / llama-server: **{single[ON]['output_throughput'] / single[LLAMA]['output_throughput']:.2f}x**"
                     if LLAMA in single else "") + "."]
        paired = [a / b for a, b in zip(single[ON]["rounds"], single[OFF]["rounds"])]
        lines.append(f"On / off per round (the same prompts, back to back): {' / '.join(f'{x:.2f}' for x in paired)}; "
                     f"median **{statistics.median(paired):.2f}x**.")
    if accept.get(ON):
        a = accept[ON]
        drafted = a.get("vllm:spec_decode_num_draft_tokens_total", 0)
        rate = a.get("vllm:spec_decode_num_accepted_tokens_total", 0) / drafted if drafted else float("nan")
        lines.append(f"Acceptance (from /metrics over the grounded run): {a.get('vllm:spec_decode_num_drafts_total', 0):.0f} "
                     f"verified drafts, {drafted:.0f} draft tokens, {100 * rate:.1f} % accepted.")
    if heavy:
        lines += ["", "Ordinary load: 256-token prompts, 128 out, concurrency 64 (speculation turns itself off "
                  f"above {SpeculativeConfig().disable_above_batch_size} running sequences):", "",
                  "| server | run | output tok/s | TPOT p50 (ms) |", "| --- | ---: | ---: | ---: |"]
        for label, runs in heavy.items():
            lines += [f"| {label} | {i} | {r['output_throughput']:.1f} | {r['tpot']['p50'] * ms:.1f} |"
                      for i, r in enumerate(runs, 1)]
        if ON in heavy and OFF in heavy:
            mean = {k: sum(r["output_throughput"] for r in heavy[k]) / len(heavy[k]) for k in (ON, OFF)}
            lines += ["", f"Mean throughput at concurrency 64 over {len(heavy[ON])} runs each, on / off: "
                      f"**{mean[ON] / mean[OFF]:.3f}x**."]
    lines += ["", "Servers: " + "; ".join(f"{k}: `{shlex.join(v)}`" for k, v in commands.items()), "", END]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
