"""int8 and int4 weight-only matmul kernels (formats in ref.py).

Grid (M / BM, N / BN); each program loops over K in blocks of BK, loading a block of
x and the matching block of quantized weights, widening the weights to float32 in
registers and accumulating x_blk @ w_blk in float32, so HBM traffic is the quantized
bytes. int8 applies its per-column scale once at the end; int4 (BK = the group size)
unpacks each group's bytes into the group's first half (low nibbles) and second half
(high nibbles) and maps both through the group's scale and low before the dots. M is padded to BM (>= 16, tl.dot's
minimum), so a decode step with one row works too.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton


def _int8_kernel(x_ref, q_ref, s_ref, o_ref, *, block_k, k_total):
    BM, BN = o_ref.shape

    def body(i, acc):
        x = x_ref[:, pl.ds(i * block_k, block_k)].astype(jnp.float32)
        w = q_ref[pl.ds(i * block_k, block_k), :].astype(jnp.float32)
        return acc + jnp.dot(x, w, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, k_total // block_k, body, jnp.zeros((BM, BN), jnp.float32))
    o_ref[...] = (acc * s_ref[...][None, :]).astype(o_ref.dtype)


def _int4_kernel(x_ref, p_ref, s_ref, z_ref, o_ref, *, group, n_groups):
    BM, BN = o_ref.shape
    h = group // 2

    def body(i, acc):
        p = p_ref[pl.ds(i * h, h), :].astype(jnp.int32)  # [G/2, BN] bytes of group i
        scale, low = s_ref[i, :][None, :], z_ref[i, :][None, :]
        lo = (p & 0xF).astype(jnp.float32) * scale + low
        hi = (p >> 4).astype(jnp.float32) * scale + low
        x_lo = x_ref[:, pl.ds(i * group, h)].astype(jnp.float32)
        x_hi = x_ref[:, pl.ds(i * group + h, h)].astype(jnp.float32)
        acc += jnp.dot(x_lo, lo, preferred_element_type=jnp.float32)
        return acc + jnp.dot(x_hi, hi, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, n_groups, body, jnp.zeros((BM, BN), jnp.float32))
    o_ref[...] = acc.astype(o_ref.dtype)


def _pad_rows(x, bm):
    M = x.shape[0]
    Mp = -(-M // bm) * bm
    return (jnp.pad(x, ((0, Mp - M), (0, 0))) if Mp != M else x), M


def _block_n(N: int, want: int) -> int:
    bn = want
    while N % bn:
        bn //= 2
    if bn < 16:
        raise ValueError(f"N={N} needs a power-of-two factor >= 16 for the kernel's blocks")
    return bn


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "block_k", "interpret"))
def int8_matmul(x, q, scale, *, block_m=16, block_n=64, block_k=64, interpret=False):
    """x [M, K] @ (q [K, N] int8 * scale [N]) -> [M, N] in x's dtype."""
    K, N = q.shape
    while K % block_k:
        block_k //= 2
    bn = _block_n(N, block_n)
    xp, M = _pad_rows(x, block_m)
    out = pl.pallas_call(
        functools.partial(_int8_kernel, block_k=block_k, k_total=K),
        grid=(xp.shape[0] // block_m, N // bn),
        in_specs=[pl.BlockSpec((block_m, K), lambda i, j: (i, 0)),
                  pl.BlockSpec((K, bn), lambda i, j: (0, j)),
                  pl.BlockSpec((bn,), lambda i, j: (j,))],
        out_specs=pl.BlockSpec((block_m, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], N), x.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),  # the Triton lowering
        name="int8_matmul",
    )(xp, q, scale.astype(jnp.float32))
    return out[:M]


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "interpret"))
def int4_matmul(x, packed, scale, low, *, block_m=16, block_n=64, interpret=False):
    """x [M, K] @ int4 weights (packed [K / 2, N] uint8, scales and lows [K / G, N]) -> [M, N]."""
    half, N = packed.shape
    K = 2 * half
    group = K // scale.shape[0]
    bn = _block_n(N, block_n)
    xp, M = _pad_rows(x, block_m)
    out = pl.pallas_call(
        functools.partial(_int4_kernel, group=group, n_groups=scale.shape[0]),
        grid=(xp.shape[0] // block_m, N // bn),
        in_specs=[pl.BlockSpec((block_m, K), lambda i, j: (i, 0)),
                  pl.BlockSpec((half, bn), lambda i, j: (0, j)),
                  pl.BlockSpec((scale.shape[0], bn), lambda i, j: (0, j)),
                  pl.BlockSpec((scale.shape[0], bn), lambda i, j: (0, j))],
        out_specs=pl.BlockSpec((block_m, bn), lambda i, j: (i, j)),
        out_shape=jax.ShapeDtypeStruct((xp.shape[0], N), x.dtype),
        interpret=interpret,
        compiler_params=pltriton.CompilerParams(num_warps=4, num_stages=2),  # the Triton lowering
        name="int4_matmul",
    )(xp, packed, scale.astype(jnp.float32), low.astype(jnp.float32))
    return out[:M]
