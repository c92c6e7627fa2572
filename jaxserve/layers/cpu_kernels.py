"""Building and loading the C++ kernels under layers/kernels/ as XLA FFI targets on a CPU.

A kernel is compiled on first use with the machine's C++ compiler (`$CXX`, else g++) for this
CPU (`-march=native`, as llama.cpp builds by default) against the FFI headers that ship with
jaxlib, and cached under `~/.cache/jaxserve/kernels` (or `$JAXSERVE_KERNEL_CACHE`), keyed by
the source, the flags, jaxlib's version and the CPU's feature flags. Where it cannot be built
(no compiler, another backend), `load` says why and its caller falls back to XLA.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

# Compiled with -ffast-math (vectorised reductions and exp) but linked without it: linking with it
# adds GCC's crtfastmath.o, which sets flush-to-zero for the whole process when the library loads.
FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-fPIC", "-fopenmp-simd")
LINK_FLAGS = ("-shared", "-pthread")


def cpu_flags() -> str:
    """This CPU's feature flags line from /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build(source: Path) -> Path:
    """Compile `source` (once per source, flags, jaxlib and CPU) and return the library's path."""
    import jaxlib

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not cxx:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    key = hashlib.sha256(b"\0".join([source.read_bytes(), " ".join(FLAGS + LINK_FLAGS).encode(),
                                     jaxlib.__version__.encode(), cpu_flags().encode()])).hexdigest()[:16]
    root = Path(os.environ.get("JAXSERVE_KERNEL_CACHE", "~/.cache/jaxserve/kernels")).expanduser()
    lib = root / f"{source.stem}-{key}.so"
    if lib.exists():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        obj, out = Path(tmp) / "kernel.o", Path(tmp) / "kernel.so"
        for cmd in ([cxx, *FLAGS, "-I", jax.ffi.include_dir(), "-c", str(source), "-o", str(obj)],
                    [cxx, *LINK_FLAGS, str(obj), "-o", str(out)]):
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        os.replace(out, lib)  # atomic: a concurrent build of the same key writes the same file
    return lib


def load(source: Path, symbol: str, target: str) -> str | None:
    """Build `source`, load it and register its handler `symbol` as the FFI target `target` on
    the CPU: None when done, else why it cannot be (the caller keeps XLA's path)."""
    if jax.default_backend() != "cpu":
        return f"the default backend is {jax.default_backend()}, not cpu"
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(source)))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return str(e)
    return None
