"""Attention over a paged KV cache: the one dispatch point for the attention kernel
(`AttentionMetadata.attention_impl`: the XLA reference here, the Pallas kernels, or the C++
decode kernel on a CPU, layers/cpu_attention.py).

The cache is `[L, num_pages, page_size, K, D]` per K and V. A token's slot is
`page * page_size + offset`; a sequence's block table lists its pages in order, so
its keys are the pages `block_table[0], block_table[1], ...` laid end to end.
Reads gather whole pages (one index per page, a contiguous page_size*K*D block),
which on CPU is several times faster than gathering token by token.

`AttentionMetadata` is an explicit argument of every jitted step (no hidden
globals across jit). The same metadata covers:
  * no cache (the reference forward over whole prompts): keys are the step's own
    tokens and `context_lens` is the prompt length;
  * prefill and chunked prefill: the step's tokens are written at `slot_mapping`,
    then every query reads all keys of its sequence up to its own position;
  * decode: T == 1.

Dimension letters: B batch, T query tokens, S key tokens, K kv heads, G query heads
per kv head, D head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxserve.layers.cpu_attention import paged_decode_attention as paged_decode_attention_cpu
from jaxserve.layers.rotation import hadamard

MASK_VALUE = -1e30


@struct.dataclass
class AttentionMetadata:
    positions: jax.Array  # [B, T] int32, absolute position of each query token
    context_lens: jax.Array  # [B] int32, keys visible to the sequence after this step's writes
    slot_mapping: jax.Array | None = None  # [B, T] int32 flat cache slot per token; >= num_slots drops it
    block_tables: jax.Array | None = None  # [B, P] int32 pages of each sequence, in order
    sliding_window: int | None = struct.field(pytree_node=False, default=None)
    # Kernel choices, static so that a jitted step is specialised on them: "xla", "pallas" or,
    # for attention, "cpu" (the C++ decode kernel; prefill stays on XLA), resolved from "auto"
    # by the engine; interpret runs Pallas kernels on CPU.
    attention_impl: str = struct.field(pytree_node=False, default="xla")
    matmul_impl: str = struct.field(pytree_node=False, default="xla")
    interpret: bool = struct.field(pytree_node=False, default=False)
    # Tensor parallelism (layers/parallel.py): the 1-D mesh the step's weights and KV cache are
    # split over, by heads; attention then runs per shard. None: one device.
    mesh: Mesh | None = struct.field(pytree_node=False, default=None)
    # An fp8 cache's scales [2, L] float32, (K, V) of each layer: a page holds x / scale.
    # None: 1.0 (values kept as they are; |x| < 448 fits e4m3).
    kv_scales: jax.Array | None = None
    # The float8 type whose bits an fp8 cache's uint8 pages hold (on a CPU: `fp8_bits`); None
    # where pages are float8 themselves or not fp8.
    fp8_bits: jnp.dtype | None = struct.field(pytree_node=False, default=None)

    def fp8_scales(self, layer: jax.Array) -> tuple[jax.Array | float, jax.Array | float]:
        """(K scale, V scale) of `layer` for an fp8 cache."""
        if self.kv_scales is None:
            return 1.0, 1.0
        scales = jnp.asarray(self.kv_scales, jnp.float32)  # a numpy constant of the step, or an argument
        return scales[0, layer], scales[1, layer]


# KV cache storage (`[engine] kv_cache_dtype`): "auto" keeps K/V in the model's dtype, a
# cache (k, v). "int8" stores them as int8 with a scale per token and KV head, written with
# the token (a cache (k, v, k_scale, v_scale), scales [L, NP, PS, K] float16 beside the pages,
# so a page is self-contained: swap and prefix caching move its scales with it). fp8 stores
# them as float8 divided by one scale per layer for K and one for V (`AttentionMetadata.kv_scales`:
# 1.0 unless the checkpoint carries calibrated ones, jaxserve/checkpoint/kv_scales.py), a cache
# (k, v). Both quantized kinds store keys and values rotated by a Hadamard matrix (`rotate`);
# a calibrated fp8 cache stores keys through its own transform per KV head (`KEY_TRANSFORM`).
# On a CPU an fp8 cache's pages are uint8 holding the float8 bits (`fp8_bits`).
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
# A calibrated fp8 cache's key transforms, a layer parameter [L, 2, K, D, D] (the scan hands a
# layer its [2, K, D, D]): keys are stored as k W H and compared with q W^-1 H, per KV head,
# in place of H (checkpoint/kv_scales.py says why and how W is chosen).
KEY_TRANSFORM = "kv_keys"
SCALE_DTYPE = jnp.float16
MIN_SCALE = 2.0 ** -14  # float16's smallest normal: an all-zero token keeps a finite scale


def kv_storage(kv_cache_dtype: str, dtype: str, platform: str = "gpu") -> tuple[jnp.dtype, int]:
    """(element dtype of the K/V pages, scale bytes per token and KV head) of a cache setting on
    `platform` (the one the steps are compiled for)."""
    if kv_cache_dtype == "int8":
        return jnp.dtype(jnp.int8), jnp.dtype(SCALE_DTYPE).itemsize
    if kv_cache_dtype.startswith("fp8"):
        return (jnp.dtype(jnp.uint8) if fp8_bits(kv_cache_dtype, platform) is not None
                else fp8_format(kv_cache_dtype)), 0
    if kv_cache_dtype != "auto":
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
    return jnp.dtype(dtype), 0


def fp8_format(kv_cache_dtype: str) -> jnp.dtype | None:
    """The float8 type of an fp8 cache setting; None for the others."""
    if not kv_cache_dtype.startswith("fp8"):
        return None
    return jnp.dtype(jnp.float8_e4m3fn if kv_cache_dtype == "fp8_e4m3" else jnp.float8_e5m2)


def fp8_bits(kv_cache_dtype: str, platform: str) -> jnp.dtype | None:
    """The float8 type whose bits an fp8 cache keeps in uint8 pages on `platform`: on a CPU,
    where XLA has no float8 scatter and widens the whole cache to float16 and back around every
    write (a bitcast of the whole cache is a copy there too): each layer's write moved the whole
    cache, and with the default server's 2 GiB one decode step outlasted the engine watchdog's
    120 s. A uint8 scatter writes in place, and reads bitcast only the gathered pages. None
    elsewhere: the Pallas kernels read float8 pages."""
    return fp8_format(kv_cache_dtype) if platform == "cpu" else None


def pallas_reads_kv(kv_cache_dtype: str, device) -> bool:
    """Whether the Pallas kernels can read this KV storage on `device`: Triton converts float8
    e4m3 only from compute capability 8.9 (Ada, Hopper); an A100 (8.0) aborts the compiler
    (found by compiling for sm_80 ahead of time: jaxserve/aot.py). e5m2 and int8 compile there."""
    cc = getattr(device, "compute_capability", None)
    if kv_cache_dtype != "fp8_e4m3" or cc is None:
        return True
    return tuple(int(x) for x in str(cc).split(".")[:2]) >= (8, 9)


def init_kv_cache(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: str,
                  kv_cache_dtype: str = "auto", platform: str = "gpu") -> tuple[jax.Array, ...]:
    """Zeroed pages: (k, v) [L, NP, PS, K, D], plus (k_scale, v_scale) [L, NP, PS, K] for int8."""
    store, scale_bytes = kv_storage(kv_cache_dtype, dtype, platform)
    shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
    pages = (jnp.zeros(shape, store), jnp.zeros(shape, store))  # two buffers: the steps donate both
    return pages + ((jnp.ones(shape[:-1], SCALE_DTYPE), jnp.ones(shape[:-1], SCALE_DTYPE)) if scale_bytes else ())


def quantize_int8(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[..., D] -> int8 [..., D] and a symmetric scale [...] (float16) per vector: x ~ q * scale."""
    amax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    scale = jnp.maximum(amax / 127.0, MIN_SCALE).astype(SCALE_DTYPE)
    q = jnp.clip(jnp.round(x.astype(jnp.float32) / scale.astype(jnp.float32)[..., None]), -127, 127)
    return q.astype(jnp.int8), scale


def rotate(x: jax.Array) -> jax.Array:
    """x [..., D] @ H: queries and keys of a quantized cache are stored and compared rotated.

    q . k = (q H) . (k H) for an orthonormal H, so the scores are unchanged, and the values
    are stored as v H with the output rotated back (out H H = out): attention is the same
    function. But a key's few outlier channels (this model family's keys have some several
    times larger than the rest) are spread over all D, so a per-token int8 scale fits the
    whole vector, not its outliers. On the default model (quant_quality.py's prompts, 512
    continuation tokens) teacher-forced top-1 agreement with the float cache is 98.2 % for
    int8 K/V without rotation and 99.2 % with it; fp8 e4m3 93.8 % and 95.3 % (BENCHMARKS.md).
    A calibrated fp8 cache goes further for keys (`transform_heads`, checkpoint/kv_scales.py).
    """
    h = hadamard(x.shape[-1])
    if h is None:
        return x
    return jnp.matmul(x.astype(jnp.float32), jnp.asarray(h), precision=jax.lax.Precision.HIGHEST).astype(x.dtype)


def transform_heads(x: jax.Array, m: jax.Array) -> jax.Array:
    """x [B, T, H, D] @ m[k] [D, D] for each head, m [K, D, D] holding one matrix per KV head
    (a query head takes its group's: H = K * G, heads ordered by group)."""
    B, T, H, D = x.shape
    K = m.shape[0]
    y = jnp.einsum("BTKGD,KDE->BTKGE", x.reshape(B, T, K, H // K, D).astype(jnp.float32), m,
                   precision=jax.lax.Precision.HIGHEST)
    return y.reshape(B, T, H, D).astype(x.dtype)


def _to_fp8(x: jax.Array, dtype, scale) -> jax.Array:
    """x / scale, saturating (float8 e4m3fn has no infinity: an overflow would be NaN)."""
    top = float(jnp.finfo(dtype).max)
    return jnp.clip(x.astype(jnp.float32) / scale, -top, top).astype(dtype)


def write_kv(cache: jax.Array, layer: jax.Array, slot_mapping: jax.Array, new: jax.Array,
             fp8_scale: jax.Array | float = 1.0, bits: jnp.dtype | None = None) -> jax.Array:
    """Scatter this step's keys, values or their scales into one layer of the cache.

    cache [L, NP, PS, *E]; new [B, T, *E] (E = (K, D) for K/V, (K,) for scales); padding
    tokens carry a slot past the last page and are dropped, so they never touch a page that
    some sequence owns. An fp8 cache stores new / fp8_scale, as float8 or, for uint8 pages, as
    the bits of the float8 type `bits` (`fp8_bits`).
    """
    B, T = new.shape[:2]
    page_size = cache.shape[2]
    slots = slot_mapping.reshape(B * T)
    if cache.dtype == jnp.uint8:
        new = jax.lax.bitcast_convert_type(_to_fp8(new, bits, fp8_scale), jnp.uint8)
    elif jnp.issubdtype(cache.dtype, jnp.floating) and cache.dtype.itemsize == 1:
        new = _to_fp8(new, cache.dtype, fp8_scale)
    return cache.at[layer, slots // page_size, slots % page_size].set(
        new.reshape(B * T, *new.shape[2:]).astype(cache.dtype), mode="drop")


def gather_kv(cache: jax.Array, layer: jax.Array, block_tables: jax.Array) -> jax.Array:
    """Pages of each sequence, in order: cache [L, NP, PS, *E] -> [B, P*PS, *E].

    The cache is viewed as rows of whole pages [L*NP, PS*K*D] and row layer*NP + page is
    taken (clipped, not bounds-checked per element): one contiguous copy per page. On our
    CPUs the gather alone is ~20 % faster than taking [PS, K, D] blocks out of the layer's
    slice, a batch-64 decode attention ~12 %."""
    B, P = block_tables.shape
    L, NP, PS, *E = cache.shape
    rows = cache.reshape(L * NP, -1)
    return jnp.take(rows, block_tables + layer * NP, axis=0, mode="clip").reshape(B, P * PS, *E)


def _read_kv(cache: jax.Array, scales: jax.Array | None, layer, block_tables, dtype,
             fp8_scale: jax.Array | float = 1.0, bits: jnp.dtype | None = None) -> jax.Array:
    """A layer's keys or values of each sequence [B, S, K, D] in `dtype`, dequantized."""
    x = gather_kv(cache, layer, block_tables)
    if x.dtype == jnp.uint8:  # fp8 bits (`fp8_bits`)
        x = jax.lax.bitcast_convert_type(x, bits)
    if scales is not None:
        return (x.astype(jnp.float32) * gather_kv(scales, layer, block_tables).astype(jnp.float32)[..., None]
                ).astype(dtype)
    if x.dtype.itemsize == 1:  # fp8
        return (x.astype(jnp.float32) * fp8_scale).astype(dtype)
    return x


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
           context_lens: jax.Array, sliding_window: int | None) -> jax.Array:
    """Causal grouped-query attention (XLA reference).

    q [B, T, Hq, D]; k, v [B, S, K, D]; q_pos [B, T]; k_pos [B, S]; context_lens [B].
    A key is visible to a query when k_pos <= q_pos, k_pos < context_len and, with a
    sliding window, k_pos > q_pos - window. Returns [B, T, Hq, D].
    """
    B, T, Hq, D = q.shape
    K = k.shape[2]
    G = Hq // K
    q = q.reshape(B, T, K, G, D)
    scores = jnp.einsum("BTKGD,BSKD->BKGTS", q, k, preferred_element_type=jnp.float32) * (D ** -0.5)
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] < context_lens[:, None, None])
    if sliding_window is not None:
        visible &= k_pos[:, None, :] > q_pos[:, :, None] - sliding_window
    scores = jnp.where(visible[:, None, None, :, :], scores, MASK_VALUE)  # [B, K, G, T, S]
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("BKGTS,BSKD->BTKGD", probs, v)
    return out.reshape(B, T, Hq, D)


def attend_one(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
               context_lens: jax.Array, sliding_window: int | None) -> jax.Array:
    """`attend` for one query token per sequence (decode), as multiply-and-reduce.

    Same arguments and result as `attend` with T == 1. XLA's CPU backend runs the
    einsum form as B*K tiny [G, D] x [D, S] matmuls; written as a broadcast product
    reduced over D, then over S, it streams each sequence's K and V once and is about
    3x faster at B=64 (the Pallas kernel replaces both on a GPU).
    """
    B, _, Hq, D = q.shape
    K = k.shape[2]
    G = Hq // K
    f32 = jnp.float32
    q = q.reshape(B, 1, K, G, D).astype(f32)
    scores = jnp.sum(q * k[:, :, :, None, :].astype(f32), axis=-1) * (D ** -0.5)  # [B, S, K, G]
    visible = (k_pos <= q_pos) & (k_pos < context_lens[:, None])  # [B, S]; q_pos [B, 1]
    if sliding_window is not None:
        visible &= k_pos > q_pos - sliding_window
    scores = jnp.where(visible[:, :, None, None], scores, MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=1)
    out = jnp.sum(probs[..., None] * v[:, :, :, None, :].astype(f32), axis=1)  # [B, K, G, D]
    return out.reshape(B, 1, Hq, D).astype(v.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, meta: AttentionMetadata,
              kv_cache: tuple[jax.Array, jax.Array] | None, layer: jax.Array,
              key_transform: jax.Array | None = None):
    """One layer's attention; returns (out [B, T, Hq, D], updated kv_cache or None).

    q [B, T, Hq, D]; k, v [B, T, K, D] for this step's tokens. key_transform [2, K, D, D]: the
    layer's calibrated key and query transforms (`KEY_TRANSFORM`), used by an fp8 cache in place of H.
    """
    if meta.mesh is not None and kv_cache is not None:
        return _per_shard(q, k, v, meta, kv_cache, layer, key_transform)
    if kv_cache is None:
        out = attend(q, k, v, meta.positions, meta.positions, meta.context_lens, meta.sliding_window)
        return out, None
    k_cache, v_cache, *scales = kv_cache
    rotated = k_cache.dtype.itemsize == 1  # a quantized cache keeps keys and values rotated (`rotate`)
    if rotated:
        if key_transform is not None and not scales:  # fp8, calibrated
            q, k = transform_heads(q, key_transform[1]), transform_heads(k, key_transform[0])
        else:
            q, k = rotate(q), rotate(k)
        v = rotate(v)
    if scales:  # int8: quantize per token and KV head as the token is written
        (k, k_scale), (v, v_scale) = quantize_int8(k), quantize_int8(v)
        scales = [write_kv(scales[0], layer, meta.slot_mapping, k_scale),
                  write_kv(scales[1], layer, meta.slot_mapping, v_scale)]
    ks, vs = meta.fp8_scales(layer) if rotated and not scales else (1.0, 1.0)  # fp8: per layer
    k_cache = write_kv(k_cache, layer, meta.slot_mapping, k, ks, meta.fp8_bits)
    v_cache = write_kv(v_cache, layer, meta.slot_mapping, v, vs, meta.fp8_bits)
    kv_cache = (k_cache, v_cache, *scales)
    out = attend_pages(q, kv_cache, meta, layer)
    return (rotate(out) if rotated else out), kv_cache  # H is symmetric and orthonormal: H H = I


def attend_pages(q: jax.Array, kv_cache: tuple[jax.Array, ...], meta: AttentionMetadata, layer) -> jax.Array:
    """q [B, T, Hq, D] (rotated, for a quantized cache) against its sequences' pages of one
    layer, this step's tokens already written, with `meta.attention_impl`'s kernel: the Pallas
    kernels; the C++ decode kernel ("cpu", T == 1 over float32 pages); else XLA (K/V gathered
    over the block tables' width, dequantized, attended). Returns [B, T, Hq, D]."""
    k_cache, v_cache, *scales = kv_cache
    fp8 = k_cache.dtype.itemsize == 1 and not scales
    ks, vs = meta.fp8_scales(layer) if fp8 else (1.0, 1.0)
    if meta.attention_impl == "pallas":
        scaled = fp8 and meta.kv_scales is not None
        # The kernels read fp8 pages as stored: q . (ks k') = (ks q) . k', and sum p (vs v') = vs sum p v'.
        out = _pallas_attention((q * ks).astype(q.dtype) if scaled else q, kv_cache, meta, layer)
        return (out * vs).astype(q.dtype) if scaled else out
    if meta.attention_impl == "cpu" and q.shape[1] == 1 and k_cache.dtype == jnp.float32:
        return paged_decode_attention_cpu(q[:, 0], k_cache, v_cache, meta.block_tables, meta.context_lens,
                                          meta.positions[:, 0], layer, meta.sliding_window)[:, None].astype(q.dtype)
    # XLA; also the "cpu" choice's prefill steps (T > 1)
    k_scales, v_scales = scales or (None, None)
    keys = _read_kv(k_cache, k_scales, layer, meta.block_tables, q.dtype, ks, meta.fp8_bits)  # [B, S, K, D]
    values = _read_kv(v_cache, v_scales, layer, meta.block_tables, q.dtype, vs, meta.fp8_bits)
    B, S = keys.shape[:2]
    k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None, :], (B, S))
    impl = attend_one if q.shape[1] == 1 else attend
    return impl(q, keys, values, meta.positions, k_pos, meta.context_lens, meta.sliding_window)


def _per_shard(q, k, v, meta: AttentionMetadata, kv_cache, layer, key_transform=None):
    """`attention` on each device over its own heads: q [B, T, Hq/N, D], k, v [B, T, K/N, D],
    its KV heads' slice of every page and of the key transforms [2, K/N, D, D]. No
    communication: the heads are independent (GQA keeps a query head with its KV head, as Hq/N
    and K/N split alike)."""
    (axis,) = meta.mesh.axis_names
    heads = P(None, None, axis)
    cache = tuple(P(None, None, None, axis) for _ in kv_cache)  # pages [L, NP, PS, K, D], scales [L, NP, PS, K]
    local = meta.replace(mesh=None)
    fn = jax.shard_map(lambda q, k, v, c, l, m, t: attention(q, k, v, m, c, l, t), mesh=meta.mesh,
                       in_specs=(heads, heads, heads, cache, P(), P(), P() if key_transform is None else P(None, axis)),
                       out_specs=(heads, cache), check_vma=False)
    return fn(q, k, v, kv_cache, layer, local, key_transform)


def _pallas_attention(q, kv_cache, meta: AttentionMetadata, layer) -> jax.Array:
    """The Pallas kernels read K/V (and int8 scales) through the block tables; nothing is gathered."""
    from pallas_kernels.paged_attention import paged_decode_attention, paged_prefill_attention

    k_cache, v_cache, *scales = kv_cache  # fp8 pages are read as they are (`attention` applies their scales)
    k_scales, v_scales = scales or (None, None)
    if k_cache.dtype == jnp.uint8:  # fp8 bits: only a CPU keeps them (interpret mode, tests), at a copy per call
        k_cache, v_cache = (jax.lax.bitcast_convert_type(c, meta.fp8_bits) for c in (k_cache, v_cache))
    if q.shape[1] == 1:
        out = paged_decode_attention(q[:, 0], k_cache, v_cache, meta.block_tables, meta.context_lens, layer,
                                     k_scales=k_scales, v_scales=v_scales, sliding_window=meta.sliding_window,
                                     interpret=meta.interpret)
        return out[:, None]
    return paged_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.positions, layer,
                                   k_scales=k_scales, v_scales=v_scales, sliding_window=meta.sliding_window,
                                   interpret=meta.interpret)
