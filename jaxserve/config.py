"""Frozen, validated configuration.

`ModelConfig` describes a Llama-family network and is built from a Hugging Face
`config.json` (or from GGUF metadata by the converter, which writes such a
config.json). Everything here is plain Python: no jax import, so the scheduler and
the HTTP layer can read configs without touching the device.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class ConfigError(ValueError):
    """A configuration that cannot describe a model jaxserve can run."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling, as in HF `rope_scaling` (types `linear` and `llama3`)."""

    type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.type not in ("linear", "llama3"):
            raise ConfigError(f"unsupported rope_scaling type {self.type!r} (supported: linear, llama3)")
        if self.factor <= 0:
            raise ConfigError(f"rope_scaling factor must be > 0, got {self.factor}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape and numerics of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def q_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> "ModelConfig":
        """Build from the dict of a Hugging Face `config.json`."""
        archs = hf.get("architectures") or []
        if not archs:
            raise ConfigError("config.json has no 'architectures' entry")
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if hf.get("mlp_bias"):
            raise ConfigError("mlp_bias=true is not supported")
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            scaling = hf.get("rope_scaling") or None
            rope_params = hf.get("rope_parameters") or None  # transformers >= 5 spells it this way
            theta = hf.get("rope_theta")
            if rope_params:
                theta = rope_params.get("rope_theta", theta)
                if rope_params.get("rope_type", "default") != "default":
                    scaling = rope_params
            rope_scaling = None
            if scaling:
                kind = scaling.get("rope_type", scaling.get("type"))
                if kind not in (None, "default"):
                    rope_scaling = RopeScaling(
                        type=kind,
                        factor=float(scaling["factor"]),
                        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
                        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
                        original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
                    )
            eos = hf.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
            sliding = hf.get("sliding_window") if arch != "Qwen2ForCausalLM" or hf.get("use_sliding_window") else None
            return cls(
                architecture=arch,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_layers=int(hf["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
                head_dim=int(hf.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
                rope_theta=float(theta if theta is not None else 10000.0),
                rope_scaling=rope_scaling,
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM" or bool(hf.get("attention_bias", False)),
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
            )
        except KeyError as e:
            raise ConfigError(f"config.json lacks required key {e.args[0]!r}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ConfigError(f"{model_dir}: no config.json")
        return cls.from_hf(json.loads(path.read_text()))

    def rope_inv_freq(self) -> list[float]:
        """Per-pair inverse frequencies [head_dim // 2], with scaling applied (HF semantics)."""
        half = self.head_dim // 2
        inv = [1.0 / (self.rope_theta ** (2 * i / self.head_dim)) for i in range(half)]
        s = self.rope_scaling
        if s is None:
            return inv
        if s.type == "linear":
            return [f / s.factor for f in inv]
        # llama3: long wavelengths are divided by `factor`, short ones kept, a smooth blend between.
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        out = []
        for f in inv:
            wavelen = 2 * math.pi / f
            if wavelen > low_wavelen:
                out.append(f / s.factor)
            elif wavelen < high_wavelen:
                out.append(f)
            else:
                smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                    s.high_freq_factor - s.low_freq_factor)
                out.append((1 - smooth) * f / s.factor + smooth * f)
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative.py), off while `method` is None.

    "ngram" proposes, for each running sequence, the `num_speculative_tokens` tokens that
    followed the latest earlier occurrence of its last n tokens (n from ngram_max down to
    ngram_min) in its own prompt and output; "draft" has a smaller model (`draft_model`, a
    converted model directory with the same vocabulary) draw them (engine/draft.py). One
    verify step scores them all and keeps the prefix the target model accepts. Above `disable_above_batch_size` running sequences
    a step is compute-bound and verification costs more than it saves: plain decode runs.
    """

    method: str | None = None  # None | "ngram" | "draft"
    num_speculative_tokens: int = 8  # why 8 and not 4: BENCHMARKS.md, "Speculative decoding"
    ngram_min: int = 2
    ngram_max: int = 4
    draft_model: str | None = None  # a model directory with the target's tokenizer (method "draft")
    disable_above_batch_size: int = 2  # measured: BENCHMARKS.md, "Where speculation stops paying"

    def __post_init__(self):
        if self.method not in (None, "ngram", "draft"):
            raise ConfigError(f"speculative method must be ngram or draft (or unset), got {self.method!r}")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("speculative method \"draft\" needs draft_model (a converted model directory)")
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min} and {self.ngram_max}")
        if self.disable_above_batch_size < 1:
            raise ConfigError(f"disable_above_batch_size must be >= 1, got {self.disable_above_batch_size}")

    @property
    def enabled(self) -> bool:
        return self.method is not None


def default_compilation_cache_dir() -> str:
    return os.environ.get("JAXSERVE_COMPILATION_CACHE_DIR") or "~/.cache/jaxserve/xla"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine lays out the KV cache and which step shapes it compiles.

    Buckets: every step is padded to one of a few shapes, all compiled ahead of time
    at start-up, so serving never compiles. Decode steps are [B, 1] with B from
    `decode_batch_buckets` and attention over a context padded to one of
    `context_buckets` tokens (shorter contexts read fewer pages where XLA attends; the
    Pallas kernels read each sequence's own pages whatever the width, so under them the
    engine compiles max_model_len alone). Prefill steps are
    [B, T] with B from `prefill_batch_buckets` and T from `prefill_length_buckets`;
    prompts longer than the largest T are prefilled in chunks.

    `num_pages` wins over the memory budgets when set; `max_model_len`
    is capped by the model's own context length when the engine starts.
    """

    page_size: int = 16
    kv_cache_memory_gib: float = 1.0
    kv_cache_memory_fraction: float | None = None  # of free device memory; GPUs only, wins over GiB there
    num_pages: int | None = None
    max_num_seqs: int = 64
    max_model_len: int = 2048
    decode_batch_buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    context_buckets: tuple[int, ...] = (256, 1024, 2048)
    prefill_batch_buckets: tuple[int, ...] = (1, 4)
    prefill_length_buckets: tuple[int, ...] = (32, 128, 512)
    # Tokens (rows x padded chunk) one prefill step may take; None: a full batch of the
    # largest bucket. A small budget prefills long prompts in chunks that alternate with
    # decode steps, so running streams keep flowing (shorter ITL, longer TTFT).
    prefill_token_budget: int | None = None
    default_timeout_s: float | None = None  # deadline of a request that sets none, from its arrival
    # Preemption (see engine/scheduler.py): recompute | swap | auto, the host swap space
    # for swapped KV pages, and the computed length from which auto mode swaps.
    preemption_mode: str = "recompute"
    swap_space_gib: float = 0.0
    swap_min_tokens: int = 256
    max_preemptions: int = 3  # a sequence preempted this often keeps its slot from then on
    dtype: str = "float32"
    # auto | pallas | xla | cpu: auto is Pallas on a GPU; on a CPU the C++ decode kernel
    # (layers/cpu_attention.py) over float32 pages, else XLA
    attention_impl: str = "auto"
    matmul_impl: str = "auto"  # the same, for int8/int4 weights (float weights always use XLA)
    # Quantization applied when the model loads (None: the checkpoint as it is):
    #   "int8"  weight-only int8 per output channel (a float checkpoint is quantized at load; an
    #           int8 one is used as is): a quarter of the weight bytes; on a CPU the widening is
    #           fused into XLA's dot, faster than float32 at every batch size.
    #   "w8a8"  int8 weights as above and int8 activations (per token) in every matmul: int8 x
    #           int8 -> int32 dots, the same integers multiplied exactly in float32 below 8 rows
    #           and in bfloat16 from 512 (jaxserve/layers/linear.py: faster there), so a row's
    #           result does not depend on its batch. A
    #           float checkpoint's weights are quantized rotated, and each input rotated to
    #           match, so outlier channels do not eat the activations' int8 range (layers/rotation.py).
    quantization: str | None = None
    # W8A8 on a CPU: products of fewer than 8 rows (decode of a few sequences) in a C++ kernel
    # (layers/cpu_gemv.py) that streams the int8 weights with AVX-512 VNNI; the same exact
    # integers as XLA's path, so the same tokens. It keeps a second, relaid copy of the int8
    # weights. Off (or on a CPU without AVX-512 VNNI, or where it cannot be built), XLA multiplies them.
    cpu_matmul_kernel: bool = True
    # Multi-step decode: when no prompt waits for prefill, one device call runs this many decode
    # steps (1 turns it off). Arrivals wait for the call in flight, so keep it small.
    decode_steps: int = 4
    # Overlapped host loop: the next decode call is launched, fed by the last one's sampled ids
    # still on the device, before the host reads and postprocesses that last one.
    overlap: bool = True
    # Automatic prefix caching (engine/prefix_cache.py): full pages of computed prompts stay
    # cached after their request ends and a later prompt with the same prefix reuses them.
    enable_prefix_caching: bool = True
    # K/V storage: "auto" (the model's dtype), "int8" (per token and KV head scales) or
    # "fp8_e4m3" / "fp8_e5m2" (layers/attention.py); int8 holds ~3.8x the tokens of float32
    kv_cache_dtype: str = "auto"
    speculative: SpeculativeConfig = SpeculativeConfig()  # [engine.speculative]
    # Tensor parallelism: one model split by heads over this many local devices (layers/parallel.py).
    # The KV budget (kv_cache_memory_gib or _fraction) is per device.
    tensor_parallel_size: int = 1
    interpret: bool = False  # run Pallas kernels in interpret mode (tests on CPU)
    # XLA's persistent compilation cache; None: off. Default: $JAXSERVE_COMPILATION_CACHE_DIR, else
    # ~/.cache/jaxserve/xla (the test suite points the variable at one fresh folder per run).
    compilation_cache_dir: str | None = dataclasses.field(default_factory=default_compilation_cache_dir)
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.speculative, dict):
            object.__setattr__(self, "speculative", _build(SpeculativeConfig, self.speculative,
                                                           "[engine.speculative]"))
        for name in ("decode_batch_buckets", "context_buckets", "prefill_batch_buckets", "prefill_length_buckets"):
            value = tuple(sorted(set(int(v) for v in getattr(self, name))))
            if not value or value[0] < 1:
                raise ConfigError(f"{name} must be non-empty positive sizes, got {getattr(self, name)}")
            object.__setattr__(self, name, value)
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")
        if self.tensor_parallel_size < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.decode_batch_buckets[-1] < self.max_num_seqs:
            raise ConfigError(f"largest decode batch bucket {self.decode_batch_buckets[-1]} < max_num_seqs "
                              f"{self.max_num_seqs}")
        if self.context_buckets[-1] < self.max_model_len:
            raise ConfigError(f"largest context bucket {self.context_buckets[-1]} < max_model_len {self.max_model_len}")
        if self.default_timeout_s is not None and not self.default_timeout_s > 0:
            raise ConfigError(f"default_timeout_s must be > 0, got {self.default_timeout_s}")
        if self.prefill_token_budget is not None and self.prefill_token_budget < 1:
            raise ConfigError(f"prefill_token_budget must be >= 1, got {self.prefill_token_budget}")
        if self.num_pages is not None and self.num_pages < 1:
            raise ConfigError(f"num_pages must be >= 1, got {self.num_pages}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction < 1:
            raise ConfigError(f"kv_cache_memory_fraction must be in (0, 1), got {self.kv_cache_memory_fraction}")
        if self.kv_cache_memory_gib <= 0:
            raise ConfigError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.kv_cache_dtype not in ("auto", "int8", "fp8_e4m3", "fp8_e5m2"):
            raise ConfigError(f"kv_cache_dtype must be auto, int8, fp8_e4m3 or fp8_e5m2, got {self.kv_cache_dtype!r}")
        if self.preemption_mode not in ("recompute", "swap", "auto"):
            raise ConfigError(f"preemption_mode must be recompute, swap or auto, got {self.preemption_mode!r}")
        if self.swap_space_gib < 0 or self.swap_min_tokens < 0 or self.max_preemptions < 0:
            raise ConfigError("swap_space_gib, swap_min_tokens and max_preemptions must be >= 0")
        if self.attention_impl not in ("auto", "pallas", "xla", "cpu"):
            raise ConfigError(f"attention_impl must be auto, pallas, xla or cpu, got {self.attention_impl!r}")
        if self.matmul_impl not in ("auto", "pallas", "xla"):
            raise ConfigError(f"matmul_impl must be auto, pallas or xla, got {self.matmul_impl!r}")
        if self.quantization not in (None, "int8", "w8a8"):
            raise ConfigError(f"quantization must be int8 or w8a8 (or unset), got {self.quantization!r}")
        if self.decode_steps < 1:
            raise ConfigError(f"decode_steps must be >= 1, got {self.decode_steps}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """One model the server loads: its converted directory and the name clients ask for."""

    path: str
    name: str | None = None  # None: the directory's name

    @property
    def served_name(self) -> str:
        return self.name or Path(self.path).resolve().name


@dataclasses.dataclass(frozen=True, kw_only=True)
class KeyLimits:
    """Per-API-key token buckets (None: unlimited). A request takes one request token and
    prompt + max_tokens tokens at admission; what it did not generate is given back at the end."""

    requests_per_second: float | None = None
    request_burst: int | None = None  # bucket size; None: max(1, requests_per_second)
    tokens_per_minute: int | None = None

    def __post_init__(self):
        for name in ("requests_per_second", "request_burst", "tokens_per_minute"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{name} must be > 0, got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdmissionConfig:
    """Who gets in (serving/admission.py). None means no limit. Capacity refusals are 503,
    rate and quota refusals 429, each with Retry-After.

    A request is *waiting* from admission until its first token, *in flight* until it ends;
    both count sequences (a request with n choices counts n). `max_queued_tokens` is the
    KV-aware cap: prompt tokens of waiting requests (None: 4 x the page pool's tokens).
    `priority_classes` name integer priorities for the body's `priority` or the
    `X-Priority` header; `max_waiting_per_priority` keys are class names or integers.
    """

    priority_classes: dict = dataclasses.field(default_factory=lambda: {"interactive": 0, "batch": 10})
    max_waiting: int | None = None
    max_waiting_per_priority: dict = dataclasses.field(default_factory=dict)
    max_in_flight: int | None = None
    max_queued_tokens: int | None = None
    retry_after_s: int = 1  # Retry-After of a capacity refusal
    limits: KeyLimits = KeyLimits()  # every API key (or everyone, without keys)
    keys: dict = dataclasses.field(default_factory=dict)  # API key -> KeyLimits overriding `limits`

    def __post_init__(self):
        if isinstance(self.limits, dict):
            object.__setattr__(self, "limits", _build(KeyLimits, self.limits, "[server.admission.limits]"))
        object.__setattr__(self, "keys", {k: v if isinstance(v, KeyLimits) else
                                          _build(KeyLimits, v, f"[server.admission.keys.{k}]")
                                          for k, v in self.keys.items()})
        for name, value in self.priority_classes.items():
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"priority class {name!r} must be an integer, got {value!r}")
        caps = {}
        for name, cap in self.max_waiting_per_priority.items():
            caps[self.resolve_priority(name)] = cap
        object.__setattr__(self, "max_waiting_per_priority", caps)
        for name in ("max_waiting", "max_in_flight", "max_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if any(c < 0 for c in caps.values()) or self.retry_after_s < 1:
            raise ConfigError("max_waiting_per_priority values must be >= 0 and retry_after_s >= 1")

    def resolve_priority(self, value) -> int:
        """A class name, an integer, or an integer written as a string -> the integer priority."""
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            if value in self.priority_classes:
                return self.priority_classes[value]
            try:
                return int(value)
            except ValueError:
                pass
        known = ", ".join(f"{k} ({v})" for k, v in self.priority_classes.items())
        raise ConfigError(f"unknown priority {value!r}: give an integer or a class name ({known})")

    def limits_for(self, key: str) -> KeyLimits:
        return self.keys.get(key, self.limits)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The HTTP server: where it listens, who may call it, and what it accepts.

    `api_keys` empty means no authentication. `max_body_bytes` bounds a request body
    (413 past it); `max_n` bounds the `n` parameter (choices per request).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()  # may also call POST /debug/profile (off while empty)
    profile_dir: str = "profiles"  # where /debug/profile writes its traces
    max_body_bytes: int = 4 * 2**20
    max_header_bytes: int = 64 * 2**10  # all request headers together (431 past it)
    max_n: int = 8
    max_tokens_limit: int | None = None  # the most max_tokens a request may ask for (and the default cap)
    # Prefix cache isolation: each API key's requests are salted with the key, so tenants never
    # share cached KV pages (a shared page's timing would tell one tenant what another sent).
    cache_salt_per_key: bool = False
    # SIGTERM / SIGINT: refuse new requests (503) and let those in flight finish for this long,
    # then end what is left with an error event and exit 0 (a second signal exits at once).
    drain_timeout_s: float = 30.0
    # An engine thread that has spent this long in one step with work waiting is stuck: the
    # process ends every stream with an error and exits non-zero, for its supervisor to restart.
    watchdog_timeout_s: float = 120.0
    log_requests: bool = False  # log prompt and completion text (debugging only: they are user data)
    models: tuple[ModelSpec, ...] = ()
    admission: AdmissionConfig = AdmissionConfig()

    def __post_init__(self):
        if isinstance(self.admission, dict):
            object.__setattr__(self, "admission", _build(AdmissionConfig, self.admission, "[server.admission]"))
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        object.__setattr__(self, "admin_api_keys", tuple(self.admin_api_keys))
        object.__setattr__(self, "models", tuple(m if isinstance(m, ModelSpec) else ModelSpec(**m)
                                                 for m in self.models))
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in [0, 65535], got {self.port}")
        if self.max_body_bytes < 1024:
            raise ConfigError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_header_bytes < 1024:
            raise ConfigError(f"max_header_bytes must be >= 1024, got {self.max_header_bytes}")
        if self.max_tokens_limit is not None and self.max_tokens_limit < 1:
            raise ConfigError(f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}")
        if self.max_n < 1:
            raise ConfigError(f"max_n must be >= 1, got {self.max_n}")
        if not self.drain_timeout_s >= 0:
            raise ConfigError(f"drain_timeout_s must be >= 0, got {self.drain_timeout_s}")
        if not self.watchdog_timeout_s > 0:
            raise ConfigError(f"watchdog_timeout_s must be > 0, got {self.watchdog_timeout_s}")
        if any(not k for k in (*self.api_keys, *self.admin_api_keys)):
            raise ConfigError("api_keys and admin_api_keys must not contain an empty key")
        names = [m.served_name for m in self.models]
        if len(names) != len(set(names)):
            raise ConfigError(f"two models share a served name: {names}")


def _build(cls, table: dict[str, Any], where: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - known)
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    try:
        return cls(**table)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def read_toml(path: str | Path, tables: tuple[str, ...]) -> dict[str, Any]:
    """A TOML file's top-level tables, each one of `tables`; ConfigError names what is wrong."""
    import tomllib

    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such config file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None
    unknown = sorted(set(data) - set(tables))
    if unknown:
        raise ConfigError(f"{path}: unknown table(s) {', '.join(unknown)} (known: {', '.join(tables)})")
    return data


def load_config_file(path: str | Path) -> tuple[ServerConfig, EngineConfig]:
    """Read a TOML preset with optional `[server]` and `[engine]` tables and `[[server.models]]` entries."""
    data = read_toml(path, ("server", "engine"))
    return (_build(ServerConfig, data.get("server", {}), f"{path} [server]"),
            _build(EngineConfig, data.get("engine", {}), f"{path} [engine]"))
