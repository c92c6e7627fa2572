"""`jaxserve` command line: convert, generate."""

from __future__ import annotations

import argparse
import sys


def _cmd_convert(args) -> int:
    from jaxserve.checkpoint.convert import convert
    from jaxserve.checkpoint.errors import ConversionError

    try:
        dst = convert(args.src, args.dst, dtype=args.dtype, progress=not args.quiet)
    except ConversionError as e:
        print(f"jaxserve convert: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {dst}", file=sys.stderr)
    return 0


def _cmd_generate(args) -> int:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxserve", description="JAX/XLA LLM inference server")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="convert a HF model directory or .gguf file to an Orbax model directory")
    c.add_argument("src", help="Hugging Face model directory (config.json + safetensors) or a .gguf file")
    c.add_argument("dst", help="output directory (must not exist)")
    c.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=_cmd_convert)

    g = sub.add_parser("generate", help="generate a completion for one prompt and print it")
    g.add_argument("prompt")
    g.add_argument("--model", required=True, help="converted model directory")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true", help="apply the chat template to PROMPT as one user message")
    g.set_defaults(func=_cmd_generate)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
