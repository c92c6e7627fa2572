"""Read a GGUF file as a Hugging Face checkpoint: a config.json dict, HF-named tensors
(dequantized to float32) and the tokenizer files, all from the file's own metadata.

llama.cpp's converter permutes the rows of Q and K of Llama-architecture models so
that RoPE pairs interleave; we undo it here so the weights match the HF layout that
`jaxserve.models.llama` (and transformers) use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import numpy as np

from jaxserve.checkpoint.errors import ConversionError

_ARCHS = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_TENSOR_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}

# GGUF token types (llama.cpp's llama_token_type): 3 = control, 4 = user-defined.
_SPECIAL_TOKEN_TYPES = (3, 4)


def _open(path: Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # gguf raises assorted errors for a bad file
        raise ConversionError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: rows (head, pair, 2) -> (head, 2, pair)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """The parts of a GGUF file that a converter needs, read lazily."""

    def __init__(self, path: Path):
        self.path = path
        self.reader = _open(path)
        arch = _field(self.reader, "general.architecture")
        if arch not in _ARCHS:
            raise ConversionError(f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(_ARCHS)})")
        self.arch = arch
        self.tensor_names = {t.name for t in self.reader.tensors}

    def four_bit_block(self) -> int | None:
        """32 when every matmul weight of the decoder blocks is Q4_0 / Q4_1 (4-bit, blocks of
        32 along the input dimension), else None: int4 at a larger group size would re-round
        those weights onto a coarser grid (see BENCHMARKS.md), at group 32 it keeps them."""
        from gguf import GGMLQuantizationType as Q

        kinds = {t.tensor_type for t in self.reader.tensors
                 if t.name.startswith("blk.") and t.name.endswith(".weight") and len(t.shape) == 2}
        return 32 if kinds and kinds <= {Q.Q4_0, Q.Q4_1} else None

    def hf_config(self) -> dict:
        r, a = self.reader, self.arch
        n_head = int(_field(r, f"{a}.attention.head_count"))
        hidden = int(_field(r, f"{a}.embedding_length"))
        tokens = _field(r, "tokenizer.ggml.tokens") or []
        cfg = {
            "architectures": [_ARCHS[a]],
            "model_type": a,
            "vocab_size": int(_field(r, f"{a}.vocab_size", len(tokens))),
            "hidden_size": hidden,
            "intermediate_size": int(_field(r, f"{a}.feed_forward_length")),
            "num_hidden_layers": int(_field(r, f"{a}.block_count")),
            "num_attention_heads": n_head,
            "num_key_value_heads": int(_field(r, f"{a}.attention.head_count_kv", n_head)),
            "head_dim": int(_field(r, f"{a}.attention.key_length", hidden // n_head)),
            "max_position_embeddings": int(_field(r, f"{a}.context_length", 2048)),
            "rms_norm_eps": float(_field(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            "rope_theta": float(_field(r, f"{a}.rope.freq_base", 10000.0)),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
            "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        }
        scaling = _field(r, f"{a}.rope.scaling.type")
        if scaling == "linear":
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": float(_field(r, f"{a}.rope.scaling.factor"))}
        elif scaling not in (None, "none"):
            raise ConversionError(f"{self.path}: unsupported GGUF rope scaling {scaling!r}")
        if a == "qwen2":
            cfg["use_sliding_window"] = False
        return cfg

    def tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (HF name, float32 array in HF [out, in] layout) for every tensor."""
        from gguf import quants

        cfg = self.hf_config()
        for t in self.reader.tensors:
            name = self._hf_name(t.name)
            if name is None:
                continue
            w = np.asarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
            if self.arch == "llama" and name.endswith("q_proj.weight"):
                w = _unpermute(w, cfg["num_attention_heads"])
            elif self.arch == "llama" and name.endswith("k_proj.weight"):
                w = _unpermute(w, cfg["num_key_value_heads"])
            yield name, w

    def _hf_name(self, name: str) -> str | None:
        if name in _TENSOR_NAMES:
            return _TENSOR_NAMES[name]
        if name.startswith("blk."):
            _, i, part, kind = name.split(".", 3)
            if part in _BLOCK_NAMES:
                return f"model.layers.{i}.{_BLOCK_NAMES[part]}.{kind}"
        if name == "rope_freqs.weight":  # llama3 scaling baked as factors; transformers ignores it too
            return None
        raise ConversionError(f"{self.path}: unexpected GGUF tensor {name!r}")

    def tokenizer_files(self) -> dict[str, str]:
        """tokenizer.json, tokenizer_config.json and generation_config.json, as text."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

        r = self.reader
        kind = _field(r, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ConversionError(f"{self.path}: GGUF tokenizer model {kind!r} is not supported (supported: gpt2 BPE)")
        tokens = list(_field(r, "tokenizer.ggml.tokens"))
        types = list(_field(r, "tokenizer.ggml.token_type") or [1] * len(tokens))
        merges = [tuple(m.split(" ", 1)) for m in _field(r, "tokenizer.ggml.merges")]
        tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if _field(r, "tokenizer.ggml.pre") in ("smollm", "starcoder", "refact", "qwen2", "llama-bpe", "llama3"):
            # These llama.cpp pre-tokenizers split digits apart before the GPT-2 regex.
            tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, ty in zip(tokens, types) if ty in _SPECIAL_TOKEN_TYPES])

        def token(key):
            i = _field(r, key)
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
        tok_cfg = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos, "eos_token": eos,
            "unk_token": token("tokenizer.ggml.unknown_token_id"),
            "pad_token": token("tokenizer.ggml.padding_token_id"),
            "add_bos_token": bool(_field(r, "tokenizer.ggml.add_bos_token", False)),
            "clean_up_tokenization_spaces": False,
            "model_max_length": int(_field(r, f"{self.arch}.context_length", 2048)),
        }
        template = _field(r, "tokenizer.chat_template")
        if template:
            tok_cfg["chat_template"] = template
        gen_cfg = {"bos_token_id": _field(r, "tokenizer.ggml.bos_token_id"),
                   "eos_token_id": _field(r, "tokenizer.ggml.eos_token_id")}
        return {
            "tokenizer.json": tok.to_str(),
            "tokenizer_config.json": json.dumps(tok_cfg, indent=2, ensure_ascii=False),
            "generation_config.json": json.dumps(gen_cfg, indent=2),
        }
