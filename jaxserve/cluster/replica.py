"""One replica of one model: the same Engine and AsyncEngine `jaxserve serve` runs.

Ray Serve owns the replica's life (placement, health checks, replacement, draining on
scale-in); the replica owns one engine: its own KV cache, scheduler, prefix cache and
compiled steps. The ingress talks to it through a deployment handle:

    card()                       the limits a request must fit, checked in the ingress
                                 before a stream starts (so a bad request is a 400 there)
    generate(body)               a streaming call: the request's TokenEvents as the engine
                                 makes them; cancelling the call aborts the request
    check_health()               Serve calls it every health_check_period_s: it fails when
                                 the engine loop has died or sat in one iteration longer
                                 than stall_timeout_s (a hung device call, a deadlock), and
                                 Serve replaces the replica
    record_autoscaling_stats()   waiting / running sequences and KV usage, for autoscale.py

and a thread reports the replica's load and Prometheus metrics to the hub
(telemetry.py) every telemetry_period_s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import AsyncIterator

from jaxserve.cluster.config import ClusterModel
from jaxserve.cluster.telemetry import get_or_create_hub
from jaxserve.config import EngineConfig, ModelSpec
from jaxserve.engine.engine import AsyncEngine, Engine
from jaxserve.engine.sequence import TokenEvent
from jaxserve.metrics import Metrics
from jaxserve.serving.registry import ServedModel

log = logging.getLogger(__name__)


class ModelReplica:
    def __init__(self, model: ClusterModel, engine_config: EngineConfig, digest: str, telemetry_period_s: float):
        from ray import serve

        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.model, self.digest = model, digest
        name = model.served_name
        self.metrics = Metrics()
        engine = Engine(model.path, engine_config)
        engine.metrics = self.metrics.for_model(name)
        self.served = ServedModel(name=name, spec=ModelSpec(path=model.path, name=name), created=int(time.time()),
                                  engine=engine, runner=AsyncEngine(engine))
        self.metrics.state.sources[name] = self.served
        self.hub = get_or_create_hub()
        self._period = telemetry_period_s
        self._stop = threading.Event()
        threading.Thread(target=self._report_loop, name="jaxserve-telemetry", daemon=True).start()
        log.info("replica %s of %s ready (pid %d)", self.replica_id, name, os.getpid())

    # Called through the handle -------------------------------------------------------

    def card(self) -> dict:
        return {"limits": dataclasses.asdict(self.served.limits), "digest": self.digest, "replica": self.replica_id}

    async def generate(self, body: dict) -> AsyncIterator[TokenEvent]:
        """`body`: prompt_ids, params (SamplingParams), request_id, priority, timeout, cache_salt,
        and age: seconds since the request arrived at the ingress (clocks of two machines
        differ, durations do not)."""
        arrival = time.monotonic() - max(0.0, body.get("age", 0.0))
        async for ev in self.served.runner.generate(body["prompt_ids"], body["params"], request_id=body["request_id"],
                                                    priority=body.get("priority", 0), timeout=body.get("timeout"),
                                                    arrival=arrival, cache_salt=body.get("cache_salt")):
            yield ev

    def config_digest(self) -> str:
        return self.digest

    async def check_health(self) -> None:
        why = self.served.runner.failure(self.model.stall_timeout_s)
        if why is not None:  # Serve replaces this replica
            raise RuntimeError(f"{why} (stall_timeout_s = {self.model.stall_timeout_s})")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        e = self.served.engine
        return {"waiting": float(e.num_waiting), "running": float(e.num_running),
                "kv_usage": e.pool.num_used / e.pool.num_pages}

    def debug_block_engine(self, seconds: float) -> dict:
        """Test hook (`test_hooks = true` only): the engine thread sleeps `seconds`, as a hung
        device call would hold it."""
        if not self.model.test_hooks:
            raise PermissionError("debug_block_engine needs test_hooks = true in this model's config")
        self.served.runner.call_in_engine_thread(lambda: time.sleep(seconds))
        return {"replica": self.replica_id, "pid": os.getpid()}

    # Telemetry and shutdown -----------------------------------------------------------

    def info(self) -> dict:
        st = self.served.stats()
        return {"model": self.served.name, "pid": os.getpid(), "node": _node_id(), "digest": self.digest,
                "running": st["running"], "waiting": st["waiting"], "kv_usage": st["pages_used"] / st["pages_total"],
                "stalled_s": round(self.served.runner.stalled_for(), 3), "dead": st["dead"]}

    def _report_loop(self) -> None:
        while not self._stop.wait(self._period):
            try:
                self.hub.report.remote(self.replica_id, self.info(), self.metrics.render())
            except Exception:  # noqa: BLE001 - the hub may be restarting; the next report retries
                log.warning("telemetry report failed", exc_info=True)

    def __del__(self):
        """Serve calls this when the replica stops (after its streams drained on scale-in)."""
        if not hasattr(self, "_stop"):  # the constructor failed: nothing was started
            return
        self._stop.set()
        try:
            self.hub.forget.remote(self.replica_id)
        except Exception:  # noqa: BLE001 - best effort: the hub drops silent replicas anyway
            pass
        runner = self.served.runner
        if runner.stalled_for() < 1.0:  # a stuck engine thread would never join; it dies with the process
            runner.shutdown()


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()
