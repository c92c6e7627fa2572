"""The C++ decode attention kernel for CPUs (jaxserve/layers/cpu_attention.py), built here
with the machine's compiler, against the paged-attention reference and against XLA's path.

The kernel reads the whole [L, NP, PS, K, D] cache through block tables; these cases hand
pages out shuffled with noise pages beside them, cover the specialised head dims (64, 128)
and the generic one, GQA ratios, context lengths on and off page boundaries, a later layer,
sliding windows, rows that see nothing, and the kernel inside a jitted scan that carries
and updates the cache, as the engine's steps do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.config import EngineConfig
from jaxserve.layers import cpu_attention
from jaxserve.layers.attention import write_kv
from pallas_kernels.paged_attention.ref import paged_attention_ref
from test_kernels import make_cache

CASES = [
    # page size, kv heads, q heads per kv head, head dim, context lengths
    (16, 3, 3, 64, [1, 16, 17, 40]),
    (16, 1, 1, 64, [5, 33]),
    (32, 8, 1, 128, [31, 1, 64]),
    (4, 2, 4, 128, [9, 12]),
    (8, 2, 3, 16, [3, 8, 25]),  # a head dim without a specialised loop
    (16, 4, 2, 96, [70, 2, 1]),
]


def run(q, k, v, tables, lens, positions, layer, window=None):
    fn = jax.jit(cpu_attention.paged_decode_attention, static_argnames="sliding_window")
    return np.asarray(fn(q, k, v, tables, lens, positions, jnp.int32(layer), sliding_window=window))


def reference(q, k, v, tables, lens, positions, layer, window=None):
    out = paged_attention_ref(q[:, None], k, v, tables, lens, positions[:, None], layer=layer, sliding_window=window)
    return np.asarray(out[:, 0])


@pytest.mark.parametrize("PS,K,G,D,lengths", CASES)
@pytest.mark.parametrize("window", [None, 5])
def test_kernel_matches_the_reference(PS, K, G, D, lengths, window):
    k, v, _, _, tables = make_cache(PS + D + len(lengths), lengths, PS, K, D, jnp.float32, False, L=3)
    q = jnp.asarray(np.random.default_rng(7).standard_normal((len(lengths), K * G, D)) * 2, jnp.float32)
    lens = jnp.asarray(lengths, jnp.int32)
    for layer in (0, 2):
        got = run(q, k, v, tables, lens, lens - 1, layer, window)
        np.testing.assert_allclose(got, reference(q, k, v, tables, lens, lens - 1, layer, window), atol=2e-5, rtol=2e-5)


def test_the_query_position_bounds_the_keys_and_empty_rows_give_zeros():
    """attend_one's mask: keys up to the query's position and under the context length; a row
    with context length 0 (a padding row of the batch) gives zeros, not NaN."""
    k, v, _, _, tables = make_cache(3, [40, 40, 40], 16, 2, 64, jnp.float32, False)
    q = jnp.asarray(np.random.default_rng(3).standard_normal((3, 4, 64)), jnp.float32)
    lens = jnp.asarray([40, 0, 40], jnp.int32)
    positions = jnp.asarray([20, 0, 39], jnp.int32)  # row 0 sees keys 0..20 only
    got = run(q, k, v, tables, lens, positions, 1)
    want = reference(q, k, v, tables, lens, positions, 1)
    assert np.all(got[1] == 0)
    np.testing.assert_allclose(got[[0, 2]], want[[0, 2]], atol=2e-5, rtol=2e-5)
    shorter = run(q, k, v, tables, jnp.asarray([21, 0, 40], jnp.int32), positions, 1)
    np.testing.assert_array_equal(shorter[0], got[0])


def test_a_rows_result_does_not_depend_on_its_batch():
    """Each sequence is computed on its own (one task per sequence), so its bits are the same
    alone and among others, whichever thread runs it."""
    lengths = [37, 5, 100, 64, 1, 77]
    k, v, _, _, tables = make_cache(11, lengths, 16, 3, 64, jnp.float32, False)
    q = jnp.asarray(np.random.default_rng(4).standard_normal((len(lengths), 9, 64)), jnp.float32)
    lens = jnp.asarray(lengths, jnp.int32)
    batched = run(q, k, v, tables, lens, lens - 1, 1)
    for i in range(len(lengths)):
        alone = run(q[i:i + 1], k, v, tables[i:i + 1], lens[i:i + 1], lens[i:i + 1] - 1, 1)
        np.testing.assert_array_equal(alone[0], batched[i])


def test_kernel_inside_a_scan_that_updates_the_cache():
    """As in a decode step: each layer writes this step's K/V into the carried cache, then the
    kernel reads the cache it was given, the new token included."""
    L, PS, K, G, D = 3, 16, 2, 2, 64
    lengths = [17, 32, 5]
    k, v, _, _, tables = make_cache(5, lengths, PS, K, D, jnp.float32, False, L=L)
    B = len(lengths)
    lens = jnp.asarray(lengths, jnp.int32)
    pos = lens - 1
    slots = (jnp.take_along_axis(tables, (pos // PS)[:, None], axis=1)[:, 0] * PS + pos % PS)[:, None]  # [B, 1]
    rng = np.random.default_rng(6)
    new = jnp.asarray(rng.standard_normal((L, B, 1, K, D)), jnp.float32)
    q = jnp.asarray(rng.standard_normal((L, B, K * G, D)), jnp.float32)

    def step(kc, vc, use_kernel):
        def body(carry, xs):
            kc, vc = carry
            layer, new_l, q_l = xs
            kc, vc = write_kv(kc, layer, slots, new_l), write_kv(vc, layer, slots, -new_l)
            if use_kernel:
                out = cpu_attention.paged_decode_attention(q_l, kc, vc, tables, lens, pos, layer)
            else:
                out = paged_attention_ref(q_l[:, None], kc, vc, tables, lens, pos[:, None], layer=layer)[:, 0]
            return (kc, vc), out
        return jax.lax.scan(body, (kc, vc), (jnp.arange(L, dtype=jnp.int32), new, q))

    (kc, vc), got = jax.jit(step, static_argnums=2)(k, v, True)
    (kr, vr), want = jax.jit(step, static_argnums=2)(k, v, False)
    np.testing.assert_array_equal(np.asarray(kc), np.asarray(kr))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_auto_picks_the_kernel_for_float32_pages_only():
    from jaxserve.engine.runner import resolve_attention

    assert resolve_attention(EngineConfig()) == "cpu"
    assert resolve_attention(EngineConfig(kv_cache_dtype="int8")) == "xla"
    assert resolve_attention(EngineConfig(attention_impl="xla")) == "xla"
    assert resolve_attention(EngineConfig(), ahead_of_time=True) == "xla"
    with pytest.raises(ValueError, match="float32 KV pages"):
        resolve_attention(EngineConfig(attention_impl="cpu", kv_cache_dtype="int8"))


def test_loading_the_kernel_leaves_denormals_alone():
    """The library is compiled with -ffast-math but not linked with it: GCC's crtfastmath.o would
    switch the loading thread to flush-to-zero, changing every float computation after it."""
    assert cpu_attention.available()
    tiny = np.float32(1e-40)  # a float32 denormal
    assert tiny * np.float32(1.0) != 0 and np.asarray([tiny], np.float32)[0] / 2 != 0
