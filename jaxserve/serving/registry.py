"""The models one server serves, keyed by the name clients put in `model`.

Each model has its own Engine (its own KV cache, scheduler and compiled steps) run
by its own AsyncEngine thread. Loading (reading weights, compiling every bucket)
takes seconds to minutes, so `load_all` runs on a background thread while the
HTTP server already answers: `/health` says 503 until every model is ready.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import AsyncIterator, Callable, Protocol

from jaxserve.config import EngineConfig, ModelSpec
from jaxserve.engine.engine import AsyncEngine, Engine
from jaxserve.engine.limits import RequestLimits
from jaxserve.engine.sequence import SamplingParams, TokenEvent
from jaxserve.serving.protocol import APIError
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class Runner(Protocol):
    """What the HTTP layer drives a model through: an AsyncEngine in this process, or a
    cluster's handle on a model's replicas (cluster/ingress.py)."""

    dead: str | None  # why the model can no longer serve, else None

    def generate(self, prompt: list[int], params: SamplingParams, request_id: str, priority: int = 0,
                 timeout: float | None = None, arrival: float | None = None,
                 cache_salt: str | None = None) -> AsyncIterator[TokenEvent]: ...


@dataclasses.dataclass
class ServedModel:
    name: str
    spec: ModelSpec
    created: int
    engine: Engine | None = None
    runner: AsyncEngine | None = None
    error: str | None = None  # why loading failed

    @property
    def ready(self) -> bool:
        return self.runner is not None

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def limits(self) -> RequestLimits | None:
        return self.engine.limits if self.engine is not None else None

    def stats(self) -> dict:
        if self.engine is None:
            return {"ready": False, "error": self.error}
        e = self.engine
        sched = e.scheduler
        return {"ready": True, "running": e.num_running, "waiting": e.num_waiting, "swapped": len(sched.swapped),
                "pages_used": e.pool.num_used, "pages_total": e.pool.num_pages, "pages_cached": e.pool.num_cached,
                "prefix_cache": e.cache.stats() if e.cache is not None else None, "swap_pages_used": sched.swap_used,
                "preemptions": dict(sched.preemptions), "dead": self.runner.dead if self.runner else None}


class ModelRegistry:
    def __init__(self, specs: tuple[ModelSpec, ...], engine_config: EngineConfig,
                 engine_factory: Callable[[str, EngineConfig], Engine] = Engine):
        if not specs:
            raise ValueError("the server needs at least one model")
        now = int(time.time())
        self.models = {s.served_name: ServedModel(name=s.served_name, spec=s, created=now) for s in specs}
        self.engine_config = engine_config
        self.engine_factory = engine_factory
        self.loaded = threading.Event()
        self.metrics: Metrics | None = None

    def attach_metrics(self, metrics: Metrics) -> None:
        """Feed `metrics` from every engine, those loaded already and those still to load."""
        self.metrics = metrics
        for m in self.models.values():
            metrics.state.sources[m.name] = m
            if m.engine is not None:
                m.engine.metrics = metrics.for_model(m.name)

    @property
    def names(self) -> list[str]:
        return list(self.models)

    def load_all(self) -> None:
        """Build every engine (compiling its buckets); a model that fails to load is reported, not fatal."""
        try:
            for m in self.models.values():
                t0 = time.perf_counter()
                try:
                    engine = self.engine_factory(m.spec.path, self.engine_config)
                    if self.metrics is not None:
                        engine.metrics = self.metrics.for_model(m.name)
                    m.engine = engine
                    m.runner = AsyncEngine(m.engine)
                    log.info("model %s ready in %.1fs", m.name, time.perf_counter() - t0)
                except Exception as e:  # noqa: BLE001 - the server reports it on /health and keeps running
                    log.exception("model %s failed to load", m.name)
                    m.error = f"{type(e).__name__}: {e}"
        finally:
            self.loaded.set()

    def start_loading(self) -> threading.Thread:
        t = threading.Thread(target=self.load_all, name="jaxserve-load", daemon=True)
        t.start()
        return t

    def health(self) -> tuple[bool, dict]:
        status = {name: m.stats() for name, m in self.models.items()}
        ok = self.loaded.is_set() and all(m.ready and not m.runner.dead for m in self.models.values())
        return ok, status

    def named(self, name: str) -> ServedModel:
        """The model named `name`, loaded or not; 404 when there is none."""
        m = self.models.get(name)
        if m is None:
            raise APIError(404, f"the model '{name}' does not exist; this server serves {', '.join(self.models)}",
                           param="model", code="model_not_found")
        return m

    def get(self, name: str | None) -> ServedModel:
        """The model named `name` (the only one when `name` is None); 404 or 503 otherwise."""
        if name is None:
            if len(self.models) > 1:
                raise APIError(400, f"'model' is required: this server serves {', '.join(self.models)}",
                               param="model", code="missing_required_parameter")
            name = next(iter(self.models))
        m = self.named(name)
        if m.error:
            raise APIError(503, f"the model '{name}' failed to load: {m.error}", code="model_unavailable")
        if not m.ready:
            raise APIError(503, f"the model '{name}' is still loading", code="model_loading",
                           headers={"Retry-After": "5"})
        if m.runner.dead:
            raise APIError(503, f"the model '{name}' engine has failed: {m.runner.dead}", code="engine_dead")
        return m

    def shutdown(self) -> None:
        for m in self.models.values():
            if m.runner is not None:
                m.runner.shutdown()
