"""Decode attention over block tables: one query token per sequence, K/V read page by page.

Grid (B, K): one program per sequence and KV head, which serves that head's G query
heads together (grouped-query attention reads each K/V page once for all of them).
The program walks the sequence's pages (only the ones its length covers, or with a
sliding window only the last ones) with an online softmax: running max m, running
sum l and accumulator acc [G, D], so nothing of size S is ever materialised.

Products are written as broadcast-multiply-and-reduce rather than tl.dot, because G is
small (1-8) and a Triton dot needs every dimension >= 16. G is padded to a power of
two (Triton blocks must be), the padded query rows are zeros and are dropped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.paged_attention.common import initial_carry, load_page, normalised, online_softmax_step, whole

def _kernel(len_ref, layer_ref, bt_ref, q_ref, k_ref, v_ref, *rest, page_size, scale, soft_cap, window):
    *scale_refs, o_ref = rest
    b, h = pl.program_id(0), pl.program_id(1)
    length = len_ref[b]
    layer = layer_ref[0]
    q = q_ref[...].astype(jnp.float32) * scale  # [G, D]
    Gp, D = q.shape
    n_pages = (length + page_size - 1) // page_size
    first = 0 if window is None else jnp.maximum(length - window, 0) // page_size

    def body(i, carry):
        k, v = load_page(k_ref, v_ref, scale_refs, layer, bt_ref[b, i], h)  # [PS, D]
        s = jnp.sum(q[:, None, :] * k[None, :, :], axis=-1)  # [G, PS]
        pos = i * page_size + jax.lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        visible = pos < length
        if window is not None:
            visible &= pos > length - 1 - window
        return online_softmax_step(carry, s, visible, soft_cap,
                                   lambda p: jnp.sum(p[:, :, None] * v[None, :, :], axis=1))  # [G, D]

    _, l, acc = jax.lax.fori_loop(first, n_pages, body, initial_carry(Gp, D))
    o_ref[...] = normalised(l, acc, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "interpret"))
def paged_decode_attention(q, k_cache, v_cache, block_tables, lengths, layer=0, *, k_scales=None, v_scales=None,
                           scale=None, soft_cap=None, sliding_window=None, interpret=False):
    """q [B, Hq, D]; caches [L, NP, PS, K, D] (float, or int8 with scales [L, NP, PS, K]);
    block_tables [B, P] int32; lengths [B] int32 (keys visible, the query sits at
    length - 1; 0 gives zeros); layer: which cache layer. Returns [B, Hq, D] in q's dtype."""
    B, Hq, D = q.shape
    _, _, PS, K, _ = k_cache.shape
    G = Hq // K
    Gp = pl.next_power_of_2(G)
    qg = q.reshape(B, K, G, D)
    if Gp != G:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
    quantized = k_scales is not None
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    lengths = lengths.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    args = [lengths, layer, block_tables, qg, k_cache, v_cache] + ([k_scales, v_scales] if quantized else [])
    in_specs = [whole(lengths), whole(layer), whole(block_tables),
                pl.BlockSpec((None, None, Gp, D), lambda b, h: (b, h, 0, 0)),
                whole(k_cache), whole(v_cache)] + ([whole(k_scales), whole(v_scales)] if quantized else [])
    kernel = functools.partial(_kernel, page_size=PS, scale=D ** -0.5 if scale is None else scale,
                               soft_cap=soft_cap, window=sliding_window)
    out = pl.pallas_call(
        kernel,
        grid=(B, K),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, Gp, D), lambda b, h: (b, h, 0, 0)),
        out_shape=jax.ShapeDtypeStruct((B, K, Gp, D), q.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),  # the Triton lowering
        name="paged_decode_attention",
    )(*args)
    return out[:, :, :G].reshape(B, Hq, D)
