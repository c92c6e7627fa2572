"""Facts about the machine a benchmark ran on, measured rather than looked up."""

from __future__ import annotations

import os
import platform
import time

import numpy as np


def _best(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def memcpy_gbps(mib: int = 256) -> float:
    """Copy bandwidth of one large numpy copy, counting the read and the write."""
    a = np.ones(mib * 2**20 // 4, np.float32)
    b = np.empty_like(a)
    return 2 * a.nbytes / _best(lambda: np.copyto(b, a)) / 1e9


def matmul_gflops(n: int = 2048) -> float:
    """fp32 [n, n] x [n, n] through XLA, the peak our matmuls can hope for."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda x: x @ x)
    mm(x).block_until_ready()
    return 2 * n**3 / _best(lambda: mm(x).block_until_ready()) / 1e9


def describe() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "memcpy_GBps": round(memcpy_gbps(), 1),
            "python": platform.python_version()}
