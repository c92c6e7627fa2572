"""The one dispatch point for matmuls with weights: float, int8 or int4 weight-only.

A weight is a float array [K, N], or a quantized dict (jaxserve/checkpoint/quantize.py):
{"q8", "scale"} or {"q4", "scale", "low"}. `impl` picks how a quantized weight is multiplied:
  "pallas"  the Pallas kernels (pallas_kernels/quantized_matmul), which read the
            quantized bytes and widen them in registers: the GPU path;
  "xla"     dequantize inside the jitted step and run one XLA dot (the reference,
            and the path everywhere but a GPU);
  "w8a8"    int8 activations x int8 weights: each row of x is quantized on the fly
            (absmax over the row, one scale per token), multiplied with the int8 weight
            into int32 by XLA (YNNPACK on a CPU), and rescaled by the token and channel
            scales. Below W8A8_MIN_ROWS rows the same int8 values are multiplied as
            float32, from W8A8_BF16_ROWS as bfloat16, exactly (`_exact_int_dot`): the
            same result bit for bit, faster there; on a CPU, below W8A8_MIN_ROWS rows a
            weight the runner laid out for it ("tiles": layers/cpu_gemv.py) is multiplied by
            a C++ kernel instead, the same integers again, faster still;
  "auto"    pallas on a GPU, xla elsewhere.
Float weights always take a plain XLA dot. A weight quantized for W8A8 also carries the
signs of the rotation it was quantized under ({"q8", "scale", "signs"}: layers/rotation.py):
its inputs are rotated first, whatever the path, since the weight is R^T W. (The signs are
fixed by the input width, `input_signs`; the leaf marks the weight as rotated.)

Why W8A8 picks per row count (scripts/bench_matmul_paths.py measures it; on our 2-core
AVX-512 machines, the default model's 30 layers of the seven projections, lax.scan):
                      1 row   4 rows   8 rows   64 rows
    float32 weights   18.5    21.9     23.4     97.3  ms
    int8, dequantized 11.8    12.1     15.7     82.3  ms  (XLA fuses the widening into the dot)
    W8A8 int8 x int8  21.0    21.2     15.9     60.9  ms  (YNNPACK refuses M = 1; padded to 8)
so below 8 rows the int8 weight is widened inside a float32 dot and from 8 rows on both
operands are int8 in an int32 dot. W8A8 widens the int8 *activations* too below 8 rows, and
sums over chunks of K short enough that float32 holds every partial sum exactly: the result
is the integer the int8 dot computes, so a sequence's tokens do not depend on how many rows
its batch has (batch invariance; exact speculative decoding, whose verify step has more rows
than a decode step). At prefill sizes YNNPACK's int8 dot falls behind this CPU's bfloat16 dot
(AVX512-BF16), which holds int8 values exactly, so from W8A8_BF16_ROWS rows the same integers
go through bfloat16 (the stack above, rotated W8A8, 2026-12-06):
                      256 rows   512 rows   1024 rows
    int8 x int8        236.6      432.0      878.2  ms
    as served          235.6      336.7      691.6  ms  (bfloat16 from 512 rows)
The tied lm_head ([V, D] table, 49152 x 576):
                      1 row   8 rows   64 rows
    float32 table      5.0    10.1     25.0  ms
    int8, widened     46.7    49.8     57.8  ms  (whole: a 113 MB float copy per call)
    int8, by chunks    2.2     5.4     23.7  ms  (4096 rows at a time, _widened_rows_dot)
    W8A8 int8 x int8   3.4     3.7     13.9  ms
so "xla" widens it chunk by chunk, and "w8a8" multiplies int8 x int8 from 8 rows and its int8
values widened chunk by chunk (exactly, as above) below.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.layers import cpu_gemv
from jaxserve.layers.parallel import weight_specs
from jaxserve.layers.rotation import rotate_inputs, unrotate_rows, unsigned
from pallas_kernels.quantized_matmul import int4_matmul, int8_matmul, unpack_int4

IMPLS = ("auto", "pallas", "xla", "w8a8")
W8A8_MIN_ROWS = 8  # fewer rows multiply the int8 values in float32, exactly (see the table above)
# int8 x int8 products are at most 127 * 127; float32 holds every integer below 2**24 exactly,
# so a sum of this many of them (1040 * 16129 < 2**24) is exact in any order.
EXACT_F32_TERMS = 2 ** 24 // 127 ** 2
W8A8_BF16_ROWS = 512  # from this many rows W8A8 multiplies its int8 values as bfloat16 (exactly)
W8A8_PAD_ROWS = 8  # YNNPACK runs no int8 dot with one row: pad up to this many
LOGITS_CHUNK = 4096  # rows of an int8 lm_head table widened at a time (see _widened_rows_dot)


def resolve(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown kernel implementation {impl!r} (choose from {', '.join(IMPLS)})")
    if impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return impl


def linear(x: jax.Array, w, impl: str = "xla", interpret: bool = False, mesh: Mesh | None = None,
           split: str | None = None) -> jax.Array:
    """x [..., K] @ w -> [..., N] in x's dtype.

    Under tensor parallelism (`mesh`, the weight split "column" or "row": layers/parallel.py)
    XLA's partitioner splits a dot by the weight's sharding; the Pallas kernels, which it
    cannot split, run per shard."""
    if isinstance(w, dict) and "signs" in w:  # quantized as R^T W: x @ W = (x R) @ (R^T W)
        return linear(rotate_inputs(x), unsigned(w), impl, interpret, mesh, split)
    if mesh is not None and impl == "pallas" and isinstance(w, dict):
        return _per_shard_linear(x, w, interpret, mesh, split)
    if not isinstance(w, dict):
        return x @ w
    lead, K = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, K)
    if "q8" in w:
        if impl == "w8a8":
            y = w8a8_matmul(flat, w["q8"], w["scale"], w if "tiles" in w else None)
        elif impl == "pallas":
            y = int8_matmul(flat, w["q8"], w["scale"], interpret=interpret)
        else:
            y = (flat @ w["q8"].astype(x.dtype)) * w["scale"].astype(x.dtype)
    else:
        if impl == "pallas":
            y = int4_matmul(flat, w["q4"], w["scale"], w["low"], interpret=interpret)
        else:
            y = flat @ unpack_int4(w["q4"], w["scale"], w["low"]).astype(x.dtype)
    return y.reshape(*lead, y.shape[-1]).astype(x.dtype)


def _per_shard_linear(x: jax.Array, w: dict, interpret: bool, mesh: Mesh, split: str) -> jax.Array:
    """A Pallas matmul on each device's slice of the weight: a column-parallel one gives each
    device its outputs [..., N/n]; a row-parallel one multiplies its inputs [..., K/n] and the
    partial sums are added over the devices (the layer's all-reduce)."""
    specs = weight_specs(split, w, mesh.size)
    if all(s == P() for s in jax.tree.leaves(specs, is_leaf=lambda s: isinstance(s, P))):
        return linear(x, w, "pallas", interpret)  # not divisible: whole on every device
    (axis,) = mesh.axis_names
    lead = [None] * (x.ndim - 1)
    if split == "column":
        fn = lambda x, w: linear(x, w, "pallas", interpret)  # noqa: E731
        x_spec, out_spec = P(), P(*lead, axis)
    else:
        fn = lambda x, w: jax.lax.psum(linear(x, w, "pallas", interpret), axis)  # noqa: E731
        x_spec, out_spec = P(*lead, axis), P()
    return jax.shard_map(fn, mesh=mesh, in_specs=(x_spec, specs), out_specs=out_spec, check_vma=False)(x, w)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] float -> (int8 [M, K], float32 scales [M, 1]): symmetric absmax per row (token)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    return jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8), scale


def _int8_dot(xq: jax.Array, wq: jax.Array, dims) -> jax.Array:
    """int8 [M, K] against an int8 weight, accumulated in int32; M padded to W8A8_PAD_ROWS."""
    M = xq.shape[0]
    if M < W8A8_PAD_ROWS:
        xq = jnp.pad(xq, ((0, W8A8_PAD_ROWS - M), (0, 0)))
    return jax.lax.dot_general(xq, wq, (dims, ((), ())), preferred_element_type=jnp.int32)[:M]


def _exact_int_dot(xq: jax.Array, wq: jax.Array, via=jnp.float32) -> jax.Array:
    """int8 [M, K] @ int8 [K, N] -> int32 [M, N], the int8 dot's exact result, as float dots.

    The int8 values are widened to `via` (float32, or bfloat16, whose 8-bit significand holds
    every int8 exactly) and multiplied with float32 accumulation; each dot covers at most
    EXACT_F32_TERMS of K, so all its partial sums are integers float32 holds exactly, whatever
    order the CPU adds them in; the chunks are added in int32. Where this is faster than
    YNNPACK's int8 dot (the table in the module docstring): float32 below 8 rows, where XLA
    fuses the weight's widening into the dot; bfloat16 from W8A8_BF16_ROWS rows (prefill),
    where this CPU's bfloat16 dot product instructions outrun its int8 ones."""
    K = xq.shape[1]
    n = -(-K // EXACT_F32_TERMS)
    size = -(-K // n)
    acc = None
    for lo in range(0, K, size):
        part = jax.lax.dot(xq[:, lo:lo + size].astype(via), wq[lo:lo + size].astype(via),
                           precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
        part = part.astype(jnp.int32)
        acc = part if acc is None else acc + part
    return acc


def w8a8_matmul(x: jax.Array, q8: jax.Array, scale: jax.Array, tiles: dict | None = None) -> jax.Array:
    """x [M, K] float, q8 int8 [K, N] with per-channel scale [N] -> float32 [M, N]. `tiles`: the
    weight laid out for the CPU kernel (layers/cpu_gemv.py), which then multiplies few rows.

    The same for a row whatever M is: the integer product is exact on every path."""
    xq, xs = quantize_rows(x)
    M = x.shape[0]
    if M < W8A8_MIN_ROWS and tiles is not None:
        acc = cpu_gemv.gemv(xq, tiles, q8.shape[1])
    elif M < W8A8_MIN_ROWS:
        acc = _exact_int_dot(xq, q8, jnp.float32)
    elif M >= W8A8_BF16_ROWS:
        acc = _exact_int_dot(xq, q8, jnp.bfloat16)
    else:
        acc = _int8_dot(xq, q8, ((1,), (0,)))
    return acc.astype(jnp.float32) * xs * scale.astype(jnp.float32)


def _vocab_axis(table, mesh: Mesh | None) -> str | None:
    """The mesh axis a [V, D] table is split over by rows (layers/parallel.py), if it is."""
    rows = (table["q8"] if isinstance(table, dict) else table).shape[0]
    return mesh.axis_names[0] if mesh is not None and rows % mesh.size == 0 else None


def embed(table, tokens: jax.Array, dtype=jnp.float32, mesh: Mesh | None = None) -> jax.Array:
    """Embedding lookup; an int8 table {"q8" [V, D], "scale" [V]} is dequantized row by row.

    A table split by vocabulary over `mesh` is read per shard: each device looks up the
    tokens in its rows (zeros for the others) and the rows are summed over the devices."""
    if isinstance(table, dict) and "signs" in table:  # rows of E R, rotated back to rows of E
        return unrotate_rows(embed(unsigned(table), tokens, dtype, mesh))
    axis = _vocab_axis(table, mesh)
    if axis is not None:
        def local(table, tokens):
            rows = (table["q8"] if isinstance(table, dict) else table).shape[0]
            idx = tokens - jax.lax.axis_index(axis) * rows
            inside = (idx >= 0) & (idx < rows)
            x = embed(table, jnp.where(inside, idx, 0), dtype)
            return jax.lax.psum(jnp.where(inside[..., None], x, jnp.zeros((), x.dtype)), axis)
        return jax.shard_map(local, mesh=mesh, in_specs=(P(axis), P()), out_specs=P(), check_vma=False)(table, tokens)
    if not isinstance(table, dict):
        return table[tokens]
    return (table["q8"][tokens].astype(dtype) * table["scale"][tokens][..., None].astype(dtype))


def tied_logits(hidden: jax.Array, table, impl: str = "xla", mesh: Mesh | None = None) -> jax.Array:
    """hidden [..., D] against the embedding table [V, D] (tied lm_head) -> [..., V].

    An int8 table's per-row scales are per output channel of this product, so they are
    applied after the dot. (Always XLA: the table is [V, D], not the kernels' [K, N].)
    With impl "w8a8" the hidden rows are quantized too, at every row count (below
    W8A8_MIN_ROWS rows multiplied as float32, exactly, where that is faster). A table split by
    vocabulary over `mesh` gives each device its logits [..., V/n] (a per-shard product:
    the chunked dot below scans the table's rows, which the partitioner would gather)."""
    if isinstance(table, dict) and "signs" in table:  # a table quantized as E R: h E^T = (h R) (E R)^T
        return tied_logits(rotate_inputs(hidden), unsigned(table), impl, mesh)
    axis = _vocab_axis(table, mesh)
    if axis is not None:
        lead = [None] * (hidden.ndim - 1)
        return jax.shard_map(lambda h, t: tied_logits(h, t, impl), mesh=mesh, in_specs=(P(), P(axis)),
                             out_specs=P(*lead, axis), check_vma=False)(hidden, table)
    if not isinstance(table, dict):
        return jnp.einsum("...D,VD->...V", hidden, table)
    lead, flat = hidden.shape[:-1], hidden.reshape(-1, hidden.shape[-1])
    if impl == "w8a8":
        xq, xs = quantize_rows(flat)
        if flat.shape[0] < W8A8_MIN_ROWS and "tiles" in table:  # the CPU kernel (the [D, V] it multiplies)
            acc = cpu_gemv.gemv(xq, table, table["q8"].shape[0]).astype(jnp.float32)
        elif flat.shape[0] < W8A8_MIN_ROWS and flat.shape[1] <= EXACT_F32_TERMS:  # exact, as _exact_int_dot
            acc = _widened_rows_dot(xq.astype(jnp.float32), table["q8"])
        else:
            acc = _int8_dot(xq, table["q8"], ((1,), (1,))).astype(jnp.float32)
        out = acc * xs * table["scale"].astype(jnp.float32)
        return out.reshape(*lead, -1).astype(hidden.dtype)
    out = _widened_rows_dot(flat, table["q8"])
    return out.reshape(*lead, -1) * table["scale"].astype(hidden.dtype)


def _widened_rows_dot(x: jax.Array, q8: jax.Array, chunk: int = LOGITS_CHUNK) -> jax.Array:
    """x [M, D] float against an int8 table [V, D] -> [M, V], widened `chunk` rows at a time.

    Widened whole, the table is a float copy four times its size (113 MB for the default
    model's 49152 x 576) written and read back from memory on every call: 46 ms at one row
    on our CPUs. A `lax.map` over row chunks widens each one where the dot reads it (2-3 ms)."""
    V, D = q8.shape
    main = V - V % chunk
    parts = []
    if main:
        blocks = jax.lax.map(lambda w: x @ w.astype(x.dtype).T, q8[:main].reshape(main // chunk, chunk, D))
        parts.append(jnp.moveaxis(blocks, 0, 1).reshape(x.shape[0], main))  # [V/chunk, M, chunk] -> [M, main]
    if main < V:
        parts.append(x @ q8[main:].astype(x.dtype).T)
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
