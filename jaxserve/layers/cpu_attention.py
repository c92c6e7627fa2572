"""Decode attention on a CPU through a small C++ kernel (kernels/paged_decode_attention.cc),
called from jitted steps as an XLA FFI custom call: `attention_impl = "cpu"`.

Why: XLA:CPU's gather-then-reduce decode attention reads K/V at a few GB/s and over every slot
of the context bucket; the kernel reads each sequence's pages in place, only up to its context
length, with all query heads of a KV head sharing each load (BENCHMARKS.md, issue 16).

The kernel is compiled on first use with the machine's C++ compiler (`$CXX`, else g++) for
this CPU (`-march=native`, as llama.cpp builds by default) against the FFI headers that ship
with jaxlib, and cached under `~/.cache/jaxserve/kernels` (or `$JAXSERVE_KERNEL_CACHE`), keyed
by the source, the flags, jaxlib's version and the CPU's feature flags. Where it cannot be built
(no compiler), `unavailable()` says why (logged once) and "auto" falls back to XLA's attention.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "paged_decode_attention.cc"
TARGET = "jaxserve_paged_decode_attention"
# Compiled with -ffast-math (vectorised reductions and exp) but linked without it: linking with it
# adds GCC's crtfastmath.o, which sets flush-to-zero for the whole process when the library loads.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC", "-fopenmp-simd")
LINK_FLAGS = ("-shared", "-pthread")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def _build() -> Path:
    """Compile the kernel (once per source, flags, jaxlib and CPU) and return the library's path."""
    import jaxlib

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join(FLAGS + LINK_FLAGS).encode(),
                                     jaxlib.__version__.encode(), _cpu_flags().encode()])).hexdigest()[:16]
    root = Path(os.environ.get("JAXSERVE_KERNEL_CACHE", "~/.cache/jaxserve/kernels")).expanduser()
    lib = root / f"paged_decode_attention-{key}.so"
    if lib.exists():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        obj, out = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        for cmd in ([cxx, *FLAGS, "-I", jax.ffi.include_dir(), "-c", str(SOURCE), "-o", str(obj)],
                    [cxx, *LINK_FLAGS, str(obj), "-o", str(out)]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(out, lib)  # atomic: a concurrent build of the same key writes the same file
    return lib


@functools.lru_cache(maxsize=None)
def unavailable() -> str | None:
    """Build, load and register the kernel (once); None when it is ready, else why it is not."""
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not cpu"
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.JaxservePagedDecodeAttention), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("CPU decode attention kernel unavailable, attention runs on XLA: %s", e)
        return str(e)
    return None


def available() -> bool:
    """Whether the kernel is built and registered."""
    return unavailable() is None


def reads(cache_dtype) -> bool:
    """The kernel reads float32 pages only (the model's dtype on a CPU); quantized and
    bfloat16 caches use XLA's attention."""
    return jnp.dtype(cache_dtype) == jnp.float32


def paged_decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                           context_lens: jax.Array, positions: jax.Array, layer: jax.Array,
                           sliding_window: int | None = None) -> jax.Array:
    """One query token per sequence against its pages.

    q [B, Hq, D] float32; k_cache, v_cache [L, NP, PS, K, D] float32 (whole: the kernel indexes
    the layer, so no slice is copied); block_tables [B, P], context_lens [B], positions [B]
    int32; layer [] int32. Returns [B, Hq, D] float32, attend_one's result (to float rounding);
    a row that sees no key gets zeros.
    """
    if unavailable():
        raise RuntimeError(f"CPU decode attention kernel unavailable: {unavailable()}")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    return call(q.astype(jnp.float32), k_cache, v_cache, i32(block_tables), i32(context_lens), i32(positions),
                i32(layer), sliding_window=np.int64(sliding_window or 0))
