"""Compile for a GPU without one: every Pallas kernel configuration and engine step, ahead of time.

What stops a kernel or a step on a real GPU mostly happens in compilation: a block shape the
Triton compiler rejects, more shared memory than the part has, an XLA GPU pass failing on the
whole step, a bucket whose temporaries do not fit. XLA's GPU compiler establishes all of these
from a description of the target. With jax's CUDA plugin installed (its own environment:
`make install-gpu-aot`, so the CPU test run never sees it), `JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`
and `JAX_PLATFORMS=cpu`, a compile-only topology built from a GpuTargetConfigProto
(configs/gpu_targets/*.txtpb) gives a device that `jit(...).lower(...).compile()` targets.

    cases = kernel_cases("sm_90") + step_cases("sm_90", "llama-3-8b", "int8")
    for case in cases: case.compile()    # a failure names the case, the target and the message

scripts/gpu_aot_check.py runs them (the test in tests/test_gpu_aot.py, from `make test`);
scripts/gpu_aot_report.py adds the compiler's memory analysis and `roofline`'s model per bucket.
Those scripts set the two environment variables before jax starts (`compile_only_environment`);
on a machine with a GPU this module only models (scripts/device_e2e.py prints `roofline` beside
measured step times).
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxserve.config import EngineConfig, ModelConfig
from jaxserve.engine.pages import kv_bytes_per_page, pages_for_budget
from jaxserve.layers.attention import kv_storage, pallas_reads_kv


def compile_only_environment() -> None:
    """Before jax starts, on a machine without a GPU: the CUDA plugin registers without a driver
    and jax computes on the CPU; GPU devices come only from compile-only topologies."""
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # read when the plugin initialises
    jax.config.update("jax_platforms", "cpu")  # before any backend starts (JAX_PLATFORMS was read at import)


TARGETS_DIR = Path(__file__).resolve().parent.parent / "configs" / "gpu_targets"
TARGETS = {"sm_80": "a100_80gb_sxm.txtpb", "sm_90": "h100_80gb_sxm.txtpb"}
# Published peaks for the roofline model (datasheets: dense tensor-core bfloat16, HBM bandwidth),
# by device kind as the driver names it (the first that occurs in it); the targets' are the first two.
PEAKS = {"A100": dict(bf16_flops=312e12, hbm_bytes=2.039e12), "H100": dict(bf16_flops=989e12, hbm_bytes=3.35e12),
         "H200": dict(bf16_flops=989e12, hbm_bytes=4.8e12)}
TARGET_KIND = {"sm_80": "A100", "sm_90": "H100"}


def peaks(device_kind: str) -> dict | None:
    return next((p for kind, p in PEAKS.items() if kind in device_kind), None)


# Real models' shapes (HF config keys); weights are abstract, nothing is loaded.
MODELS = {
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}
WEIGHTS = ("bfloat16", "int8")
KV_DTYPES = ("auto", "int8", "fp8_e4m3")
KV_MEMORY_FRACTION = 0.9  # of the memory left after the weights, as `kv_cache_memory_fraction`
# jax's GPU client takes this share of the device at start-up (XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75
# by default); memory_stats()["bytes_limit"], which the engine's KV budget starts from, is that.
CLIENT_MEMORY_FRACTION = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75"))


def model_config(name: str) -> ModelConfig:
    return ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"], "max_position_embeddings": 8192,
                                "rms_norm_eps": 1e-5, "rope_theta": 500000.0, **MODELS[name]})


def target_text(name: str) -> str:
    return (TARGETS_DIR / TARGETS[name]).read_text()


@functools.lru_cache(maxsize=None)
def target(name: str) -> NamedSharding:
    """A sharding on the single device of a compile-only topology for target `name`."""
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(platform="cuda", topology_name="", topology="1x1x1",
                                        target_config=target_text(name))
    return NamedSharding(Mesh(np.asarray(topo.devices), ("gpu",)), P())


KERNEL_CACHE_PREFIX = "jaxserve-gpu-kernels-pid"


@functools.lru_cache(maxsize=None)
def _kernel_cache_dir() -> str:
    """This process's kernel cache folder (megabytes per target), removed at exit. A process that
    is killed never gets there (SIGKILL, a timeout's SIGTERM), so the folder names its pid and
    the next process removes the folders of pids no longer running."""
    remove_orphaned_kernel_caches(tempfile.gettempdir())
    path = tempfile.mkdtemp(prefix=f"{KERNEL_CACHE_PREFIX}{os.getpid()}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def remove_orphaned_kernel_caches(root: str | Path) -> list[Path]:
    """Removes the kernel cache folders under `root` whose process has ended; returns them. A pid
    that is running, or that another user's process holds, keeps its folder."""
    removed = []
    for folder in Path(root).glob(f"{KERNEL_CACHE_PREFIX}*-*"):
        pid = folder.name[len(KERNEL_CACHE_PREFIX):].split("-")[0]
        if pid.isdigit() and not _running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, another user's
        pass
    return True


def compiler_options(name: str) -> dict[str, str]:
    """XLA options for compiling for target `name`: a kernel cache file of its own, for this process.

    XLA skips a kernel's code generation and ptxas when the file holds a fusion with the same
    fingerprint, so the buckets of one model and weights share the kernels whose shapes they share
    (scripts/gpu_aot_check.py alone: 352 -> 221 busy core-s, BENCHMARKS.md). The fingerprint
    leaves the target out: with one file for both, an fp8 attention kernel compiled for sm_90 was
    then "compiled" for sm_80, where Triton rejects it (tests/test_gpu_aot.py), so one file per target."""
    return {"xla_gpu_kernel_cache_file": os.path.join(_kernel_cache_dir(), f"{name}.bin")}


def device_memory(name: str) -> int:
    for line in target_text(name).splitlines():
        if line.strip().startswith("device_memory_size:"):
            return int(line.split(":")[1].split("#")[0])
    raise ValueError(f"{TARGETS[name]} has no device_memory_size")


def abstract_params(cfg: ModelConfig, weights: str, sharding) -> dict:
    """ShapeDtypeStructs of a parameter pytree (layers stacked [L, ...]) in the layout the engine
    loads: bfloat16, or int8 matmul weights {"q8", "scale"} as checkpoint/quantize.py writes them."""
    D, F, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    Hq, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bf16 = jnp.bfloat16

    def s(*shape, dtype=bf16):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    def matmul(*shape):  # [L, K, N] or [K, N]
        if weights == "bfloat16":
            return s(*shape)
        return {"q8": s(*shape, dtype=jnp.int8), "scale": s(*shape[:-2], shape[-1], dtype=jnp.float32)}

    layers = {"attn_norm": s(L, D), "mlp_norm": s(L, D), "wq": matmul(L, D, Hq * Dh), "wk": matmul(L, D, K * Dh),
              "wv": matmul(L, D, K * Dh), "wo": matmul(L, Hq * Dh, D), "w_gate": matmul(L, D, F),
              "w_up": matmul(L, D, F), "w_down": matmul(L, F, D)}
    params = {"embed": s(V, D), "final_norm": s(D), "layers": layers}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = matmul(D, V)
    elif weights == "int8":  # tied: one int8 table with a scale per row
        params["embed"] = {"q8": s(V, D, dtype=jnp.int8), "scale": s(V, dtype=jnp.float32)}
    return params


def param_bytes(params: dict) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(params))


@dataclasses.dataclass(frozen=True)
class Case:
    """One compilation: `name` says what (kernel or step, shapes), `target` for which GPU."""

    name: str
    target: str
    lower: Callable[[], object]  # -> jax.stages.Lowered

    def compile(self):
        """The compiled executable; a failure is re-raised as CompileError naming the case."""
        try:
            return self.lower().compile(compiler_options=compiler_options(self.target))
        except Exception as e:  # noqa: BLE001: any compiler failure is the finding
            raise CompileError(f"{self.name} for {self.target}: {type(e).__name__}: {e}") from e


class CompileError(RuntimeError):
    pass


# Kernels ------------------------------------------------------------------------------------

def _attention_case(tname: str, model: str, kind: str, dtype: str, kv_dtype: str, B: int, T: int, P_: int,
                    page_size: int = 16, num_pages: int = 1024, **kernel_options) -> Case:
    from pallas_kernels.paged_attention import paged_decode_attention, paged_prefill_attention

    cfg, sh = model_config(model), target(tname)
    K, G, D = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    store, scale_bytes = kv_storage(kv_dtype, dtype)
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    cache = (1, num_pages, page_size, K, D)  # one layer: the kernel indexes the layer it is given
    i32 = jnp.int32
    if kind == "decode":
        kernel = functools.partial(paged_decode_attention, **kernel_options)
        args = (s((B, K * G, D), dtype), s(cache, store), s(cache, store), s((B, P_), i32), s((B,), i32))
    else:
        kernel = functools.partial(paged_prefill_attention, **kernel_options)
        args = (s((B, T, K * G, D), dtype), s(cache, store), s(cache, store), s((B, P_), i32), s((B,), i32),
                s((B, T), i32))

    def fn(*a):
        if not scale_bytes:
            return kernel(*a)
        *a, k_scales, v_scales = a
        return kernel(*a, k_scales=k_scales, v_scales=v_scales)

    if scale_bytes:
        args += (s(cache[:-1], jnp.float16), s(cache[:-1], jnp.float16))
    name = (f"kernel paged_{kind}_attention {model} (head_dim {D}, {G} query heads per KV head) {dtype} "
            f"KV {kv_dtype} page {page_size} B={B}" + (f" T={T}" if kind == "prefill" else "") + f" P={P_}")
    return Case(name, tname, lambda: jax.jit(fn).lower(*args))


def _matmul_case(tname: str, kind: str, M: int, K: int, N: int, dtype: str, **blocks) -> Case:
    from pallas_kernels.quantized_matmul import int4_matmul, int8_matmul

    sh = target(tname)
    s = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
    if kind == "int8":
        fn, args = functools.partial(int8_matmul, **blocks), (s((M, K), dtype), s((K, N), jnp.int8),
                                                                s((N,), jnp.float32))
    else:
        group = 128 if K % 128 == 0 else 64  # the engine's int4 checkpoints: 128, or what divides K
        fn, args = functools.partial(int4_matmul, **blocks), (s((M, K), dtype), s((K // 2, N), jnp.uint8),
                                                                s((K // group, N), jnp.float32),
                                                                s((K // group, N), jnp.float32))
    extra = "".join(f" {k}={v}" for k, v in blocks.items())
    return Case(f"kernel {kind}_matmul {dtype} M={M} K={K} N={N}{extra}", tname, lambda: jax.jit(fn).lower(*args))


def matmul_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(K, N) of every projection the Pallas matmul runs (a tied lm_head is an XLA dot)."""
    D, F, Hq, K, Dh = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = [(D, Hq * Dh), (D, K * Dh), (Hq * Dh, D), (D, F), (F, D)]
    if not cfg.tie_word_embeddings:
        shapes.append((D, cfg.vocab_size))
    return list(dict.fromkeys(shapes))


def kernel_cases(tname: str, engine: EngineConfig | None = None) -> list[Case]:
    """Every kernel configuration the engine dispatches for MODELS: decode and prefill paged
    attention for each model's head dim and GQA ratio, float32 and bfloat16 queries, each KV
    storage; int8 and int4 matmuls for each projection at the smallest and largest row count a
    step feeds them (a decode row; the largest prefill batch x chunk). The kernels' block shapes
    depend on these, not on the batch or context sizes, which only change the grid."""
    engine = engine or EngineConfig()
    rows = (1, max(engine.prefill_batch_buckets) * max(engine.prefill_length_buckets))
    pages = -(-max(engine.context_buckets) // engine.page_size)
    cases = []
    for model in MODELS:
        for dtype in ("float32", "bfloat16"):
            for kv in KV_DTYPES:
                if not pallas_reads_kv(kv, next(iter(target(tname).device_set))):
                    continue  # the engine runs XLA attention there (ModelRunner); Triton would abort
                cases.append(_attention_case(tname, model, "decode", dtype, kv, max(engine.decode_batch_buckets),
                                             1, pages, engine.page_size))
                cases.append(_attention_case(tname, model, "prefill", dtype, kv, max(engine.prefill_batch_buckets),
                                             max(engine.prefill_length_buckets), pages, engine.page_size))
        for K, N in matmul_shapes(model_config(model)):
            for kind in ("int8", "int4"):
                for M in rows:
                    cases.append(_matmul_case(tname, kind, M, K, N, "bfloat16"))
    return cases


# Engine steps -------------------------------------------------------------------------------

def gpu_engine_config(**overrides) -> EngineConfig:
    """The engine as it runs on a GPU: bfloat16, the Pallas kernels, the default buckets."""
    return EngineConfig(dtype="bfloat16", attention_impl="pallas", matmul_impl="pallas", compilation_cache_dir=None,
                        **overrides)


def num_pages_for(tname: str, cfg: ModelConfig, weights: str, engine: EngineConfig) -> int:
    """The pages the engine would allocate on the target: KV_MEMORY_FRACTION of the client's
    memory left once the weights are loaded (engine.kv_budget_bytes, kv_cache_memory_fraction)."""
    store, scale_bytes = kv_storage(engine.kv_cache_dtype, engine.dtype)
    page = kv_bytes_per_page(cfg.num_layers, engine.page_size, cfg.num_kv_heads, cfg.head_dim, store.itemsize,
                             scale_bytes)
    free = int(CLIENT_MEMORY_FRACTION * device_memory(tname)) - param_bytes(abstract_params(cfg, weights, None))
    return pages_for_budget(int(KV_MEMORY_FRACTION * free), page)


def step_runner(tname: str, model: str, weights: str, engine: EngineConfig | None = None):
    """A ModelRunner over abstract weights that compiles for target `tname` (it never runs)."""
    from jaxserve.engine.runner import ModelRunner

    engine = engine or gpu_engine_config()
    cfg, sh = model_config(model), target(tname)
    engine = dataclasses.replace(engine, max_model_len=min(engine.max_model_len, cfg.max_position_embeddings))
    return ModelRunner(cfg, abstract_params(cfg, weights, sh), engine, num_pages_for(tname, cfg, weights, engine),
                       target=sh)


def step_cases(tname: str, model: str, weights: str, engine: EngineConfig | None = None,
               only: Callable[[list[tuple[int, int, int]]], list[tuple[int, int, int]]] | None = None) -> list[Case]:
    """One case per bucket of the runner's compiled steps (`only` picks some of them)."""
    runner = step_runner(tname, model, weights, engine)
    keys = runner.buckets()
    keys = only(keys) if only else keys
    return [Case(f"step {model} {weights} weights: {runner._label(key)} ({runner.num_pages} pages)", tname,
                 functools.partial(runner._lower, key)) for key in keys]


def extreme_buckets(keys: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """The buckets where a step's temporaries peak: the largest decode batch and the largest
    prefill batch x chunk, each at the widest context (scripts/gpu_aot_check.py --steps
    extremes, a quick look; its default and `make test` compile every bucket)."""
    decode = [k for k in keys if k[1] == 0]
    prefill = [k for k in keys if k[1] > 0]
    return [max(decode, key=lambda k: (k[0], k[2])), max(prefill, key=lambda k: (k[0] * k[1], k[2]))]


# The roofline model ---------------------------------------------------------------------------

def roofline(runner, key: tuple[int, int, int], peak: dict, context: int | None = None) -> dict:
    """A lower bound of one step's time for bucket key = (B, T, P) (T = 0: one decode step) on a
    device with `peak` (PEAKS): max(flops / peak FLOP/s, bytes / bandwidth). Bytes: the matmul
    weights read once (an untied embedding is only gathered) and every sequence's K/V over
    `context` tokens (None: the bucket's whole width, P pages; the Pallas kernels read only a
    sequence's own pages, so a step's cost follows its contexts, not its width); flops: 2 per
    matmul weight per row, 4 * heads * head_dim per row, context slot and layer for attention,
    and the logits of one row per sequence. A model, not a measurement; tokens/s is the rows a
    step makes over that time."""
    cfg, ecfg = runner.model_cfg, runner.cfg
    B, T, P_ = key
    rows, S = B * max(T, 1), min(context or P_ * ecfg.page_size, P_ * ecfg.page_size)
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    Hq, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    layer_weights = L * (D * Hq * Dh + 2 * D * K * Dh + Hq * Dh * D + 3 * D * F)
    weight_bytes = sum(int(np.prod(a.shape)) * a.dtype.itemsize for path, a in
                       jax.tree_util.tree_leaves_with_path(runner.params)
                       if path[0].key != "embed" or cfg.tie_word_embeddings)
    store, scale_bytes = kv_storage(ecfg.kv_cache_dtype, ecfg.dtype)
    kv_bytes = B * S * L * 2 * K * (Dh * store.itemsize + scale_bytes)
    flops = 2 * rows * layer_weights + 2 * B * D * V + 4 * rows * L * Hq * Dh * S
    t_compute, t_memory = flops / peak["bf16_flops"], (weight_bytes + kv_bytes) / peak["hbm_bytes"]
    t = max(t_compute, t_memory)
    return dict(gflop=flops / 1e9, gbytes=(weight_bytes + kv_bytes) / 1e9, model_ms=t * 1e3, tok_s=rows / t,
                bound="compute" if t_compute > t_memory else "memory")
