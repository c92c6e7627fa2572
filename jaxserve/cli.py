"""`jaxserve` command line: serve, cluster, convert, generate, chat, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _cmd_convert(args) -> int:
    from jaxserve.checkpoint.convert import convert
    from jaxserve.checkpoint.errors import ConversionError

    try:
        dst = convert(args.src, args.dst, dtype=args.dtype, progress=not args.quiet, quantize=args.quantize,
                      group_size=args.group_size, kv_calibration=args.kv_calibration,
                      kv_calibration_tokens=args.kv_calibration_tokens)
    except ConversionError as e:
        print(f"jaxserve convert: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {dst}", file=sys.stderr)
    return 0


def _read_prompts(path: str) -> list[tuple[int, dict]]:
    """One prompt per line: plain text, or a JSON object with "prompt" (or "messages") and options.
    Returns (line number, object) pairs."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if line.lstrip().startswith("{"):
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    raise SystemExit(f"jaxserve generate: error: {path}:{n}: invalid JSON ({e})")
                if not isinstance(obj, dict) or ("prompt" not in obj and "messages" not in obj):
                    raise SystemExit(f"jaxserve generate: error: {path}:{n}: needs a \"prompt\" or \"messages\"")
                prompts.append((n, obj))
            else:
                prompts.append((n, {"prompt": line}))
    return prompts


def _prompt_request(tok, limits, entry: dict, chat: bool, defaults: dict):
    """One --prompts-file line checked as the server checks a request body (the same fields,
    ranges and 400 messages, one prompt and one choice): (prompt ids, SamplingParams)."""
    from jaxserve.engine.sequence import InvalidRequest
    from jaxserve.serving import protocol as P

    body = {**defaults, **entry}
    chat = chat or "messages" in body
    if chat and "messages" not in body:
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    req = P.parse_generation(body, chat=chat, max_n=1)
    if req.echo:
        raise P.bad("'echo' is for the HTTP API: the output line names its prompt", param="echo")
    if not chat and len(req.prompts) != 1:
        raise P.bad("one prompt per line", param="prompt")
    if chat:
        ids = P.render_chat(tok, req.messages, req.chat_template)
    else:
        ids = tok.encode(req.prompts[0]) if isinstance(req.prompts[0], str) else req.prompts[0]
    ids = req.truncated(ids, limits.max_request_tokens)
    max_tokens = req.max_tokens if req.max_tokens is not None else limits.max_request_tokens - len(ids)
    params = req.sampling_params(max(max_tokens, 1), 0)
    try:
        limits.check_request(ids, params.max_tokens)
        limits.check_logit_bias(params)
    except InvalidRequest as e:
        raise P.bad(str(e)) from None
    return ids, params


def _fitted_buckets(engine, over: dict) -> dict:
    """The bucket lists that follow a new max_num_seqs or max_model_len in `over` (a flag over
    `engine`, a preset or the defaults): the buckets below the new limit, then the limit itself,
    so nothing compiles for batches or contexts the engine can never run."""
    fit = {}
    if "max_num_seqs" in over and "decode_batch_buckets" not in over:
        fit["decode_batch_buckets"] = tuple(b for b in engine.decode_batch_buckets if b < over["max_num_seqs"]) + (
            over["max_num_seqs"],)
    if "max_model_len" in over and "context_buckets" not in over:
        fit["context_buckets"] = tuple(c for c in engine.context_buckets if c < over["max_model_len"]) + (
            over["max_model_len"],)
    return fit


def _generate_engine_options(args, **options) -> dict:
    """LLM options of `jaxserve generate` (--prompts-file or --tensor-parallel-size)."""
    from jaxserve.config import EngineConfig

    options.update(kv_cache_dtype=args.kv_cache_dtype or "auto")
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    return {**options, **_fitted_buckets(EngineConfig(), options)}


def _cmd_generate_batch(args) -> int:
    """Many prompts through the batch engine; completions as JSON lines, throughput on stderr."""
    import time

    from jaxserve.engine.engine import LLM
    from jaxserve.serving.protocol import APIError

    entries = _read_prompts(args.prompts_file)
    spec = _speculative_options(args)
    llm = LLM(args.model, warmup=False, **_generate_engine_options(
        args, max_num_seqs=args.max_num_seqs, enable_prefix_caching=args.enable_prefix_caching, speculative=spec,
        tensor_parallel_size=args.tensor_parallel_size or 1))
    prompts, params, errors = [], [], []
    for i, (line, e) in enumerate(entries):  # every line checked before anything compiles or runs
        defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed + i}
        try:
            ids, p = _prompt_request(llm.tokenizer, llm.engine.limits, e, args.chat, defaults)
        except APIError as err:
            where = f" ('{err.param}')" if err.param else ""
            errors.append(f"jaxserve generate: error: {args.prompts_file}:{line}{where}: {err.message}")
            continue
        prompts.append(ids)
        params.append(p)
    if errors:
        print("\n".join(errors), file=sys.stderr)
        return 1
    llm.engine.warmup()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    for (_, e), p, o in zip(entries, params, outs):
        row = {"prompt": e.get("prompt", e.get("messages")), "text": o.text, "finish_reason": o.finish_reason,
               "completion_tokens": len(o.token_ids)}
        if p.logprobs is not None:  # the engine's records: token_id, logprob, top [(id, logprob)]
            row["logprobs"] = o.logprobs
        if p.prompt_logprobs is not None:
            row["prompt_logprobs"] = o.prompt_logprobs
        print(json.dumps(row, ensure_ascii=False))
    n_out = sum(len(o.token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    print(f"{len(outs)} requests, {n_in} prompt + {n_out} generated tokens in {elapsed:.2f}s: "
          f"{n_out / elapsed:.1f} generated tok/s, {(n_in + n_out) / elapsed:.1f} total tok/s "
          f"(compile {llm.engine.compile_seconds:.1f}s before)", file=sys.stderr)
    return 0


def _cmd_generate_engine(args) -> int:
    """One prompt through the engine: split over --tensor-parallel-size devices, or over a
    quantized --kv-cache-dtype (the plain path below is the single-device reference forward,
    which keeps no paged cache to quantize)."""
    from jaxserve.engine.engine import LLM
    from jaxserve.engine.sequence import SamplingParams

    llm = LLM(args.model, **_generate_engine_options(args, max_num_seqs=1,
                                                     tensor_parallel_size=args.tensor_parallel_size or 1))
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                                   seed=args.seed))
    print(out.text)
    return 0


def _cmd_generate(args) -> int:
    if args.prompts_file:
        return _cmd_generate_batch(args)
    if args.prompt is None:
        print("jaxserve generate: error: give a PROMPT or --prompts-file", file=sys.stderr)
        return 2
    if (args.tensor_parallel_size or 1) > 1 or (args.kv_cache_dtype or "auto") != "auto":
        return _cmd_generate_engine(args)
    from jaxserve.checkpoint.load import load_model
    from jaxserve.reference import ReferenceGenerator
    from jaxserve.tokenizer import IncrementalDetokenizer, Tokenizer

    tok = Tokenizer(args.model)
    cfg, params = load_model(args.model)
    if args.chat:
        ids = tok.encode_chat([{"role": "user", "content": args.prompt}])
    else:
        ids = tok.encode(args.prompt)
    gen = ReferenceGenerator(cfg, params, max_len=len(ids) + args.max_tokens)
    detok = IncrementalDetokenizer(tok)
    for t in gen.stream(ids, args.max_tokens, temperature=args.temperature, seed=args.seed,
                        stop_ids=tok.eos_token_ids):
        if t in tok.eos_token_ids:
            break
        sys.stdout.write(detok.add([t]))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    return 0


def serve_configs(args):
    """(ServerConfig, EngineConfig) of `jaxserve serve ARGS`: the --config preset (or the
    defaults) with the flags on top. Raises ConfigError."""
    import dataclasses

    from jaxserve.config import ConfigError, EngineConfig, ModelSpec, ServerConfig, load_config_file

    server, engine = load_config_file(args.config) if args.config else (ServerConfig(), EngineConfig())
    names = args.served_model_name or []
    if len(names) > len(args.model or []):
        raise ConfigError("more --served-model-name than --model")
    specs = tuple(ModelSpec(path=p, name=names[i] if i < len(names) else None)
                  for i, p in enumerate(args.model or []))
    over = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    if specs:
        over["models"] = specs
    if args.api_key:
        over["api_keys"] = tuple(args.api_key)
    if args.log_requests:
        over["log_requests"] = True
    server = dataclasses.replace(server, **over)
    eng = {k: v for k, v in (("max_num_seqs", args.max_num_seqs), ("max_model_len", args.max_model_len),
                             ("kv_cache_memory_gib", args.kv_cache_memory),
                             ("kv_cache_memory_fraction", args.kv_cache_memory_fraction),
                             ("quantization", args.quantization), ("decode_steps", args.decode_steps),
                             ("overlap", args.overlap), ("enable_prefix_caching", args.enable_prefix_caching),
                             ("kv_cache_dtype", args.kv_cache_dtype), ("attention_impl", args.attention_impl),
                             ("cpu_matmul_kernel", args.cpu_matmul_kernel),
                             ("tensor_parallel_size", args.tensor_parallel_size))
           if v is not None}
    spec = _speculative_options(args)
    if spec:
        eng["speculative"] = dataclasses.replace(engine.speculative, **spec)
    if eng.get("quantization") == "none":  # over a preset that quantizes
        eng["quantization"] = None
    engine = dataclasses.replace(engine, **eng, **_fitted_buckets(engine, eng))
    if not server.models:
        raise ConfigError("no model to serve: give --model DIR or [[server.models]] in --config")
    draft = engine.speculative.draft_model if engine.speculative.method == "draft" else None
    for path in [m.path for m in server.models] + ([draft] if draft else []):
        if not (Path(path) / "config.json").is_file():
            raise ConfigError(f"{path}: not a converted model directory (no config.json); see `jaxserve convert`")
    return server, engine


def _cmd_serve(args) -> int:
    import logging

    from jaxserve.config import ConfigError
    from jaxserve.serving.tracing import configure_logging, otlp_tracer

    configure_logging(args.log_format, logging.INFO)
    try:
        server, engine = serve_configs(args)
        tracer = otlp_tracer(args.otlp_traces_endpoint) if args.otlp_traces_endpoint else None
    except (ConfigError, RuntimeError) as e:
        print(f"jaxserve serve: error: {e}", file=sys.stderr)
        return 2
    from jaxserve.serving.app import serve

    if args.profiler_port is not None:
        import jax

        jax.profiler.start_server(args.profiler_port)
        logging.getLogger("jaxserve").info("jax profiler server on port %d (XProf / TensorBoard: capture profile)",
                                           args.profiler_port)
    return serve(server, engine, tracer=tracer)


def _cmd_cluster(args) -> int:
    import dataclasses
    import logging

    from jaxserve.config import ConfigError
    from jaxserve.serving.tracing import configure_logging

    configure_logging("text", logging.INFO)
    try:
        from jaxserve.cluster.config import load_cluster_config

        cfg = load_cluster_config(args.config)
        over = {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, **over))
        for m in cfg.models:
            if not (Path(m.path) / "config.json").is_file():
                raise ConfigError(f"{m.path}: not a converted model directory (no config.json); see `jaxserve convert`")
    except ConfigError as e:
        print(f"jaxserve cluster: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        print(f"jaxserve cluster: error: {e.name} is missing: pip install 'jaxserve[cluster]'", file=sys.stderr)
        return 2
    if args.address and (Path.home() / ".ray" / "auth_token").is_file():
        # A cluster started by ray.init or `ray start` requires Ray's token by default; a joining
        # driver sends it only in token mode, which must be set before ray is imported.
        os.environ.setdefault("RAY_AUTH_MODE", "token")
    from jaxserve.cluster.deploy import run_cluster

    return run_cluster(cfg, args.address, cfg.server.host, cfg.server.port)


def _cmd_chat(args) -> int:
    from jaxserve.chat_client import chat_loop

    return chat_loop(args.url, args.model, args.api_key, args.system, args.max_tokens, args.temperature)


def _cmd_bench(args) -> int:
    from jaxserve.bench.run import main

    return main(args)


def _kv_cache_dtype_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-cache-dtype", choices=("auto", "int8", "fp8_e4m3", "fp8_e5m2"),
                   help="KV cache storage: auto (the model's dtype), int8 (scale per token and KV head) or fp8 "
                        "(a scale per layer); default auto")


def _tensor_parallel_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensor-parallel-size", type=int, metavar="N",
                   help="split the model by heads over N local devices (default 1)")


def _speculative_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-method", choices=("ngram", "draft"),
                   help="speculative decoding: ngram proposes tokens by prompt lookup, draft by a smaller model "
                        "(--draft-model) (default: off)")
    p.add_argument("--num-speculative-tokens", type=int, metavar="K", help="tokens proposed per step (default 8)")
    p.add_argument("--ngram-min", type=int, metavar="N", help="shortest n-gram prompt lookup matches (default 2)")
    p.add_argument("--ngram-max", type=int, metavar="N", help="longest n-gram prompt lookup matches (default 4)")
    p.add_argument("--draft-model", metavar="DIR",
                   help="a converted model directory with the target's tokenizer (--speculative-method draft)")
    p.add_argument("--speculative-disable-above-batch-size", type=int, metavar="N",
                   help="decode plainly when more sequences than this run (default 2)")


def _speculative_options(args) -> dict:
    """[engine.speculative] keys given on the command line."""
    return {k: v for k, v in (("method", args.speculative_method),
                              ("num_speculative_tokens", args.num_speculative_tokens),
                              ("ngram_min", args.ngram_min), ("ngram_max", args.ngram_max),
                              ("draft_model", args.draft_model),
                              ("disable_above_batch_size", args.speculative_disable_above_batch_size))
            if v is not None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA LLM inference server")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert a HF model directory or .gguf file to an Orbax model directory")
    c.add_argument("src", help="Hugging Face model directory (config.json + safetensors) or a .gguf file")
    c.add_argument("dst", help="output directory (must not exist)")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--quantize", choices=["int8", "int4"], help="weight-only quantization of the matmul weights")
    c.add_argument("--group-size", type=int, default=128, help="int4 group size along the input dimension")
    c.add_argument("--kv-calibration", metavar="TEXT_FILE",
                   help="run the converted model over this text and store per-layer fp8 KV cache scales and "
                        "key transforms (kv_scales.json, kv_keys.npy), used with --kv-cache-dtype fp8_e4m3 / fp8_e5m2")
    c.add_argument("--kv-calibration-tokens", type=int, default=2048, metavar="N",
                   help="tokens of the calibration text to run (default 2048)")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_cmd_convert)

    g = sub.add_parser("generate", help="generate a completion for one prompt (or a file of prompts)")
    g.add_argument("prompt", nargs="?")
    g.add_argument("--prompts-file", help="one prompt per line: text, or JSON with prompt|messages and the "
                                          "options of a completion or chat request body (checked as the server "
                                          "checks them); runs them all through the batch engine and reports "
                                          "throughput")
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-model-len", type=int,
                   help="through the engine (--prompts-file, --tensor-parallel-size, --kv-cache-dtype): most "
                        "tokens (prompt + output) of one request (default 2048); fewer context buckets to compile")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="--prompts-file: reuse the KV pages of shared prompt prefixes (default: on)")
    _kv_cache_dtype_argument(g)
    _tensor_parallel_argument(g)
    _speculative_arguments(g)
    g.add_argument("--model", required=True, help="converted model directory")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="apply the chat template to PROMPT as one user message")
    g.set_defaults(func=_cmd_generate)

    s = sub.add_parser("serve", help="serve models over an OpenAI-compatible HTTP API")
    s.add_argument("--model", action="append", metavar="DIR", help="converted model directory (repeatable)")
    s.add_argument("--served-model-name", action="append", metavar="NAME",
                   help="name clients use for the matching --model (default: the directory's name)")
    s.add_argument("--host", help="default 127.0.0.1")
    s.add_argument("--port", type=int, help="default 8000")
    s.add_argument("--api-key", action="append", metavar="KEY", help="require 'Authorization: Bearer KEY'")
    s.add_argument("--config", metavar="FILE", help="TOML preset with [server] and [engine] tables (configs/)")
    s.add_argument("--max-num-seqs", type=int, help="most sequences decoding at once")
    s.add_argument("--max-model-len", type=int, help="most tokens (prompt + output) of one request")
    s.add_argument("--kv-cache-memory", type=float, metavar="GIB", help="KV cache budget in GiB")
    s.add_argument("--kv-cache-memory-fraction", type=float, metavar="F",
                   help="KV cache budget as a fraction of free device memory (GPUs; wins over GiB there)")
    s.add_argument("--quantization", choices=("int8", "w8a8", "none"),
                   help="int8: weight-only int8 (a float checkpoint is quantized at load); w8a8: int8 weights "
                        "and int8 activations in every matmul of 8+ rows (weights quantized rotated); "
                        "none: the checkpoint as it is")
    s.add_argument("--decode-steps", type=int, metavar="N", help="decode steps per device call when no prompt waits")
    s.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=None,
                   help="launch the next decode call before reading the last one (default: on)")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV pages of prompt prefixes computed before (default: on)")
    _kv_cache_dtype_argument(s)
    s.add_argument("--attention-impl", choices=("auto", "pallas", "xla", "cpu"),
                   help="attention kernel: auto (Pallas on a GPU; on a CPU the C++ decode kernel over float32 "
                        "pages, else XLA), pallas, xla, or cpu (default auto)")
    s.add_argument("--cpu-matmul-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="on a CPU, W8A8 products of fewer than 8 rows in the C++ int8 kernel (default: on)")
    _tensor_parallel_argument(s)
    _speculative_arguments(s)
    s.add_argument("--log-format", choices=("text", "json"), default="text",
                   help="json: one JSON object per line, each with its request_id")
    s.add_argument("--log-requests", action="store_true",
                   help="log every prompt and completion text (for debugging: they are user data; off by default)")
    s.add_argument("--otlp-traces-endpoint", metavar="URL",
                   help="export one OpenTelemetry span per request over OTLP/HTTP (needs opentelemetry-sdk)")
    s.add_argument("--profiler-port", type=int, metavar="PORT",
                   help="start jax.profiler's server for XProf / TensorBoard capture on this port")
    s.set_defaults(func=_cmd_serve)

    k = sub.add_parser("cluster", help="serve models on Ray Serve: replicas, routing, autoscaling (jaxserve[cluster])")
    k.add_argument("--config", required=True, metavar="FILE", help="cluster TOML (configs/cluster.toml)")
    k.add_argument("--address", help="join this Ray cluster (e.g. auto, or HOST:6379), deploy or update, and "
                                     "return; without it a local cluster is started and served until Ctrl-C")
    k.add_argument("--host", help="the ingress's address (default: [server] host)")
    k.add_argument("--port", type=int, help="the ingress's port (default: [server] port)")
    k.set_defaults(func=_cmd_cluster)

    h = sub.add_parser("chat", help="chat in the terminal with a running server (streams the answers)")
    h.add_argument("--url", default="http://127.0.0.1:8000")
    h.add_argument("--model", help="default: the server's first model")
    h.add_argument("--api-key")
    h.add_argument("--system", help="a system message to start the conversation with")
    h.add_argument("--max-tokens", type=int, default=512)
    h.add_argument("--temperature", type=float, default=0.7)
    h.set_defaults(func=_cmd_chat)

    from jaxserve.bench.run import add_arguments

    b = sub.add_parser("bench", help="benchmark any OpenAI-compatible server (TTFT, TPOT, ITL, throughput)")
    add_arguments(b)
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
