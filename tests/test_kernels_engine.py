"""The engine end to end with the Pallas kernels (interpret mode) against the XLA path.

A tiny random Llama (2 layers, head_dim 16, GQA 4:2, the default model's tokenizer)
generates greedily through the whole engine, prefill and decode steps over the paged
cache, once with attention_impl = matmul_impl = "xla" and once with "pallas" in
interpret mode; the tokens must be identical. The same for int8 and int4 checkpoints of
that model (quantized by `convert --quantize`), where "xla" dequantizes inside the dot
and "pallas" runs the quantized matmul kernels, and for an int8 KV cache.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.engine.engine import LLM
from jaxserve.engine.sequence import SamplingParams

PROMPTS = [[5, 17, 300, 42, 7], list(range(100, 123)), [9] * 40]


def small(impl: str) -> dict:
    return dict(max_num_seqs=4, max_model_len=64, decode_batch_buckets=(4,), context_buckets=(32, 64),
                prefill_batch_buckets=(1,), prefill_length_buckets=(32,), num_pages=32,
                attention_impl=impl, matmul_impl=impl, interpret=impl == "pallas")


def greedy(model_dir, impl: str, **options) -> list[list[int]]:
    llm = LLM(model_dir, **small(impl), **options)
    # XLA attends over a context bucket's every slot, so it compiles both widths (2 and 4 pages);
    # the Pallas kernels read a sequence's own pages, so one width (max_model_len) serves all.
    assert llm.engine.runner.context_page_buckets == ((4,) if impl == "pallas" else (2, 4))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert llm.engine.pool.num_used == 0
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module", params=[None, "int8", "int4"], ids=["float32", "int8", "int4"])
def model_dir(request, tmp_path_factory, default_model_dir):
    from fakes import make_tiny_model

    name = f"tiny-{request.param or 'f32'}"
    return make_tiny_model(tmp_path_factory.mktemp(name) / name, default_model_dir, quantize=request.param)


def test_pallas_engine_matches_xla(model_dir):
    want = greedy(model_dir, "xla")
    assert greedy(model_dir, "pallas") == want


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_pallas_engine_matches_xla_with_a_quantized_kv_cache(tiny_model_dir, kv_cache_dtype):
    """The kernels read the engine's int8 pages with their float16 scales, and fp8 pages, as
    the XLA path does."""
    want = greedy(tiny_model_dir, "xla", kv_cache_dtype=kv_cache_dtype)
    assert greedy(tiny_model_dir, "pallas", kv_cache_dtype=kv_cache_dtype) == want


def test_quantized_checkpoint_layout(model_dir):
    from jaxserve.checkpoint.load import load_params

    cfg = json.loads((model_dir / "config.json").read_text())
    mode = cfg.get("jaxserve_quantization", {}).get("mode")
    wq = load_params(model_dir)["layers"]["wq"]
    if mode is None:
        assert not isinstance(wq, dict)
    elif mode == "int8":
        assert wq["q8"].dtype == np.int8 and wq["q8"].shape == (2, 64, 64) and wq["scale"].shape == (2, 64)
    else:
        assert wq["q4"].dtype == np.uint8 and wq["q4"].shape == (2, 32, 64)
        assert wq["scale"].shape == wq["low"].shape == (2, 1, 64)


def test_impl_names_are_checked():
    from jaxserve.config import ConfigError

    with pytest.raises(ConfigError, match="attention_impl"):
        EngineConfig(attention_impl="cuda")


def test_cpu_decode_kernel_engine_matches_xla(tiny_model_dir):
    """The C++ decode kernel (attention_impl "cpu", what "auto" picks on a CPU) through the whole
    engine: prefill on XLA, every decode step on the kernel, the same greedy tokens as XLA's."""
    want = greedy(tiny_model_dir, "xla")
    llm = LLM(tiny_model_dir, **{**small("xla"), "attention_impl": "cpu"})
    assert llm.engine.runner.attention_impl == "cpu"
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
