"""Prefill / extend attention over block tables: a chunk of new query tokens against the
sequence's cached prefix plus the chunk itself (already written to the cache), causal.

This is what chunked prefill and prefix caching need: a chunk at positions
[start, start + T) attends to every key at a position <= its own, wherever those keys'
pages are. Grid (B, K, T / BQ): one program per sequence, KV head and block of BQ query
tokens; its BQ * G query rows (token-major, G heads each, G padded to a power of two)
walk the pages up to the sequence's context length with an online softmax, two dots
per page ([M, D] x [D, PS] and [M, PS] x [PS, D]; M = BQ * G >= 16 as tl.dot needs).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.paged_attention.common import initial_carry, load_page, normalised, online_softmax_step, whole

def _kernel(ctx_ref, layer_ref, bt_ref, qpos_ref, q_ref, k_ref, v_ref, *rest, page_size, scale, soft_cap, window):
    *scale_refs, o_ref = rest
    b, h = pl.program_id(0), pl.program_id(1)
    ctx = ctx_ref[b]
    layer = layer_ref[0]
    q = q_ref[...].astype(jnp.float32) * scale  # [M, D]
    qpos = qpos_ref[...]  # [M]
    M, D = q.shape
    last = jnp.minimum(jnp.max(qpos) + 1, ctx)  # no key past the last query or the context
    n_pages = (last + page_size - 1) // page_size
    first = 0 if window is None else jnp.maximum(jnp.min(qpos) - window + 1, 0) // page_size

    def body(i, carry):
        k, v = load_page(k_ref, v_ref, scale_refs, layer, bt_ref[b, i], h)  # [PS, D]
        s = jnp.dot(q, k.T, preferred_element_type=jnp.float32)  # [M, PS]
        pos = i * page_size + jax.lax.broadcasted_iota(jnp.int32, (M, page_size), 1)
        visible = (pos <= qpos[:, None]) & (pos < ctx)
        if window is not None:
            visible &= pos > qpos[:, None] - window
        return online_softmax_step(carry, s, visible, soft_cap,
                                   lambda p: jnp.dot(p, v, preferred_element_type=jnp.float32))

    _, l, acc = jax.lax.fori_loop(first, n_pages, body, initial_carry(M, D))
    o_ref[...] = normalised(l, acc, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "soft_cap", "sliding_window", "block_q", "interpret"))
def paged_prefill_attention(q, k_cache, v_cache, block_tables, context_lens, q_positions, layer=0, *,
                            k_scales=None, v_scales=None, scale=None, soft_cap=None, sliding_window=None,
                            block_q=16, interpret=False):
    """q [B, T, Hq, D]; caches [L, NP, PS, K, D] holding this chunk's K/V already;
    block_tables [B, P]; context_lens [B] (keys visible); q_positions [B, T]. Query
    rows with no visible key give zeros. Returns [B, T, Hq, D] in q's dtype."""
    B, T, Hq, D = q.shape
    _, _, PS, K, _ = k_cache.shape
    G = Hq // K
    Gp = pl.next_power_of_2(G)
    BQ = max(block_q, pl.next_power_of_2(-(-16 // Gp)))
    Tp = -(-T // BQ) * BQ
    qg = q.reshape(B, T, K, G, D)
    qg = jnp.pad(qg, ((0, 0), (0, Tp - T), (0, 0), (0, Gp - G), (0, 0)))
    qg = qg.transpose(0, 2, 1, 3, 4).reshape(B, K, Tp * Gp, D)  # rows (token, head)
    qpos = jnp.pad(q_positions.astype(jnp.int32), ((0, 0), (0, Tp - T)), constant_values=-1)
    qpos = jnp.repeat(qpos, Gp, axis=1)  # [B, Tp * Gp]
    M = BQ * Gp
    quantized = k_scales is not None
    layer = jnp.asarray(layer, jnp.int32).reshape(1)
    ctx = context_lens.astype(jnp.int32)
    block_tables = block_tables.astype(jnp.int32)
    args = [ctx, layer, block_tables, qpos, qg, k_cache, v_cache] + ([k_scales, v_scales] if quantized else [])
    in_specs = [whole(ctx), whole(layer), whole(block_tables),
                pl.BlockSpec((None, M), lambda b, h, t: (b, t)),
                pl.BlockSpec((None, None, M, D), lambda b, h, t: (b, h, t, 0)),
                whole(k_cache), whole(v_cache)] + ([whole(k_scales), whole(v_scales)] if quantized else [])
    kernel = functools.partial(_kernel, page_size=PS, scale=D ** -0.5 if scale is None else scale,
                               soft_cap=soft_cap, window=sliding_window)
    out = pl.pallas_call(
        kernel,
        grid=(B, K, Tp // BQ),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, M, D), lambda b, h, t: (b, h, t, 0)),
        out_shape=jax.ShapeDtypeStruct((B, K, Tp * Gp, D), q.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),  # the Triton lowering
        name="paged_prefill_attention",
    )(*args)
    out = out.reshape(B, K, Tp, Gp, D)[:, :, :T, :G].transpose(0, 2, 1, 3, 4)
    return out.reshape(B, T, Hq, D)
