#!/usr/bin/env python
"""jaxserve against the naive server and llama.cpp's llama-server, same machine, same run.

    python scripts/bench_compare.py            # what `make bench-compare` runs
    python scripts/bench_compare.py --servers jaxserve,llama-server --concurrency 1,4
    python scripts/bench_compare.py --ablation --concurrency 16,64 --num-prompts 16,64

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
import re
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
ABL_START, ABL_END = "<!-- bench-ablation:start -->", "<!-- bench-ablation:end -->"
PY = sys.executable


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --ablation: the preset, then one of its changes switched off (or swapped) at a time.
ABLATION = {
    "preset": [],
    "XLA decode attention instead of the CPU kernel": ["--attention-impl", "xla"],
    "XLA W8A8 matmuls instead of the CPU kernel": ["--no-cpu-matmul-kernel"],
    "overlap off": ["--no-overlap"],
    "multi-step off (decode_steps 1)": ["--decode-steps", "1"],
    "float32 weights (quantization none)": ["--quantization", "none"],
    "int8 weight-only instead of W8A8": ["--quantization", "int8"],
    "coarse context buckets (256, 1024, 2048)": ["--config", "{coarse}"],
}


def server_command(name: str, port: int, max_slots: int, ctx_per_slot: int, extra: list[str] = ()) -> list[str]:
    cores = str(os.cpu_count())
    if name == "jaxserve":
        return [str(Path(PY).parent / "jaxserve"), "serve", "--config", "configs/server.toml", "--model",
                str(DEFAULT_DIR), "--port", str(port), *extra]
    if name == "naive":
        return [PY, "scripts/naive_hf_server.py", "--port", str(port), "--threads", cores]
    if name == "llama-server":
        binary = subprocess.run(["scripts/build_llama_server.sh"], cwd=ROOT, check=True,
                                stdout=subprocess.PIPE, text=True).stdout.strip().splitlines()[-1]
        return [str(ROOT / binary), "-m", str(gguf_path()), "--host", "127.0.0.1", "--port", str(port),
                "-np", str(max_slots), "-c", str(max_slots * ctx_per_slot), "-t", cores, "-tb", cores,
                "--cont-batching", "-a", "smollm2-135m-instruct", *extra]
    raise ValueError(f"unknown server {name!r}")


# llama.cpp's weight repacking for Intel AMX crashed its start-up warm-up on an Intel Xeon VM
# (SIGSEGV in ggml_backend_amx_mul_mat, 2026-12-07); a llama-server killed by a signal before it
# was healthy is started once more without repacking, and the table's command line says so.
LLAMA_FALLBACK = ["--no-repack"]


class ServerExited(RuntimeError):
    def __init__(self, returncode: int, log: Path):
        super().__init__(f"server exited with {returncode}; see {log}")
        self.returncode = returncode


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float = 900) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise ServerExited(proc.returncode, log)
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


def start_server(name: str, label: str, extra: list[str], slots: int, ctx: int, log: Path
                 ) -> tuple[subprocess.Popen, str, list[str]]:
    """Start server `name` (server_command) on a free port, logging to `log`, and wait until it
    is healthy: (process, base URL, command)."""
    return _launch(name, label, extra, slots, ctx, log)[:3]


def _launch(name: str, label: str, extra: list[str], slots: int, ctx: int, log: Path
            ) -> tuple[subprocess.Popen, str, list[str], float]:
    """start_server, and the seconds until healthy; a llama-server killed by a signal on the way
    is started once more with LLAMA_FALLBACK."""
    port = free_port()
    cmd = server_command(name, port, slots, ctx, extra)
    print(f"== {label}: {shlex.join(cmd)}", file=sys.stderr)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        return proc, url, cmd, wait_healthy(proc, url, log)
    except ServerExited as e:
        if name != "llama-server" or e.returncode >= 0 or LLAMA_FALLBACK[0] in extra:
            raise
        print(f"llama-server: {e}; starting it again with {' '.join(LLAMA_FALLBACK)}", file=sys.stderr)
        return _launch(name, label, [*extra, *LLAMA_FALLBACK], slots, ctx, log)
    except Exception:
        stop(proc)
        raise


def bench_once(url: str, label: str, *flags: str) -> dict:
    """One `jaxserve bench` run against `url` with these flags (one concurrency): its result."""
    p = argparse.ArgumentParser()
    add_arguments(p)
    (r,) = run_sweep(p.parse_args(["--url", url, "--tokenizer", str(DEFAULT_DIR), "--label", label, *flags]),
                     progress=True)
    return r


def fmt_row(name: str, r: dict) -> str:
    ms = 1e3
    return (f"| {name} | {r['max_concurrency']} | {r['completed']}/{r['num_prompts']} | {r['output_throughput']:.1f} "
            f"| {r['total_token_throughput']:.1f} | {r['ttft']['p50'] * ms:.0f} | {r['ttft']['p99'] * ms:.0f} "
            f"| {r['tpot']['p50'] * ms:.1f} | {r['tpot']['p99'] * ms:.1f} | {r['itl']['p50'] * ms:.1f} "
            f"| {r['e2el']['p50'] * ms / 1e3:.1f} |")


def results_table(first: str, runs: dict) -> list[str]:
    """Markdown table lines: one row per load level of each run, named in the `first` column."""
    lines = [f"| {first} | concurrency | done | output tok/s | total tok/s | TTFT p50 | TTFT p99 | TPOT p50 "
             "| TPOT p99 | ITL p50 | E2EL p50 (s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, results in runs.items():
        lines += [fmt_row(name, r) for r in results]
    return lines


def preset_summary() -> str:
    """The [engine] settings of configs/server.toml that decide speed, for the table's reader."""
    from jaxserve.config import load_config_file

    _, eng = load_config_file(ROOT / "configs" / "server.toml")
    return (f"`configs/server.toml`: quantization {eng.quantization or 'none'}, decode_steps {eng.decode_steps}, "
            f"overlap {'on' if eng.overlap else 'off'}, context buckets {', '.join(map(str, eng.context_buckets))}, "
            f"dtype {eng.dtype}")


def markdown(machine: dict, runs: dict, args, commands: dict, startup: dict, wall: float, plot_rel: str) -> str:
    lines = [START, "", "## Serving: jaxserve vs the naive server vs llama-server", "",
             f"One run of `make bench-compare` on {time.strftime('%Y-%m-%d')}: {machine['cpu']}, "
             f"{machine['cores']} cores, memcpy {machine['memcpy_GBps']} GB/s (measured), Python "
             f"{machine['python']}. The whole run took {wall / 60:.1f} min (servers built, started, swept).", "",
             f"Load: `jaxserve bench`, /v1/completions, streamed, greedy, EOS ignored, prompts of "
             f"{args.input_len} tokens cut from CPython's pydoc topics (seed {args.seed}), {args.output_len} output "
             f"tokens, max concurrency {args.concurrency} with {args.num_prompts} requests per level, "
             f"{args.warmup} warm-up requests first. Latencies in ms (E2EL in s); tok/s over the whole level.", "",
             *results_table("server", runs)]
    extra = getattr(args, "jaxserve_args", "")
    flags = f", with `{extra}` on its command line (it wins over the preset)" if extra else ""
    lines += ["", f"jaxserve runs the preset {preset_summary()}{flags}.",
              "", f"![throughput against latency]({plot_rel})", "", "Servers (start-up until /health said 200):", ""]
    for name, cmd in commands.items():
        lines.append(f"- {name} ({startup[name]:.0f} s): `{shlex.join(cmd)}`")
    lines += ["", "Command: `make bench-compare` (= `.venv/bin/python scripts/bench_compare.py`); raw results "
              "in `benchmarks/compare.json`.", "", END]
    return "\n".join(lines)


def write_benchmarks_md(section: str, path: Path, start: str = START, end: str = END) -> None:
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + section + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.write_text(text)


def serve_and_sweep(server: str, label: str, extra: list[str], args, out: Path, slots: int):
    """Start one server, sweep it with `jaxserve bench`, stop it: (command, results, start-up s)."""
    proc, url, cmd, startup = _launch(server, label, extra, slots, args.input_len + args.output_len + 64,
                                      out / f"{label.split(' ')[0]}.log")
    try:
        bench = argparse.ArgumentParser()
        add_arguments(bench)
        bargs = bench.parse_args(["--url", url, "--tokenizer", str(DEFAULT_DIR), "--num-prompts", args.num_prompts,
                                  "--max-concurrency", args.concurrency, "--input-len", str(args.input_len),
                                  "--output-len", str(args.output_len), "--warmup", str(args.warmup),
                                  "--seed", str(args.seed), "--label", label])
        results = run_sweep(bargs)
    finally:
        stop(proc)
    print(report.table(results), file=sys.stderr)
    return cmd, results, startup


def ablation(args, out: Path, machine: dict, t_all: float) -> int:
    """The preset against itself with one change off at a time; a table between the ablation
    markers of BENCHMARKS.md and benchmarks/ablation.json."""
    preset = (ROOT / "configs" / "server.toml").read_text()
    coarse = out / "server-coarse-buckets.toml"
    coarse.write_text(re.sub(r"(?m)^context_buckets = .*$", "context_buckets = [256, 1024, 2048]", preset))
    slots = max(int(c) for c in args.concurrency.split(","))
    runs, commands = {}, {}
    for label, extra in ABLATION.items():
        extra = [a.format(coarse=coarse) for a in extra]
        commands[label], runs[label], _ = serve_and_sweep("jaxserve", label, extra, args, out, slots)
    report.save_json(out / "ablation.json", {"machine": machine, "runs": runs,
                                             "commands": {k: shlex.join(v) for k, v in commands.items()}})
    lines = [ABL_START, "", f"One run of `python scripts/bench_compare.py --ablation --concurrency {args.concurrency} "
             f"--num-prompts {args.num_prompts}` on {time.strftime('%Y-%m-%d')} ({machine['cpu']}, "
             f"{machine['cores']} cores; {(time.monotonic() - t_all) / 60:.1f} min): the preset "
             f"(`configs/server.toml`), then one change at a time; same load as the comparison "
             f"({args.input_len} in / {args.output_len} out). Raw results in `benchmarks/ablation.json`.", "",
             *results_table("variant", runs)]
    lines += ["", "Servers: " + "; ".join(f"{k}: `{shlex.join(v[v.index('serve'):])}`" for k, v in commands.items()),
              "", ABL_END]
    write_benchmarks_md("\n".join(lines), Path(args.markdown), ABL_START, ABL_END)
    print(f"wrote {args.markdown} and {out}/ablation.json", file=sys.stderr)
    return 0


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
    ap.add_argument("--jaxserve-args", default="", metavar="ARGS",
                    help="extra `jaxserve serve` flags for the jaxserve server, e.g. \"--quantization w8a8\"")
    ap.add_argument("--ablation", action="store_true",
                    help="instead of the servers: the jaxserve preset, then each of its changes switched off in turn "
                         "(use with e.g. --concurrency 16,64 --num-prompts 16,64)")
    args = ap.parse_args()
    os.chdir(ROOT)
    t_all = time.monotonic()
    out = Path(args.out_dir)
    out.mkdir(exist_ok=True)
    machine = describe()
    if args.ablation:
        return ablation(args, out, machine, t_all)
    slots = max(int(c) for c in args.concurrency.split(","))
    runs, commands, startup = {}, {}, {}
    for name in args.servers.split(","):
        extra = shlex.split(args.jaxserve_args) if name == "jaxserve" else []
        commands[name], runs[name], startup[name] = serve_and_sweep(name, name, extra, args, out, slots)
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
