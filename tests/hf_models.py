"""Tiny random Hugging Face models, built with transformers inside the tests.

Weights are drawn with initializer_range 0.1 (HF's default 0.02 makes every logit
nearly zero, which would let a wrong model pass an absolute tolerance).
"""

from __future__ import annotations

import torch
import transformers

COMMON = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, initializer_range=0.1,
              rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)

VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}),
    # original_max_position_embeddings=32 puts head_dim 16's frequencies in all three llama3 bands.
    "llama3-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "llama-linear-rope": ("LlamaConfig", "LlamaForCausalLM", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4096}),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 5}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"use_sliding_window": False}),
}


def build(variant: str, seed: int = 0):
    config_cls, model_cls, extra = VARIANTS[variant]
    cfg = getattr(transformers, config_cls)(**{**COMMON, **extra})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    if variant == "qwen2":  # HF initialises biases to zero; make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    return model
