"""The CPU int8 matmul kernel (layers/cpu_gemv.py, kernels/int8_gemv.cc): the exact int8
product of a few rows, so W8A8 gives a row the same bits with it as without it, and the
engine the same tokens."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.layers import cpu_gemv, cpu_kernels
from jaxserve.layers.linear import W8A8_MIN_ROWS, _exact_int_dot, linear, tied_logits


VNNI = {"avx512_vnni", "avx512bw"} <= set(cpu_kernels.cpu_flags().split())
needs_vnni = pytest.mark.skipif(not VNNI, reason="this CPU has no AVX-512 VNNI: W8A8 keeps XLA's path")


def test_the_kernel_builds_where_the_cpu_has_vnni():
    assert (cpu_gemv.unavailable() is None) == VNNI, cpu_gemv.unavailable()


@needs_vnni
@pytest.mark.parametrize("K,N", [(576, 192), (1536, 576), (13, 70), (4, 64)])
def test_the_kernel_is_the_exact_int8_product(K, N):
    """Every row count it takes (1-8), shapes that need padding (K not a multiple of 4, N not
    of 64), and the extreme products (-127 * 127 over all of K)."""
    rng = np.random.default_rng(K * N)
    q8 = jnp.asarray(rng.integers(-127, 128, (K, N)), jnp.int8)
    w = cpu_gemv.layout(q8)
    assert w["tiles"].shape == (-(-N // 64), -(-K // 4), 64, 4) and w["offset"].dtype == jnp.int32
    f = jax.jit(lambda x, w: cpu_gemv.gemv(x, w, N))
    for M in range(1, cpu_gemv.MAX_ROWS + 1):
        xq = jnp.asarray(rng.integers(-127, 128, (M, K)), jnp.int8)
        got = f(xq, w)
        assert got.shape == (M, N) and got.dtype == jnp.int32
        assert np.array_equal(np.asarray(got), np.asarray(_exact_int_dot(xq, q8))), M
    ones = jnp.full((K, N), 127, jnp.int8)
    got = cpu_gemv.gemv(jnp.full((2, K), -127, jnp.int8), cpu_gemv.layout(ones), N)
    assert np.asarray(got).tolist() == [[-127 * 127 * K] * N] * 2


@needs_vnni
def test_tiled_weights_give_a_row_the_same_bits():
    """with_tiles lays out every int8 weight of a parameter tree (stacked layers as they are,
    the tied table as the [D, V] it multiplies); W8A8 products and the tied lm_head of 1-7
    rows through the kernel equal XLA's exact path, inside a scan over the layers too: a
    layer's slice of the stack, or the whole stack and the layer's index (split_stacks)."""
    rng = np.random.default_rng(3)
    L, K, N, V = 2, 96, 80, 300
    layer = {"q8": jnp.asarray(rng.integers(-127, 128, (L, K, N)), jnp.int8),
             "scale": jnp.asarray(rng.random((L, N)) + 0.5, jnp.float32)}
    table = {"q8": jnp.asarray(rng.integers(-127, 128, (V, K)), jnp.int8),
             "scale": jnp.asarray(rng.random(V) + 0.5, jnp.float32)}
    params = {"layers": {"wq": layer}, "embed": table, "final_norm": jnp.ones(K)}
    tiled = cpu_gemv.with_tiles(params)
    assert tiled["layers"]["wq"]["tiles"].shape == (L, 2, K // 4, 64, 4)
    assert tiled["embed"]["tiles"].shape == (5, K // 4, 64, 4) and "tiles" not in params["embed"]

    def stack(x, layers):  # each layer's slice, as a plain scan gives it
        return jax.lax.scan(lambda c, p: (c, linear(c, p, "w8a8")), x, layers)[1]

    def in_place(x, layers):  # the whole stacks and the layer's index, as the model passes them
        scanned, whole = cpu_gemv.split_stacks({"wq": layers})
        body = lambda c, pl: (c, linear(c, cpu_gemv.join_stacks(pl[0], whole, pl[1])["wq"], "w8a8"))  # noqa: E731
        return jax.lax.scan(body, x, (scanned, jnp.arange(L, dtype=jnp.int32)))[1]

    for rows in (1, 3, W8A8_MIN_ROWS - 1):
        x = jnp.asarray(rng.standard_normal((rows, K)), jnp.float32)
        want = jax.jit(stack)(x, layer)
        for f in (stack, in_place):
            got = jax.jit(f)(x, tiled["layers"]["wq"])
            assert np.array_equal(np.asarray(got), np.asarray(want)), (f, rows)
        head = jax.jit(lambda h, t: tied_logits(h, t, "w8a8"))
        assert np.array_equal(np.asarray(head(x, tiled["embed"])), np.asarray(head(x, table))), rows


def test_the_engine_gives_the_same_tokens_with_the_kernel(tiny_model_dir):
    """W8A8 engines with and without the kernel: the kernel's weights are laid out only where
    it is on (and the CPU can run it), and greedy tokens of four sequences that end one after
    another (decode steps of 4 rows, multi-step and overlapped as served) are identical. (One
    row through the kernel against 16 through the int8 dot: tests/test_rotation.py's W8A8
    batch-invariance test.)"""
    import random

    from jaxserve.config import EngineConfig
    from jaxserve.engine.engine import Engine
    from jaxserve.engine.sequence import SamplingParams

    base = dict(max_num_seqs=4, decode_batch_buckets=(4,), context_buckets=(128,), max_model_len=128,
                prefill_length_buckets=(64,), prefill_batch_buckets=(4,), quantization="w8a8")
    engines = {on: Engine(tiny_model_dir, EngineConfig(**base, cpu_matmul_kernel=on), warmup=False)
               for on in (False, True)}
    assert {on: "tiles" in e.runner.params["layers"]["wq"] for on, e in engines.items()} == {False: False, True: VNNI}
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 40))] for _ in range(4)]

    def run(engine):  # four sequences that end one after another
        seqs = [engine.add_request(p, SamplingParams(max_tokens=6 + 6 * i, temperature=0, ignore_eos=True))
                for i, p in enumerate(prompts)]
        engine.run_until_done()
        return [s.output_ids for s in seqs]

    assert run(engines[True]) == run(engines[False])
