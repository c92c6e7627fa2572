"""The Llama family (Llama 1-3.x, Mistral, Qwen2, SmolLM) as pure functions over a pytree.

Parameters are a plain nested dict of arrays, with the layers' weights stacked on a
leading axis L so that `jax.lax.scan` runs one compiled layer body L times: a 30-layer
model compiles one layer instead of thirty, which is most of the start-up time on a
2-core machine. Linear weights are stored input-major (`[D_in, D_out]`), so every
projection is `x @ w`, through `layers.linear` (which also takes int8/int4 weights).

    embed      [V, D]
    layers     attn_norm [L, D]
               wq [L, D, Hq*Dh]   wk, wv [L, D, K*Dh]   (bq [L, Hq*Dh], bk, bv [L, K*Dh] with qkv bias)
               wo [L, Hq*Dh, D]
               mlp_norm [L, D]
               w_gate, w_up [L, D, F]   w_down [L, F, D]
               kv_keys [L, 2, K, Dh, Dh]  (only with a calibrated fp8 KV cache: checkpoint/kv_scales.py)
    final_norm [D]
    lm_head    [D, V]  (absent when embeddings are tied)

Attention takes explicit `AttentionMetadata` and an optional paged KV cache, so the
same forward serves the cache-free reference path and the paged engine.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.config import ModelConfig
from jaxserve.layers import cpu_gemv
from jaxserve.layers.attention import KEY_TRANSFORM, AttentionMetadata, attention
from jaxserve.layers.linear import embed, linear, tied_logits

Params = dict


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32, cast back before the scale (as HF does)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


@functools.lru_cache(maxsize=None)
def _inv_freq(cfg: ModelConfig) -> np.ndarray:
    return np.asarray(cfg.rope_inv_freq(), dtype=np.float32)


def rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding in the HF (`rotate_half`) layout. x [B, T, H, Dh]; positions [B, T]."""
    freqs = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]  # [B, T, Dh/2]
    cos = jnp.cos(freqs)[:, :, None, :]
    sin = jnp.sin(freqs)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _projections(meta: AttentionMetadata):
    """(column, row): the layer's matmuls, split one way or the other under tensor parallelism
    (layers/parallel.py)."""
    mm = functools.partial(linear, impl=meta.matmul_impl, interpret=meta.interpret, mesh=meta.mesh)
    return functools.partial(mm, split="column"), functools.partial(mm, split="row")


def _qkv(cfg: ModelConfig, meta: AttentionMetadata, p, x: jax.Array):
    """x [B, T, D] -> q [B, T, Hq, Dh], k and v [B, T, K, Dh] of one layer, q and k after RoPE."""
    B, T, _ = x.shape
    Hq, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    col, _ = _projections(meta)
    h = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q, k, v = col(h, p["wq"]), col(h, p["wk"]), col(h, p["wv"])
    if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    inv_freq = _inv_freq(cfg)
    return (rope(q.reshape(B, T, Hq, Dh), meta.positions, inv_freq),
            rope(k.reshape(B, T, K, Dh), meta.positions, inv_freq), v.reshape(B, T, K, Dh))


def _layer(cfg: ModelConfig, meta: AttentionMetadata, whole: dict, carry, layer_in):
    """One decoder block. carry = (x [B, T, D], kv_cache or None); layer_in = (params_l, l);
    `whole`: the CPU matmul kernel's weights of every layer, read in place (cpu_gemv.split_stacks)."""
    x, kv_cache = carry
    p, layer = layer_in
    p = cpu_gemv.join_stacks(p, whole, layer)
    return _block(cfg, meta, p, x, _qkv(cfg, meta, p, x), kv_cache, layer), None


def _block(cfg: ModelConfig, meta: AttentionMetadata, p, x: jax.Array, qkv, kv_cache, layer):
    """The decoder block over x [B, T, D] from its `_qkv`: attention, then the MLP, both
    residual. Returns (x, kv_cache)."""
    B, T, _ = x.shape
    col, row = _projections(meta)
    attn, kv_cache = attention(*qkv, meta, kv_cache, layer, p.get(KEY_TRANSFORM))
    x = x + row(attn.reshape(B, T, cfg.num_heads * cfg.head_dim), p["wo"])

    h = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    x = x + row(jax.nn.silu(col(h, p["w_gate"])) * col(h, p["w_up"]), p["w_down"])
    return x, kv_cache


def forward_hidden(params: Params, cfg: ModelConfig, tokens: jax.Array, meta: AttentionMetadata,
                   kv_cache: tuple[jax.Array, jax.Array] | None = None):
    """Run the decoder stack. tokens [B, T] -> (hidden [B, T, D] after the final norm, kv_cache).

    kv_cache, when given, is (k, v), each [L, num_pages, page_size, K, Dh]; it is returned updated.
    """
    x = embed(params["embed"], tokens, params["final_norm"].dtype, meta.mesh)  # [B, T, D]
    layers = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    scanned, whole = cpu_gemv.split_stacks(params["layers"])
    (x, kv_cache), _ = jax.lax.scan(functools.partial(_layer, cfg, meta, whole), (x, kv_cache), (scanned, layers))
    return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), kv_cache


def logits_from_hidden(params: Params, hidden: jax.Array, matmul_impl: str = "xla",
                       interpret: bool = False, mesh=None) -> jax.Array:
    """hidden [..., D] -> float32 logits [..., V] through lm_head or the tied embedding (split by
    vocabulary under tensor parallelism, `mesh`)."""
    if "lm_head" in params:
        out = linear(hidden, params["lm_head"], matmul_impl, interpret, mesh, "column")
    else:
        out = tied_logits(hidden, params["embed"], matmul_impl, mesh)
    return out.astype(jnp.float32)


def forward(params: Params, cfg: ModelConfig, tokens: jax.Array, meta: AttentionMetadata,
            kv_cache: tuple[jax.Array, jax.Array] | None = None):
    """Full forward: tokens [B, T] -> (logits [B, T, V] float32, kv_cache)."""
    hidden, kv_cache = forward_hidden(params, cfg, tokens, meta, kv_cache)
    return logits_from_hidden(params, hidden, meta.matmul_impl, meta.interpret, meta.mesh), kv_cache


def activations(params: Params, cfg: ModelConfig, tokens: list[int]):
    """Each layer's queries [T, Hq, Dh], keys and values [T, K, Dh] over one sequence (q and k
    after RoPE), cache-free, one layer at a time (one compiled layer for all): what an fp8 KV
    calibration reads (checkpoint/kv_scales.py)."""
    n = len(tokens)
    meta = reference_metadata(np.array([n]), n, cfg)

    @jax.jit
    def step(x, p, layer):
        qkv = _qkv(cfg, meta, p, x)
        return _block(cfg, meta, p, x, qkv, None, layer)[0], qkv

    x = embed(params["embed"], jnp.asarray([tokens], jnp.int32), params["final_norm"].dtype)
    for layer in range(cfg.num_layers):
        x, (q, k, v) = step(x, jax.tree.map(lambda a: a[layer], params["layers"]), layer)  # noqa: B023
        yield q[0], k[0], v[0]


def reference_metadata(lengths: np.ndarray, T: int, cfg: ModelConfig) -> AttentionMetadata:
    """Metadata for the cache-free path over right-padded prompts of the given lengths."""
    B = len(lengths)
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))
    return AttentionMetadata(positions=jnp.asarray(positions), context_lens=jnp.asarray(lengths, dtype=jnp.int32),
                             sliding_window=cfg.sliding_window)
