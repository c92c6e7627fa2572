#!/usr/bin/env python
"""Prefix caching, measured: multi-turn chat with and without it, against llama-server, and
its cost when nothing hits. One run, one machine.

    python scripts/bench_prefix.py                       # everything below, ~15 min on 2 cores
    python scripts/bench_prefix.py --skip llama-server   # jaxserve only

1. Multi-turn (`jaxserve bench --dataset multi-turn`): 8 conversations at concurrency 8,
   4 turns each, one shared 1,000-token system prompt, 64-token user messages, 64-token
   answers (greedy, EOS ignored), against jaxserve with prefix caching, jaxserve with
   `--no-enable-prefix-caching`, and llama-server (8 slots of 2,048 tokens; it keeps each
   slot's last prompt and reuses its common prefix). TTFT of turn 1 and of turns 2-4, and
   the hit rate each server reports.
2. Nothing to hit: random 256-token prompts, 128 out, concurrency 16, against both jaxserve
   servers (both up at once, idle while the other is measured), interleaved on, off, on, off,
   ...; each round sends new prompts (seed 100 + round), the same to both servers.

Results go between the bench-prefix markers of BENCHMARKS.md and to benchmarks/prefix.json.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_compare import bench_once, results_table, start_server, stop, write_benchmarks_md  # noqa: E402

from jaxserve.bench import multiturn, report  # noqa: E402
from jaxserve.bench.machine import describe  # noqa: E402

START, END = "<!-- bench-prefix:start -->", "<!-- bench-prefix:end -->"
SERVERS = {"jaxserve, prefix caching": ("jaxserve", []),
           "jaxserve, no prefix caching": ("jaxserve", ["--no-enable-prefix-caching"]),
           "llama-server": ("llama-server", [])}


def start(label: str, out: Path, slots: int, ctx: int):
    name, extra = SERVERS[label]
    return start_server(name, label, extra, slots, ctx, out / f"prefix-{re.sub(r'[^a-z]+', '-', label)}.log")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--system-len", type=int, default=1000)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--answer-len", type=int, default=64)
    ap.add_argument("--random-prompts", type=int, default=32, help="requests per no-hit run (concurrency 16)")
    ap.add_argument("--rounds", type=int, default=3, help="no-hit runs per jaxserve server, interleaved")
    ap.add_argument("--skip", default="", help="comma list: llama-server, no-hit")
    ap.add_argument("--out-dir", default="benchmarks")
    ap.add_argument("--markdown", default="BENCHMARKS.md")
    args = ap.parse_args()
    os.chdir(ROOT)
    skip = set(filter(None, args.skip.split(",")))
    out = Path(args.out_dir)
    out.mkdir(exist_ok=True)
    machine, t_all = describe(), time.monotonic()
    turn_flags = ["--dataset", "multi-turn", "--num-prompts", str(args.conversations), "--max-concurrency",
                  str(args.conversations), "--turns", str(args.turns), "--system-len", str(args.system_len),
                  "--input-len", str(args.user_len), "--output-len", str(args.answer_len), "--warmup", "2"]
    random_flags = ["--num-prompts", str(args.random_prompts), "--max-concurrency", "16", "--input-len", "256",
                    "--output-len", "128", "--warmup", "2"]
    multi, nohit, commands = {}, {}, {}
    on, off = list(SERVERS)[:2]
    procs = {}
    try:
        for label in (on, off):
            procs[label] = start(label, out, 16, 2048)
            commands[label] = procs[label][2]
        for label in (on, off):
            multi[label] = bench_once(procs[label][1], label, *turn_flags)
        if "no-hit" not in skip:
            for i in range(args.rounds):
                for label in (on, off):
                    # new prompts each round (seed i), the same for both servers within a round
                    nohit.setdefault(label, []).append(bench_once(procs[label][1], f"{label} #{i + 1}", *random_flags,
                                                             "--seed", str(100 + i)))
    finally:
        for proc, _, _ in procs.values():
            stop(proc)
    if "llama-server" not in skip:
        label = "llama-server"
        proc, url, commands[label] = start(label, out, args.conversations, 2048)
        try:
            multi[label] = bench_once(url, label, *turn_flags)
        finally:
            stop(proc)
    wall = time.monotonic() - t_all
    report.save_json(out / "prefix.json", {"machine": machine, "multi_turn": multi, "no_hit": nohit,
                                           "commands": {k: shlex.join(v) for k, v in commands.items()}})
    print(multiturn.table(list(multi.values())), file=sys.stderr)
    write_benchmarks_md(markdown(machine, multi, nohit, commands, args, wall), Path(args.markdown), START, END)
    print(f"wrote {args.markdown} and {out}/prefix.json in {wall / 60:.1f} min", file=sys.stderr)
    return 0


def markdown(machine: dict, multi: dict, nohit: dict, commands: dict, args, wall: float) -> str:
    ms = 1e3
    lines = [START, "", "## Prefix caching (issue 17)", "",
             f"One run of `python scripts/bench_prefix.py` on {time.strftime('%Y-%m-%d')}: {machine['cpu']}, "
             f"{machine['cores']} cores ({wall / 60:.1f} min).", "",
             f"Multi-turn chat: {args.conversations} conversations at concurrency {args.conversations}, "
             f"{args.turns} turns each, one shared {args.system_len}-token system prompt, {args.user_len}-token user "
             f"messages, {args.answer_len}-token answers (greedy, EOS ignored); each turn resends the whole "
             "conversation. Hit rate: prompt tokens the server reports cached (jaxserve: "
             "`usage.prompt_tokens_details.cached_tokens`; llama-server: `timings.cache_n`) over prompt tokens.", "",
             "| server | requests | output tok/s | TTFT turn 1 p50 (ms) | TTFT turns 2-4 p50 (ms) | turns 2-4 p99 "
             "| TPOT p50 (ms) | hit rate |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for label, r in multi.items():
        hit = "n/a" if r["cache_hit_rate"] is None else f"{100 * r['cache_hit_rate']:.1f} %"
        lines.append(f"| {label} | {r['completed']}/{r['num_prompts']} | {r['output_throughput']:.1f} "
                     f"| {r['ttft_by_turn'][1]['p50'] * ms:.0f} | {r['ttft_later_turns']['p50'] * ms:.0f} "
                     f"| {r['ttft_later_turns']['p99'] * ms:.0f} | {r['tpot']['p50'] * ms:.1f} | {hit} |")
    on, off = list(SERVERS)[:2]
    if on in multi and off in multi:
        ratio = multi[on]["ttft_later_turns"]["p50"] / multi[off]["ttft_later_turns"]["p50"]
        lines += ["", f"TTFT p50 of turns 2-4, caching on / off: **{ratio:.3f}x**."]
        if "llama-server" in multi:
            vs = multi[on]["ttft_later_turns"]["p50"] / multi["llama-server"]["ttft_later_turns"]["p50"]
            tput = multi[on]["output_throughput"] / multi["llama-server"]["output_throughput"]
            lines.append(f"jaxserve with caching against llama-server: TTFT p50 of turns 2-4 {vs:.2f}x, "
                         f"output throughput {tput:.2f}x.")
    if nohit:
        lines += ["", "Nothing to hit: random 256-token prompts, 128 out, concurrency 16, "
                  f"{args.random_prompts} requests a run, the two jaxserve servers interleaved, new prompts "
                  "each round (the same for both servers):", "",
                  *results_table("run", {r["label"]: [r] for runs in zip(*nohit.values()) for r in runs})]
        mean = {k: sum(r["output_throughput"] for r in v) / len(v) for k, v in nohit.items()}
        lines += ["", f"Output throughput, caching on / off (mean of {args.rounds} runs each): "
                  f"**{mean[on] / mean[off]:.3f}x**."]
    lines += ["", "Servers: " + "; ".join(f"{k}: `{shlex.join(v)}`" for k, v in commands.items()), "", END]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
