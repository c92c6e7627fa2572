#!/usr/bin/env python
"""Where speculative decoding stops paying: speculation on against off at growing batch sizes.

    python scripts/bench_spec_batch.py [--batches 1,2,4,8,16] [--datasets grounded,fixed]

For each dataset and batch size b, b chat requests (`jaxserve bench`'s prompts: `grounded`
copies out a passage, lightly edited; `fixed` continues a window of documentation text;
--input-len tokens in, --output-len out, greedy, EOS ignored) are added together to the
offline engine and run to the end, once with n-gram speculation and once without, for
--rounds sets of prompts; output tok/s over all rounds (prefill included) and the ratio. Both engines take
configs/server.toml's [engine] settings (int8 weights) and live in one process, run one
after the other per row; the speculating engine's disable_above_batch_size is lifted above
every b so that it speculates at all of them. Where the ratio falls under 1 is where
`disable_above_batch_size` belongs. Results: between the bench-spec-batch markers of
BENCHMARKS.md and benchmarks/spec_batch.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_compare import write_benchmarks_md  # noqa: E402

from jaxserve.bench import report  # noqa: E402
from jaxserve.bench.dataset import load_tokenizer, synthetic  # noqa: E402
from jaxserve.bench.machine import describe  # noqa: E402
from jaxserve.config import SpeculativeConfig, load_config_file  # noqa: E402
from jaxserve.default_model import DEFAULT_DIR  # noqa: E402
from jaxserve.engine.engine import Engine  # noqa: E402
from jaxserve.engine.sequence import SamplingParams  # noqa: E402

START, END = "<!-- bench-spec-batch:start -->", "<!-- bench-spec-batch:end -->"


def run(engine: Engine, prompts: list[list[int]], output_len: int) -> dict:
    """All prompts at once, to the end: output tokens per second and speculation counts."""
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    before = engine.spec_counts
    t0 = time.perf_counter()
    seqs = [engine.add_request(p, params) for p in prompts]
    engine.run_until_done()
    wall = time.perf_counter() - t0
    rows, drafted, accepted = (a - b for a, b in zip(engine.spec_counts, before))
    out = sum(len(s.output_ids) for s in seqs)
    return {"output_tokens": out, "seconds": wall, "output_tok_s": out / wall, "verify_rows": rows,
            "draft_tokens": drafted, "accepted_tokens": accepted}


def total(runs: list[dict]) -> dict:
    """Several runs summed: output tok/s is all their tokens over all their time."""
    out = {k: sum(r[k] for r in runs) for k in runs[0] if k != "output_tok_s"}
    out["output_tok_s"] = out["output_tokens"] / out["seconds"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(DEFAULT_DIR))
    ap.add_argument("--config", default=str(ROOT / "configs/server.toml"))
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--datasets", default="grounded,fixed")
    ap.add_argument("--input-len", type=int, default=192)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--num-speculative-tokens", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="prompt sets per row (on and off alternate going first)")
    ap.add_argument("--out-dir", default="benchmarks")
    ap.add_argument("--markdown", default="BENCHMARKS.md")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    _, base = load_config_file(args.config)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=args.num_speculative_tokens,
                             disable_above_batch_size=max(batches))
    off = Engine(args.model, base)
    on = Engine(args.model, dataclasses.replace(base, speculative=spec))
    tok = load_tokenizer(args.model)
    machine, t_all, rows = describe(), time.monotonic(), []
    def prompts(dataset: str, n: int, seed: int) -> list[list[int]]:
        return [on.tokenizer.encode_chat(p.messages) for p in synthetic(
            tok, n, args.input_len, args.output_len, kind=dataset, chat=True, seed=seed)]

    warm = prompts("grounded", 2, 0)
    run(off, warm, 32), run(on, warm, 32)
    for dataset in args.datasets.split(","):
        for b in batches:
            r_on, r_off = [], []
            for r in range(args.rounds):  # a new set of b prompts per round; on and off alternate who goes first
                batch = prompts(dataset, b, seed=1000 * b + r)
                pair = [(r_on, on), (r_off, off)]
                for acc, eng in pair if r % 2 == 0 else pair[::-1]:
                    acc.append(run(eng, batch, args.output_len))
            r_on, r_off = total(r_on), total(r_off)
            rows.append({"dataset": dataset, "batch": b, "on": r_on, "off": r_off,
                         "ratio": r_on["output_tok_s"] / r_off["output_tok_s"]})
            print(f"{dataset:9s} b={b:3d}  on {r_on['output_tok_s']:7.1f}  off {r_off['output_tok_s']:7.1f} tok/s  "
                  f"{rows[-1]['ratio']:.2f}x  accepted {r_on['accepted_tokens']}/{r_on['draft_tokens']}",
                  file=sys.stderr, flush=True)
    wall = time.monotonic() - t_all
    out = Path(args.out_dir)
    out.mkdir(exist_ok=True)
    command = "python scripts/bench_spec_batch.py " + " ".join(sys.argv[1:])
    report.save_json(out / "spec_batch.json", {"machine": machine, "rows": rows, "command": command.strip()})
    write_benchmarks_md(markdown(machine, rows, args, command.strip(), wall), Path(args.markdown), START, END)
    print(f"wrote {args.markdown} and {out}/spec_batch.json in {wall / 60:.1f} min", file=sys.stderr)
    return 0


def markdown(machine: dict, rows: list[dict], args, command: str, wall: float) -> str:
    lines = [START, "", "### Where speculation stops paying (disable_above_batch_size)", "",
             f"One run of `{command}` on {time.strftime('%Y-%m-%d')}: {machine['cpu']}, {machine['cores']} cores "
             f"({wall / 60:.1f} min). Offline engine, configs/server.toml's [engine] (int8), b chat requests "
             f"together, {args.rounds} sets of them per row, {args.input_len} tokens in, {args.output_len} out, "
             "greedy, n-gram speculation with "
             f"K = {args.num_speculative_tokens} on at every b against off.", "",
             "| dataset | batch | on (tok/s) | off (tok/s) | on / off | draft tokens accepted |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        d = r["on"]["draft_tokens"]
        acc = f"{100 * r['on']['accepted_tokens'] / d:.0f} % of {d}" if d else "none proposed"
        lines.append(f"| {r['dataset']} | {r['batch']} | {r['on']['output_tok_s']:.1f} | {r['off']['output_tok_s']:.1f} "
                     f"| {r['ratio']:.2f}x | {acc} |")
    lines += ["", END]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
