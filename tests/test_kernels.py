"""Pallas kernels in interpret mode against their pure-jnp references, and CUDA lowering.

The references (pallas_kernels/*/ref.py) gather every page and run a plain softmax,
or dequantize the whole weight and run one dot, in float32 at highest precision; the
kernels must agree within a tolerance set by the input dtype (float32 1e-4; bfloat16
inputs are rounded the same way on both sides, so 2e-2 covers the different order of
accumulation). The cases cover both dtypes, page sizes 16 and 32, 1, 2 and 8 KV heads
with 1 to 8 query heads per KV head, head_dim 64 and 128, lengths of 1, a page
boundary and non-multiples of the page size, int8 K/V on and off, a soft-cap and a
sliding window.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers.attention import quantize_int8 as quantize_kv  # the int8 KV cache's pages and scales
from pallas_kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from pallas_kernels.paged_attention.ref import paged_attention_ref
from pallas_kernels.quantized_matmul import (int4_matmul, int4_matmul_ref, int8_matmul, int8_matmul_ref,
                                             quantize_int4, quantize_int8, unpack_int4)

TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2}
# On a GPU (scripts/device_check.sh) PALLAS_INTERPRET=0 runs the same cases compiled.
INTERPRET = os.environ.get("PALLAS_INTERPRET", "1") != "0"


def make_cache(seed, lengths, PS, K, D, dtype, int8, L=2, spare_pages=3):
    """A 2-layer cache whose pages are handed out shuffled, with spare pages of noise."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    P = max(1, max(-(-n // PS) for n in lengths))
    NP = B * P + spare_pages
    k = jnp.asarray(rng.standard_normal((L, NP, PS, K, D)), dtype)
    v = jnp.asarray(rng.standard_normal((L, NP, PS, K, D)), dtype)
    tables = jnp.asarray(rng.permutation(NP)[: B * P].reshape(B, P), jnp.int32)
    ks = vs = None
    if int8:
        k, ks = quantize_kv(k)  # the engine's int8 pages: float16 scales per token and KV head
        v, vs = quantize_kv(v)
    return k, v, ks, vs, tables


DECODE_CASES = [
    # dtype, page size, kv heads, q heads per kv head, head dim, lengths, int8
    (jnp.float32, 16, 1, 1, 64, [1, 16, 17], False),
    (jnp.float32, 16, 2, 3, 64, [5, 33, 48], False),
    (jnp.float32, 32, 8, 1, 128, [31, 1, 64], False),
    (jnp.float32, 32, 1, 8, 128, [70, 2], True),
    (jnp.float32, 16, 2, 4, 64, [1, 47], True),
    (jnp.bfloat16, 16, 8, 2, 64, [16, 9, 1], False),
    (jnp.bfloat16, 32, 2, 5, 128, [33, 100], False),
    (jnp.bfloat16, 16, 1, 7, 64, [3, 40], True),
]


@pytest.mark.parametrize("dtype,PS,K,G,D,lengths,int8", DECODE_CASES)
def test_decode_kernel_matches_reference(dtype, PS, K, G, D, lengths, int8):
    k, v, ks, vs, tables = make_cache(len(lengths) * PS + D, lengths, PS, K, D, dtype, int8)
    B = len(lengths)
    q = jnp.asarray(np.random.default_rng(1).standard_normal((B, K * G, D)), dtype)
    lens = jnp.asarray(lengths, jnp.int32)
    got = paged_decode_attention(q, k, v, tables, lens, 1, k_scales=ks, v_scales=vs, interpret=INTERPRET)
    want = paged_attention_ref(q[:, None], k, v, tables, lens, (lens - 1)[:, None], layer=1, k_scales=ks,
                               v_scales=vs)[:, 0]
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("soft_cap,window", [(30.0, None), (None, 20), (5.0, 7)])
def test_decode_kernel_soft_cap_and_sliding_window(soft_cap, window):
    lengths = [1, 19, 50]
    k, v, ks, vs, tables = make_cache(3, lengths, 16, 2, 64, jnp.float32, False)
    q = jnp.asarray(np.random.default_rng(2).standard_normal((3, 4, 64)) * 3, jnp.float32)
    lens = jnp.asarray(lengths, jnp.int32)
    got = paged_decode_attention(q, k, v, tables, lens, 0, soft_cap=soft_cap, sliding_window=window, interpret=INTERPRET)
    want = paged_attention_ref(q[:, None], k, v, tables, lens, (lens - 1)[:, None], soft_cap=soft_cap,
                               sliding_window=window)[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


def test_decode_kernel_zero_length_rows_give_zeros():
    k, v, _, _, tables = make_cache(4, [20, 20], 16, 1, 64, jnp.float32, False)
    q = jnp.ones((2, 2, 64), jnp.float32)
    out = paged_decode_attention(q, k, v, tables, jnp.asarray([0, 20], jnp.int32), interpret=INTERPRET)
    assert np.all(np.asarray(out[0]) == 0) and np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize("fp8", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_kernels_read_fp8_pages(fp8):
    """An fp8 KV cache's pages (scale 1): decode and prefill against the reference over the same pages."""
    lengths = [5, 40]
    k, v, _, _, tables = make_cache(8, lengths, 16, 2, 64, jnp.float32, False)
    k, v = k.astype(fp8), v.astype(fp8)
    rng = np.random.default_rng(3)
    lens = jnp.asarray(lengths, jnp.int32)
    q = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.float32)
    got = paged_decode_attention(q, k, v, tables, lens, 1, interpret=INTERPRET)
    want = paged_attention_ref(q[:, None], k, v, tables, lens, (lens - 1)[:, None], layer=1)[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
    qp = jnp.asarray(rng.standard_normal((2, 5, 4, 64)), jnp.float32)
    pos = jnp.asarray([[0, 1, 2, 3, 4], [35, 36, 37, 38, 39]], jnp.int32)
    got = paged_prefill_attention(qp, k, v, tables, lens, pos, 1, interpret=INTERPRET)
    want = paged_attention_ref(qp, k, v, tables, lens, pos, layer=1)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)


PREFILL_CASES = [
    # dtype, page size, kv heads, q heads per kv head, head dim, (start, chunk) per sequence, int8
    (jnp.float32, 16, 1, 1, 64, [(0, 1), (0, 17)], False),
    (jnp.float32, 16, 2, 3, 64, [(16, 9), (5, 20)], False),
    (jnp.float32, 32, 8, 1, 128, [(0, 33), (40, 3)], True),
    (jnp.float32, 32, 1, 8, 64, [(31, 2), (0, 12)], False),
    (jnp.bfloat16, 16, 2, 4, 128, [(0, 24), (17, 7)], False),
    (jnp.bfloat16, 16, 8, 2, 64, [(3, 14), (0, 1)], True),
]


@pytest.mark.parametrize("dtype,PS,K,G,D,chunks,int8", PREFILL_CASES)
def test_prefill_kernel_matches_reference(dtype, PS, K, G, D, chunks, int8):
    """Each sequence has `start` cached tokens and a chunk of new ones (already in the cache)."""
    ctx = [s + n for s, n in chunks]
    k, v, ks, vs, tables = make_cache(sum(ctx), ctx, PS, K, D, dtype, int8)
    B, T = len(chunks), max(n for _, n in chunks)
    q = jnp.asarray(np.random.default_rng(5).standard_normal((B, T, K * G, D)), dtype)
    pos = np.full((B, T), -1, np.int32)  # padding rows see nothing
    for b, (s, n) in enumerate(chunks):
        pos[b, :n] = np.arange(s, s + n)
    pos = jnp.asarray(pos)
    lens = jnp.asarray(ctx, jnp.int32)
    got = paged_prefill_attention(q, k, v, tables, lens, pos, 1, k_scales=ks, v_scales=vs, interpret=INTERPRET)
    want = paged_attention_ref(q, k, v, tables, lens, pos, layer=1, k_scales=ks, v_scales=vs)
    for b, (_, n) in enumerate(chunks):
        np.testing.assert_allclose(np.asarray(got[b, :n], np.float32), np.asarray(want[b, :n], np.float32),
                                   atol=TOL[dtype], rtol=TOL[dtype])


def test_prefill_kernel_sliding_window_and_soft_cap():
    chunks = [(10, 20), (0, 5)]
    ctx = [30, 5]
    k, v, _, _, tables = make_cache(7, ctx, 16, 2, 64, jnp.float32, False)
    q = jnp.asarray(np.random.default_rng(8).standard_normal((2, 20, 4, 64)) * 2, jnp.float32)
    pos = np.full((2, 20), -1, np.int32)
    for b, (s, n) in enumerate(chunks):
        pos[b, :n] = np.arange(s, s + n)
    pos, lens = jnp.asarray(pos), jnp.asarray(ctx, jnp.int32)
    got = paged_prefill_attention(q, k, v, tables, lens, pos, soft_cap=10.0, sliding_window=8, interpret=INTERPRET)
    want = paged_attention_ref(q, k, v, tables, lens, pos, soft_cap=10.0, sliding_window=8)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(got[1, :5]), np.asarray(want[1, :5]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("M,K,N", [(1, 576, 192), (5, 128, 64), (16, 1536, 576), (33, 256, 128)])
def test_int8_matmul_matches_reference(dtype, M, K, N):
    rng = np.random.default_rng(M + K)
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.float32)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    q, s = quantize_int8(w)
    assert q.dtype == jnp.int8 and s.shape == (N,)
    assert np.abs(np.asarray(q, np.float32) * np.asarray(s) - np.asarray(w)).max() <= np.asarray(s).max() / 2 + 1e-7
    got = int8_matmul(x, q, s, interpret=INTERPRET)
    want = int8_matmul_ref(x, q, s)
    assert got.shape == (M, N) and got.dtype == dtype
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=TOL[dtype], atol=TOL[dtype] * np.abs(np.asarray(want, np.float32)).max())


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("M,K,N,group", [(1, 576, 192, 128), (7, 1536, 64, 128), (16, 256, 128, 64)])
def test_int4_matmul_matches_reference(dtype, M, K, N, group):
    rng = np.random.default_rng(M + N)
    w = jnp.asarray(rng.standard_normal((K, N)) * 0.05, jnp.float32)
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    packed, s, low = quantize_int4(w, group)
    G = K // s.shape[0]
    assert packed.shape == (K // 2, N) and packed.dtype == jnp.uint8 and G == (64 if K == 576 else group)
    # Min/max scales (no refinement) round each element by at most half a step; the
    # least-squares steps clip a few outliers to lower the squared error of the whole.
    plain = quantize_int4(w, group, refine_steps=0)
    deq_plain = np.asarray(unpack_int4(*plain))
    bound = np.repeat(np.asarray(plain[1]), G, axis=0) / 2 + 1e-6  # rounding error per element
    assert np.all(np.abs(deq_plain - np.asarray(w)) <= bound)
    deq = np.asarray(unpack_int4(packed, s, low))
    assert np.mean((deq - np.asarray(w)) ** 2) < 0.9 * np.mean((deq_plain - np.asarray(w)) ** 2)
    got = int4_matmul(x, packed, s, low, interpret=INTERPRET)
    want = int4_matmul_ref(x, packed, s, low)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=TOL[dtype], atol=TOL[dtype] * np.abs(np.asarray(want, np.float32)).max())


def test_int4_keeps_weights_that_already_lie_on_a_16_level_grid():
    """Weights built as v * scale + low with v covering 0..15 in every group of 32 (what a
    GGUF Q4_1 block holds): quantized at G = 32 they come back exactly, refinement or not."""
    rng = np.random.default_rng(3)
    K, N, G = 128, 16, 32
    v = rng.integers(0, 16, (K // G, G, N))
    v[:, 0], v[:, 1] = 0, 15
    scale = rng.uniform(0.001, 0.01, (K // G, 1, N))
    low = rng.uniform(-0.08, 0.0, (K // G, 1, N))
    w = jnp.asarray((v * scale + low).reshape(K, N), jnp.float32)
    for steps in (0, 8):
        np.testing.assert_allclose(np.asarray(unpack_int4(*quantize_int4(w, G, steps))), np.asarray(w),
                                   rtol=0, atol=1e-6)


# --- CUDA lowering on a CPU-only machine -----------------------------------------------

SHAPES = {
    # name: (Hq, K, D, num_layers, hidden, intermediate)
    "smollm2-135m": (9, 3, 64, 30, 576, 1536),
    "llama-3-8b": (32, 8, 128, 32, 4096, 14336),
}


def _lower_cuda(fn, *args) -> str:
    """Lower for CUDA and check the kernel became a Triton call: with its default arguments a
    kernel compiles for the GPU (interpret mode would lower to plain HLO loops instead)."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text, text[:2000]
    return text


@pytest.mark.parametrize("name", list(SHAPES))
def test_kernels_lower_for_cuda(name):
    Hq, K, D, L, hidden, inter = SHAPES[name]
    sds = jax.ShapeDtypeStruct
    B, P, PS, NP, T = 64, 128, 16, 4096, 512
    f32, i32 = jnp.float32, jnp.int32
    cache = sds((L, NP, PS, K, D), f32)
    _lower_cuda(lambda q, k, v, bt, n: paged_decode_attention(q, k, v, bt, n, 3),
                sds((B, Hq, D), f32), cache, cache, sds((B, P), i32), sds((B,), i32))
    bf16 = sds((L, NP, PS, K, D), jnp.bfloat16)  # the engine's GPU dtype: bfloat16 queries and pages
    _lower_cuda(lambda q, k, v, bt, n: paged_decode_attention(q, k, v, bt, n, 3),
                sds((B, Hq, D), jnp.bfloat16), bf16, bf16, sds((B, P), i32), sds((B,), i32))
    _lower_cuda(lambda q, k, v, bt, n, pos: paged_prefill_attention(q, k, v, bt, n, pos, 3),
                sds((4, T, Hq, D), jnp.bfloat16), bf16, bf16, sds((4, P), i32), sds((4,), i32), sds((4, T), i32))
    _lower_cuda(lambda q, k, v, bt, n, pos: paged_prefill_attention(q, k, v, bt, n, pos, 3),
                sds((4, T, Hq, D), f32), cache, cache, sds((4, P), i32), sds((4,), i32), sds((4, T), i32))
    q8 = sds((L, NP, PS, K, D), jnp.int8)
    sc = sds((L, NP, PS, K), jnp.float16)  # an int8 KV cache's pages and scales (layers/attention.py)
    _lower_cuda(lambda q, k, v, bt, n, ks, vs: paged_decode_attention(q, k, v, bt, n, 0, k_scales=ks, v_scales=vs),
                sds((B, Hq, D), f32), q8, q8, sds((B, P), i32), sds((B,), i32), sc, sc)
    _lower_cuda(lambda q, k, v, bt, n, pos, ks, vs: paged_prefill_attention(q, k, v, bt, n, pos, 0, k_scales=ks,
                                                                            v_scales=vs),
                sds((4, T, Hq, D), f32), q8, q8, sds((4, P), i32), sds((4,), i32), sds((4, T), i32), sc, sc)
    f8 = sds((L, NP, PS, K, D), jnp.float8_e4m3fn)  # an fp8 KV cache (lowered; sm_89+ runs it)
    _lower_cuda(lambda q, k, v, bt, n: paged_decode_attention(q, k, v, bt, n, 0),
                sds((B, Hq, D), f32), f8, f8, sds((B, P), i32), sds((B,), i32))
    for M in (1, 64):
        _lower_cuda(int8_matmul, sds((M, hidden), f32), sds((hidden, inter), jnp.int8), sds((inter,), f32))
        g = 64 if hidden % 128 else 128
        _lower_cuda(int4_matmul, sds((M, hidden), f32), sds((hidden // 2, inter), jnp.uint8),
                    sds((hidden // g, inter), f32), sds((hidden // g, inter), f32))
        _lower_cuda(int8_matmul, sds((M, hidden), jnp.bfloat16), sds((hidden, inter), jnp.int8), sds((inter,), f32))


def test_the_engine_runs_the_kernels_compiled_unless_told_to_interpret():
    """The engine's default is compiled kernels (`interpret` only for tests on a CPU), and "auto"
    picks the Pallas kernels exactly when the backend is a GPU."""
    from unittest import mock

    from jaxserve.config import EngineConfig
    from jaxserve.layers.linear import resolve

    assert EngineConfig().interpret is False
    assert resolve("auto") == "xla"  # this CPU
    with mock.patch.object(jax, "default_backend", return_value="gpu"):
        assert resolve("auto") == "pallas"
