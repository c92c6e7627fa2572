"""GPU readiness without a GPU: the Pallas kernels and the engine's steps compiled for A100 (sm_80)
and H100 (sm_90) by XLA's GPU compiler from target descriptions (jaxserve/aot.py,
configs/gpu_targets/), in the CUDA plugin's own environment (`make install-gpu-aot`), so this
run keeps its CPU-only jax."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess

import jax
import pytest

from jaxserve.config import EngineConfig

from background import AOT_PYTHON, JOBS, ROOT

pytestmark = pytest.mark.skipif(not AOT_PYTHON.exists(), reason="no CUDA-plugin environment: make install-gpu-aot")


def check(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(AOT_PYTHON), str(ROOT / "scripts" / "gpu_aot_check.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_kernels_and_engine_steps_compile_for_a100_and_h100():
    """scripts/gpu_aot_check.py's default run, started beside the suite (tests/background.py)."""
    run = JOBS["gpu_aot"].result(timeout=1800)
    lines = run.stdout.splitlines()
    print("\n".join(lines[-40:]))
    assert run.returncode == 0, "\n".join(line for line in lines if line.startswith("FAIL")) or run.stderr[-5000:]
    done = re.search(r"(\d+) of (\d+) compiled for sm_80,sm_90", lines[-1])
    assert done and done.group(1) == done.group(2), lines[-1]
    ok = [line.split(maxsplit=3) for line in lines if line.startswith("ok ")]
    assert len(ok) == int(done.group(2))
    # Every step bucket of the engine's defaults under the Pallas kernels: each decode batch and
    # each prefill batch x chunk, at the one context width those kernels need (max_model_len).
    eng = EngineConfig()
    P = -(-eng.max_model_len // eng.page_size)
    buckets = {f"decode B={b} P={P}" for b in eng.decode_batch_buckets} | {
        f"prefill B={b} T={t} P={P}" for b in eng.prefill_batch_buckets for t in eng.prefill_length_buckets}
    assert len(buckets) == 13
    for target in ("sm_80", "sm_90"):
        names = [name for _, t, _, name in ok if t == target]
        for kind in ("paged_decode_attention", "paged_prefill_attention", "int8_matmul", "int4_matmul"):
            assert any(kind in n for n in names), (target, kind)
        for model in ("smollm2-135m", "llama-3-8b"):
            for weights in ("bfloat16", "int8"):
                steps = [n for n in names if n.startswith(f"step {model} {weights} weights:")]
                assert sorted(n.split(": ")[1].split(" (")[0] for n in steps) == sorted(buckets), (target, steps)
    # int8 KV pages and, where Triton converts them (sm_89 and up), float8 e4m3 pages
    assert any("sm_90" == t and "KV fp8_e4m3" in n for _, t, _, n in ok)
    assert not any("sm_80" == t and "KV fp8_e4m3" in n for _, t, _, n in ok)


def test_an_oversized_kernel_block_fails_with_the_shared_memory_error():
    """The check can fail: an int8 matmul with 256 x 512 x 512 blocks needs more shared memory
    than an H100 has, and the failure names the kernel, the target and the compiler's message."""
    run = check("--targets", "sm_90", "--kernels", "none", "--steps", "none", "--int8-blocks", "256,512,512",
                timeout=300)
    assert run.returncode == 1, run.stdout + run.stderr[-3000:]
    (fail,) = [line for line in run.stdout.splitlines() if line.startswith("FAIL")]
    assert "int8_matmul" in fail and "block_m=256" in fail and "for sm_90" in fail
    assert re.search(r"Shared memory size limit exceeded: requested \d+, available: 232448", fail), fail


def test_each_target_compiles_into_a_kernel_cache_of_its_own(tmp_path):
    """XLA's kernel cache finds a kernel by its fusion's fingerprint, which leaves the target out
    (aot.compiler_options). An fp8 e4m3 attention kernel compiled for sm_90 must not be handed to
    sm_80, where Triton rejects the conversion; it aborts the process, hence a subprocess (its
    cache folder, which the abort leaves behind, goes under tmp_path)."""
    code = (f"import tempfile\ntempfile.tempdir = {str(tmp_path)!r}\n"
            "from jaxserve import aot\n"
            "aot.compile_only_environment()\n"
            "for t in ('sm_90', 'sm_80'):\n"
            "    aot._attention_case(t, 'smollm2-135m', 'decode', 'bfloat16', 'fp8_e4m3', 8, 1, 32).compile()\n"
            "    print('compiled', t, flush=True)\n")
    run = subprocess.run([str(AOT_PYTHON), "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "compiled sm_90" in run.stdout, run.stderr[-3000:]
    assert run.returncode != 0 and "compiled sm_80" not in run.stdout, run.stdout
    assert "only supported on compute capability >= 89" in run.stderr, run.stderr[-3000:]
    assert [p.name for p in tmp_path.glob("jaxserve-gpu-kernels-*/*")] == ["sm_90.bin"]


def test_kernel_caches_of_processes_that_ended_are_removed(tmp_path):
    """A process killed mid-compile leaves its kernel cache folder (no atexit), megabytes per
    target; the next process's `_kernel_cache_dir` removes it. Folders of running pids stay, as
    do others under the same temporary folder."""
    from jaxserve import aot

    ended = subprocess.Popen(["true"])
    ended.wait()
    gone = tmp_path / f"{aot.KERNEL_CACHE_PREFIX}{ended.pid}-abc"
    mine = tmp_path / f"{aot.KERNEL_CACHE_PREFIX}{os.getpid()}-def"
    other = tmp_path / "jaxserve-gpu-kernels-xyz"  # not named for a pid: not ours to judge
    for folder in (gone, mine, other):
        folder.mkdir()
        (folder / "sm_90.bin").write_bytes(b"kernels")
    assert aot.remove_orphaned_kernel_caches(tmp_path) == [gone]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine.name, other.name])


def test_the_cpu_test_environment_has_no_cuda_plugin():
    assert importlib.util.find_spec("jax_cuda12_plugin") is None
    assert {d.platform for d in jax.devices()} == {"cpu"}
