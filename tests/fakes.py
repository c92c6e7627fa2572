"""A tiny real model for fast engine tests: a random 2-layer Llama with the default model's
vocabulary and tokenizer, converted by jaxserve like any checkpoint. Compiles in about a
second per step shape, so scheduler and engine behaviour can be exercised cheaply."""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def tiny_hf_model(seed: int = 0, vocab_size: int = 49152):
    """The transformers model that make_tiny_model converts (same seed, same weights)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=0.2, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def make_tiny_model(dst: Path, tokenizer_dir: Path, seed: int = 0, quantize: str | None = None,
                    vocab_size: int = 49152) -> Path:
    from jaxserve.checkpoint.convert import convert

    src = dst.parent / f"{dst.name}-hf"
    tiny_hf_model(seed, vocab_size).save_pretrained(src)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, src / name)
    convert(src, dst, progress=False, quantize=quantize)
    shutil.rmtree(src)
    return dst
