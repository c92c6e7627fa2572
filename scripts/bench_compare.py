#!/usr/bin/env python
"""jaxserve against the naive server and llama.cpp's llama-server, same machine, same run.

    python scripts/bench_compare.py            # what `make bench-compare` runs
    python scripts/bench_compare.py --servers jaxserve,llama-server --concurrency 1,4

Each server in turn is started on a free loopback port with the same SmolLM2-135M
weights, waited for (/health 200), swept with `jaxserve bench` (same prompts, same
loads: max concurrency 1, 4, 16, 64; prompts of 256 tokens; 128 output tokens; EOS
ignored; greedy), and stopped. Then BENCHMARKS.md gets a side-by-side table (between
its bench-compare markers; the rest of the file is kept), the plot and the raw
results go to benchmarks/, and the machine facts and exact commands are written down.

  jaxserve      jaxserve serve --config configs/server.toml (continuous batching, paged KV)
  naive         scripts/naive_hf_server.py: transformers generate, one request at a time
  llama-server  llama.cpp built by scripts/build_llama_server.sh, -np 64 parallel slots,
                continuous batching, threads = cores, serving the GGUF itself (Q4_1)
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jaxserve.bench import report  # noqa: E402
from jaxserve.bench.machine import describe  # noqa: E402
from jaxserve.bench.run import add_arguments, run_sweep  # noqa: E402
from jaxserve.default_model import DEFAULT_DIR, gguf_path  # noqa: E402

START, END = "<!-- bench-compare:start -->", "<!-- bench-compare:end -->"
PY = sys.executable


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(name: str, port: int, max_slots: int, ctx_per_slot: int) -> list[str]:
    cores = str(os.cpu_count())
    if name == "jaxserve":
        return [str(Path(PY).parent / "jaxserve"), "serve", "--config", "configs/server.toml", "--model",
                str(DEFAULT_DIR), "--port", str(port)]
    if name == "naive":
        return [PY, "scripts/naive_hf_server.py", "--port", str(port), "--threads", cores]
    if name == "llama-server":
        binary = subprocess.run(["scripts/build_llama_server.sh"], cwd=ROOT, check=True,
                                stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
        return [str(ROOT / binary), "-m", str(gguf_path()), "--host", "127.0.0.1", "--port", str(port),
                "-np", str(max_slots), "-c", str(max_slots * ctx_per_slot), "-t", cores, "-tb", cores,
                "--cont-batching", "-a", "smollm2-135m-instruct"]
    raise ValueError(f"unknown server {name!r}")


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 900) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout}s; see {log}")


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def fmt_row(name: str, r: dict) -> str:
    ms = 1e3
    return (f"| {name} | {r['max_concurrency']} | {r['completed']}/{r['num_prompts']} | {r['output_throughput']:.1f} "
            f"| {r['total_token_throughput']:.1f} | {r['ttft']['p50'] * ms:.0f} | {r['ttft']['p99'] * ms:.0f} "
            f"| {r['tpot']['p50'] * ms:.1f} | {r['tpot']['p99'] * ms:.1f} | {r['itl']['p50'] * ms:.1f} "
            f"| {r['e2el']['p50'] * ms / 1e3:.1f} |")


def markdown(machine: dict, runs: dict, args, commands: dict, startup: dict, wall: float, plot_rel: str) -> str:
    lines = [START, "", "## Serving: jaxserve vs the naive server vs llama-server", "",
             f"One run of `make bench-compare` on {time.strftime('%Y-%m-%d')}: {machine['cpu']}, "
             f"{machine['cores']} cores, memcpy {machine['memcpy_GBps']} GB/s (measured), Python "
             f"{machine['python']}. The whole run took {wall / 60:.1f} min (servers built, started, swept).", "",
             f"Load: `jaxserve bench`, /v1/completions, streamed, greedy, EOS ignored, prompts of "
             f"{args.input_len} tokens cut from CPython's pydoc topics (seed {args.seed}), {args.output_len} output "
             f"tokens, max concurrency {args.concurrency} with {args.num_prompts} requests per level, "
             f"{args.warmup} warm-up requests first. Latencies in ms (E2EL in s); tok/s over the whole level.", "",
             "| server | concurrency | done | output tok/s | total tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
             "| ITL p50 | E2EL p50 (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, results in runs.items():
        lines += [fmt_row(name, r) for r in results]
    lines += ["", f"![throughput against latency]({plot_rel})", "", "Servers (start-up until /health said 200):", ""]
    for name, cmd in commands.items():
        lines.append(f"- {name} ({startup[name]:.0f} s): `{shlex.join(cmd)}`")
    lines += ["", "Command: `make bench-compare` (= `.venv/bin/python scripts/bench_compare.py`); raw results "
              "in `benchmarks/compare.json`.", "", END]
    return "\n".join(lines)


def write_benchmarks_md(section: str, path: Path) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if START in text and END in text:
        head, rest = text.split(START, 1)
        text = head + section + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default="jaxserve,naive,llama-server")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--num-prompts", default="4,8,16,64")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default="benchmarks")
    ap.add_argument("--markdown", default="BENCHMARKS.md")
    args = ap.parse_args()
    os.chdir(ROOT)
    t_all = time.monotonic()
    out = Path(args.out_dir)
    out.mkdir(exist_ok=True)
    machine = describe()
    slots = max(int(c) for c in args.concurrency.split(","))
    runs, commands, startup = {}, {}, {}
    for name in args.servers.split(","):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = server_command(name, port, slots, ctx_per_slot=args.input_len + args.output_len + 64)
        log = out / f"{name}.log"
        print(f"== {name}: {shlex.join(cmd)}", file=sys.stderr)
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        try:
            startup[name] = wait_healthy(proc, url, log)
            bench = argparse.ArgumentParser()
            add_arguments(bench)
            bargs = bench.parse_args(["--url", url, "--tokenizer", str(DEFAULT_DIR), "--num-prompts", args.num_prompts,
                                      "--max-concurrency", args.concurrency, "--input-len", str(args.input_len),
                                      "--output-len", str(args.output_len), "--warmup", str(args.warmup),
                                      "--seed", str(args.seed), "--label", name])
            runs[name] = run_sweep(bargs)
            commands[name] = cmd
        finally:
            stop(proc)
        print(report.table(runs[name]), file=sys.stderr)
    report.save_json(out / "compare.json", {"machine": machine, "runs": runs,
                                            "commands": {k: shlex.join(v) for k, v in commands.items()}})
    report.plot(runs, out / "compare.png", title=f"SmolLM2-135M, {machine['cores']} CPU cores: "
                                                 f"{args.input_len} in / {args.output_len} out")
    wall = time.monotonic() - t_all
    write_benchmarks_md(markdown(machine, runs, args, commands, startup, wall, f"{args.out_dir}/compare.png"),
                        Path(args.markdown))
    print(f"wrote {args.markdown}, {out}/compare.json and {out}/compare.png in {wall / 60:.1f} min", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
