"""W8A8 products of a few rows on a CPU through a small C++ kernel (kernels/int8_gemv.cc),
called from jitted steps as an XLA FFI custom call.

Why: a decode step of one to a few sequences multiplies that many rows by every weight, so it
is bound by reading the weights. Below 8 rows XLA:CPU multiplies W8A8's int8 values as float32
(its int8 dot refuses one row), reading the int8 weights at about 9 GB/s; the kernel streams
them once with AVX-512 VNNI dot products, near the memory's speed (BENCHMARKS.md). It computes
the same exact integers as every other W8A8 path, so tokens do not change with it.

The kernel reads the weight in its own layout, made once when the model loads (`with_tiles`):
a quantized weight {"q8" [..., K, N], "scale" [..., N]} gains "tiles" [..., N'/64, K'/4, 64, 4]
(K and N padded to K' and N', multiples of 4 and 64, with zero weights) and "offset" [..., N']
int32, 128 times each channel's sum (the kernel reads x + 128 as unsigned bytes). That is a
second copy of the int8 weights in memory (128 MiB for the default model, its tied table
included): the int8 dot of 8 rows and more keeps reading "q8". The model hands the kernel
each layer's weights as the whole stack and the layer's index (`split_stacks`), not as a slice.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import jax
import jax.numpy as jnp

from jaxserve.layers import cpu_kernels

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "int8_gemv.cc"
TARGET = "jaxserve_int8_gemv"
TILE = 64  # output channels per tile
MAX_ROWS = 8  # the most rows one call multiplies


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Build, load and register the kernel (once); None when it is ready, else why it is not.
    A CPU without AVX-512 VNNI (its u8 x s8 dot products) keeps XLA's path: the kernel is
    written for them."""
    flags = cpu_kernels.cpu_flags().split()
    if jax.default_backend() == "cpu" and not {"avx512_vnni", "avx512bw"} <= set(flags):
        why = "this CPU has no AVX-512 VNNI"
    else:
        why = cpu_kernels.load(SOURCE, "JaxserveInt8Gemv", TARGET)
    if why:
        log.warning("CPU int8 matmul kernel unavailable, W8A8 rows run on XLA: %s", why)
    return why


def layout(q8: jax.Array) -> dict:
    """int8 [..., K, N] -> {"tiles" [..., N'/64, K'/4, 64, 4] int8, "offset" [..., N'] int32}."""
    *lead, K, N = q8.shape
    Kp, Np = -(-K // 4) * 4, -(-N // TILE) * TILE
    w = jnp.pad(q8, [(0, 0)] * len(lead) + [(0, Kp - K), (0, Np - N)])
    n = len(lead)
    tiles = w.reshape(*lead, Kp // 4, 4, Np // TILE, TILE).transpose(*range(n), n + 2, n, n + 3, n + 1)
    return {"tiles": tiles, "offset": 128 * jnp.sum(w.astype(jnp.int32), axis=-2)}


def with_tiles(params: dict) -> dict:
    """The model's parameters with every W8A8 weight laid out for the kernel too: the layers'
    [L, K, N] weights as they are, the tied embedding table [V, D] as the [D, V] it multiplies."""
    def walk(tree, tied: bool):
        if isinstance(tree, dict) and "q8" in tree:  # an int8 weight, multiplied W8A8
            q8 = jnp.swapaxes(tree["q8"], -1, -2) if tied else tree["q8"]
            return {**tree, **jax.jit(layout)(q8)}
        if isinstance(tree, dict):
            return {k: walk(v, k == "embed") for k, v in tree.items()}
        return tree
    return walk(params, False)


STACKED = ("tiles", "offset")  # the leaves the kernel reads whole, with a layer index


def split_stacks(layers: dict) -> tuple[dict, dict]:
    """(the layers' parameters without the kernel's leaves, those leaves {name: {"tiles",
    "offset"}} of every layer). A scan over the layers would slice each layer's share out of
    them, and XLA copies such a slice before a custom call reads it (the weights' bytes read
    and written again every step); the kernel takes the whole stack and the layer's index."""
    scanned, whole = {}, {}
    for name, w in layers.items():
        if isinstance(w, dict) and "tiles" in w:
            scanned[name] = {k: a for k, a in w.items() if k not in STACKED}
            whole[name] = {k: w[k] for k in STACKED}
        else:
            scanned[name] = w
    return scanned, whole


def join_stacks(p: dict, whole: dict, layer: jax.Array) -> dict:
    """One layer's parameters (a scan's slice) with the kernel's whole stacks and its index."""
    return {**p, **{name: {**p[name], **stack, "layer": layer} for name, stack in whole.items()}}


def gemv(xq: jax.Array, w: dict, n: int) -> jax.Array:
    """int8 rows [M, K] (M <= MAX_ROWS) @ the weight laid out in `w` -> int32 [M, n], exactly.
    `w` holds one weight's "tiles" and "offset", or a stack of them and the "layer" to take."""
    if unavailable():  # (also what registers the kernel, once)
        raise RuntimeError(f"CPU int8 matmul kernel unavailable: {unavailable()}")
    tiles, offset, layer = w["tiles"], w["offset"], w.get("layer", 0)
    if tiles.ndim == 4:  # one weight: a stack of one
        tiles, offset = tiles[None], offset[None]
    M, K = xq.shape
    Kp = tiles.shape[-3] * 4
    if Kp != K:
        xq = jnp.pad(xq, ((0, 0), (0, Kp - K)))
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((M, offset.shape[-1]), jnp.int32))
    out = call(xq, tiles, offset, jnp.asarray(layer, jnp.int32))
    return out[:, :n] if out.shape[1] != n else out
