"""Prometheus metrics under vLLM's names, so existing dashboards and autoscalers read them.

Two kinds of values:

    observed  histograms and counters the engine thread feeds as things happen
              (`EngineMetrics`: a request's first token, every later token, its end,
              every step), labelled by `model_name`;
    read      gauges read at scrape time from the live objects (`StateCollector`:
              running / waiting / swapped, KV cache usage and pages by state (used,
              cached, free), prefix cache queries and hits, preemptions by mode,
              admission refusals by reason, device memory), so they are never stale
              and cost nothing between scrapes.

Each server process has one `Metrics` (its own CollectorRegistry, so tests can build
several apps in one process). The vLLM names are the contract; engine internals that
vLLM has no name for are under `jaxserve:`.

Request timings follow vLLM's definitions: queue time = arrival -> first scheduled;
TTFT = arrival -> first token; inter-token latency = every gap between two tokens of
a request; TPOT = (e2e - TTFT) / (output tokens - 1); e2e = arrival -> finish.
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

# vLLM's bucket boundaries (seconds), so quantiles line up with its dashboards.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                     20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    """Every metric family of one server process."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r, m = self.registry, ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token (arrival to first token).",
                              m, buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Gap between two tokens of a request.",
                             m, buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:request_time_per_output_token_seconds",
                              "(e2e - TTFT) / (output tokens - 1), per finished request.",
                              m, buckets=TOKEN_GAP_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to finish of a request.",
                             m, buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Arrival to first scheduled step.",
                               m, buckets=REQUEST_BUCKETS, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of finished requests.", m, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", m, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               [*m, "finished_reason"], registry=r)
        self.step_time = Histogram("jaxserve:engine_step_seconds", "Wall time of one engine step.",
                                   [*m, "kind"], buckets=STEP_BUCKETS, registry=r)
        self.batch_size = Histogram("jaxserve:engine_batch_size", "Sequences in one engine step.",
                                    [*m, "kind"], buckets=SIZE_BUCKETS, registry=r)
        self.step_tokens = Histogram("jaxserve:engine_step_tokens", "Tokens computed in one engine step.",
                                     [*m, "kind"], buckets=SIZE_BUCKETS, registry=r)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Sequences verified with a speculative draft.",
                                   m, registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", m, registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", m,
                                     registry=r)
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        self.state = StateCollector()
        r.register(self.state)
        self.peers: Callable[[], list[tuple[str, bytes]]] | None = None

    def for_model(self, name: str) -> "EngineMetrics":
        return EngineMetrics(self, name)

    def render(self) -> bytes:
        """This process's exposition; with `peers` (a cluster's ingress: the replicas' expositions
        by replica id), all of them merged, each sample labelled with its `replica`."""
        own = generate_latest(self.registry)
        if self.peers is None:
            return own
        return merge_expositions([("ingress", own), *self.peers()])


class EngineMetrics:
    """One model's children of the observed families; the engine thread calls these."""

    def __init__(self, m: Metrics, name: str):
        self.name = name
        self._ttft, self._itl, self._tpot = m.ttft.labels(name), m.itl.labels(name), m.tpot.labels(name)
        self._e2e, self._queue = m.e2e.labels(name), m.queue.labels(name)
        self._prompt, self._generated = m.prompt_tokens.labels(name), m.generation_tokens.labels(name)
        self._success = m.success
        self._spec = (m.spec_drafts.labels(name), m.spec_draft_tokens.labels(name), m.spec_accepted.labels(name))
        self._step = {k: (m.step_time.labels(name, k), m.batch_size.labels(name, k), m.step_tokens.labels(name, k))
                      for k in ("prefill", "decode")}

    def scheduled(self, seq, now: float) -> None:
        """`seq` is in a step for the first time."""
        self._queue.observe(max(0.0, now - seq.arrival))

    def token(self, seq, now: float) -> None:
        """`seq` got a token; seq.first_token_at / last_token_at are the times before this one."""
        self._generated.inc()
        if seq.first_token_at is None:
            self._ttft.observe(max(0.0, now - seq.arrival))
        else:
            self._itl.observe(now - seq.last_token_at)

    def finished(self, seq, now: float) -> None:
        self._prompt.inc(len(seq.prompt_ids))
        self._success.labels(self.name, seq.finish_reason).inc()
        e2e = max(0.0, now - seq.arrival)
        self._e2e.observe(e2e)
        n = len(seq.output_ids)
        if n > 1 and seq.first_token_at is not None:
            self._tpot.observe((seq.last_token_at - seq.first_token_at) / (n - 1))

    def speculated(self, drafts: int, draft_tokens: int, accepted: int) -> None:
        for counter, n in zip(self._spec, (drafts, draft_tokens, accepted)):
            counter.inc(n)

    def step(self, decode: bool, seqs: int, tokens: int, seconds: float) -> None:
        time_h, size_h, tokens_h = self._step["decode" if decode else "prefill"]
        time_h.observe(seconds)
        size_h.observe(seqs)
        tokens_h.observe(tokens)


class StateCollector(Collector):
    """Gauges and totals read from live objects at scrape time.

    `sources` maps a model name to its serving.registry.ServedModel, whose `stats()` are
    the numbers (skipped while it loads); `rejections` returns the admission refusals by
    reason. Reading the engine's queue lengths and page counts from the scrape thread is
    safe: they are plain ints and list lengths, read once each.
    """

    def __init__(self):
        self.sources: dict[str, object] = {}
        self.rejections: Callable[[], dict[str, int]] = dict

    def collect(self) -> Iterable:
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests in the running batch.",
                                    labels=["model_name"])
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                                    labels=["model_name"])
        swapped = GaugeMetricFamily("vllm:num_requests_swapped", "Requests swapped out to host memory.",
                                    labels=["model_name"])
        kv = GaugeMetricFamily("vllm:kv_cache_usage_perc", "Fraction of KV cache pages in use (1 = full).",
                               labels=["model_name"])
        pages = GaugeMetricFamily("jaxserve:kv_cache_pages", "KV cache pages by state.",
                                  labels=["model_name", "state"])
        capacity = GaugeMetricFamily("jaxserve:kv_cache_capacity_tokens",
                                     "Tokens the KV cache holds, and how it stores them (kv_cache_dtype).",
                                     labels=["model_name", "kv_cache_dtype"])
        swap = GaugeMetricFamily("jaxserve:swap_space_bytes_used", "Host swap space holding preempted KV.",
                                 labels=["model_name"])
        preempt = CounterMetricFamily("vllm:num_preemptions", "Preemptions, all modes.", labels=["model_name"])
        by_mode = CounterMetricFamily("jaxserve:preemptions", "Preemptions by mode.", labels=["model_name", "mode"])
        queries = CounterMetricFamily("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache at admission.", labels=["model_name"])
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Of those, tokens found cached.", labels=["model_name"])
        compiled = GaugeMetricFamily("jaxserve:compile_seconds", "Seconds spent compiling the step buckets.",
                                     labels=["model_name"])
        executables = GaugeMetricFamily("jaxserve:compiled_steps", "Step shapes compiled (buckets) so far.",
                                        labels=["model_name"])
        for name, served in self.sources.items():
            st = served.stats()
            if not st["ready"]:
                continue
            engine = served.engine
            running.add_metric([name], st["running"])
            waiting.add_metric([name], st["waiting"])
            swapped.add_metric([name], st["swapped"])
            kv.add_metric([name], st["pages_used"] / st["pages_total"])
            pages.add_metric([name, "used"], st["pages_used"])
            pages.add_metric([name, "cached"], st["pages_cached"])  # held by no one, kept for reuse
            pages.add_metric([name, "free"], st["pages_total"] - st["pages_used"] - st["pages_cached"])
            capacity.add_metric([name, engine.config.kv_cache_dtype], engine.pool.num_tokens)
            if st["prefix_cache"] is not None:
                queries.add_metric([name], st["prefix_cache"]["queries"])
                hits.add_metric([name], st["prefix_cache"]["hits"])
            swap.add_metric([name], st["swap_pages_used"] * engine.page_bytes)
            preempt.add_metric([name], sum(st["preemptions"].values()))
            for mode, n in st["preemptions"].items():
                by_mode.add_metric([name, mode], n)
            compiled.add_metric([name], engine.compile_seconds)
            executables.add_metric([name], engine.runner.num_compiled)
        rejected = CounterMetricFamily("vllm:admission_rejections", "Requests refused at admission, by reason.",
                                       labels=["reason"])
        for reason, n in sorted(self.rejections().items()):
            rejected.add_metric([reason], n)
        yield from (running, waiting, swapped, kv, pages, capacity, swap, preempt, by_mode, queries, hits, compiled, executables,
                    rejected)
        yield from _device_memory()
        yield from _nvml()


def _device_memory() -> Iterable:
    """Bytes in use per device where the backend reports it (GPUs); nothing on CPU."""
    import jax

    family = GaugeMetricFamily("jaxserve:device_memory_bytes_in_use", "Device memory in use (jax memory_stats).",
                               labels=["device"])
    seen = False
    for d in jax.local_devices():
        stats = d.memory_stats() or {}
        if "bytes_in_use" in stats:
            family.add_metric([str(d.id)], stats["bytes_in_use"])
            seen = True
    if seen:
        yield family


_NVML: list = []  # [module] once nvmlInit succeeded, [None] once it failed: tried once per process


def _nvml() -> Iterable:
    """GPU utilisation and memory through NVML, when nvidia-ml-py is installed and a GPU is
    there; nothing at all otherwise (no error, no empty family)."""
    if not _NVML:
        try:
            import pynvml

            pynvml.nvmlInit()
            _NVML.append(pynvml)
        except Exception:  # noqa: BLE001 - no library, no driver or no GPU: the metric is simply absent
            _NVML.append(None)
    nvml = _NVML[0]
    if nvml is None:
        return
    util = GaugeMetricFamily("jaxserve:gpu_utilization_perc", "GPU busy time over NVML's last sample period (0-1).",
                             labels=["gpu"])
    mem = GaugeMetricFamily("jaxserve:gpu_memory_used_bytes", "GPU memory in use (NVML).", labels=["gpu"])
    for i in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        util.add_metric([str(i)], nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100)
        mem.add_metric([str(i)], nvml.nvmlDeviceGetMemoryInfo(handle).used)
    yield from (util, mem)


def merge_expositions(parts: list[tuple[str, bytes]]) -> bytes:
    """Prometheus text from several processes as one exposition: each family once, each
    sample with a `replica` label naming the part it came from (the text format forbids a
    family twice, so concatenation would not do)."""
    families: dict[str, Metric] = {}
    for replica, text in parts:
        for fam in text_string_to_metric_families(text.decode()):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for s in fam.samples:
                merged.samples.append(s._replace(labels={**s.labels, "replica": replica}))

    class _Merged:
        def collect(self):
            return iter(families.values())

    return generate_latest(_Merged())
