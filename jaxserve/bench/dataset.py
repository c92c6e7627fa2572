"""Benchmark prompts: seeded synthetic text of chosen token lengths, or a JSONL file.

No download: the synthetic text is cut from CPython's own `pydoc_data.topics` (the
help texts of the language reference, ~800 KB of English prose and code), which
every Python install carries. A prompt of N tokens is a window of that text that
the benchmark's tokenizer encodes to N tokens, starting at a seeded random place.

Length distributions (and `multi-turn`, conversations over one shared system prompt:
jaxserve/bench/multiturn.py):
  fixed          every prompt has exactly `input_len` tokens and asks for `output_len`;
  sharegpt-like  lognormal lengths with medians `input_len` / `output_len` and a
                 spread `sigma`, clipped to [4, 4 x median]: the long right tail of
                 real chat traffic (ShareGPT) without shipping ShareGPT;
  grounded       a passage of `input_len` tokens and the request to copy it out
                 again, lightly edited: input-grounded work (editing code, quoting a
                 document), where an answer repeats its prompt and prompt-lookup
                 speculation pays.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

from tokenizers import Tokenizer


@dataclasses.dataclass(frozen=True)
class BenchPrompt:
    prompt: str | None  # for /v1/completions
    messages: list | None  # for /v1/chat/completions
    prompt_tokens: int
    output_len: int


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the benchmark needs a tokenizer.json to count tokens (--tokenizer DIR)")
    return Tokenizer.from_file(str(path))


def _corpus_ids(tok: Tokenizer) -> list[int]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return tok.encode(text, add_special_tokens=False).ids


_CORPUS: list = [None, None]  # [tokenizer, its corpus ids]: encoded once per tokenizer


def corpus_window(tok: Tokenizer, rng: random.Random, n: int) -> str:
    """Text of about `n` tokens, from a seeded random place in the corpus."""
    if _CORPUS[0] is not tok:
        _CORPUS[:] = [tok, _corpus_ids(tok)]
    ids = _CORPUS[1]
    start = rng.randrange(0, len(ids) - n)
    return tok.decode(ids[start:start + n])


def _lengths(rng: random.Random, n: int, median: int, sigma: float, kind: str) -> list[int]:
    if kind == "fixed":
        return [median] * n
    import math

    return [max(4, min(4 * median, round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(n)]


GROUNDED = ("Here is a passage from the Python documentation:\n\n{passage}\n\n"
            "Copy the passage out again word for word, changing only 'Python' to 'the language'.\n\n")


def synthetic(tok: Tokenizer, n: int, input_len: int, output_len: int, *, kind: str = "fixed",
              sigma: float = 0.8, seed: int = 0, chat: bool = False) -> list[BenchPrompt]:
    """`n` prompts cut from the corpus; the same arguments always give the same prompts."""
    if kind not in ("fixed", "sharegpt-like", "grounded"):
        raise ValueError(f"unknown dataset {kind!r}: fixed, sharegpt-like, grounded, multi-turn or a .jsonl file")
    rng = random.Random(seed)
    ins = _lengths(rng, n, input_len, sigma, "fixed" if kind == "grounded" else kind)
    outs = _lengths(rng, n, output_len, sigma, "fixed" if kind == "grounded" else kind)
    prompts = []
    for p_len, o_len in zip(ins, outs):
        text = corpus_window(tok, rng, p_len)
        if kind == "grounded":
            text = GROUNDED.format(passage=text)
        count = len(tok.encode(text, add_special_tokens=False).ids)
        if chat:
            prompts.append(BenchPrompt(None, [{"role": "user", "content": text}], count, o_len))
        else:
            prompts.append(BenchPrompt(text, None, count, o_len))
    return prompts


def from_jsonl(path: str | Path, tok: Tokenizer, default_output_len: int, chat: bool = False) -> list[BenchPrompt]:
    """One JSON object per line: {"prompt": str} or {"messages": [...]}, optionally "output_len"."""
    prompts = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{n}: invalid JSON ({e})") from None
        out = int(obj.get("output_len", default_output_len))
        if "messages" in obj:
            text = "\n".join(str(m.get("content", "")) for m in obj["messages"])
            prompts.append(BenchPrompt(None, obj["messages"], len(tok.encode(text).ids), out))
        elif "prompt" in obj:
            text = str(obj["prompt"])
            count = len(tok.encode(text, add_special_tokens=False).ids)
            prompts.append(BenchPrompt(None, [{"role": "user", "content": text}], count, out) if chat
                           else BenchPrompt(text, None, count, out))
        else:
            raise ValueError(f"{path}:{n}: needs \"prompt\" or \"messages\"")
    if not prompts:
        raise ValueError(f"{path}: no prompts")
    return prompts
