"""The cluster's HTTP front: `jaxserve serve`'s app, its models reached through Ray Serve.

The ingress deployment builds the very app `jaxserve serve` runs (serving/app.py: routes,
SSE, error shapes, admission, request ids, traceparent) over a `ClusterRegistry`, whose
models are `RemoteModel`s: the tokenizer and the request limits live in the ingress (the
limits come from a replica's card), so prompts are rendered, tokenized and checked here,
and only token ids travel; generation goes through the model's deployment handle, whose
request router (router.py) picks the replica.

A replica that dies mid-stream breaks the handle's stream with a Ray error; `RemoteRunner`
turns it into `ReplicaFailed`, which the app sends as an OpenAI-shaped error event (or a
500 for a whole response), so no client hangs on a dead replica.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import AsyncIterator

import ray
from prometheus_client.core import GaugeMetricFamily
from ray import serve

from jaxserve.cluster.config import ClusterConfig
from jaxserve.cluster.telemetry import HUB_NAME, NAMESPACE, replica_counts
from jaxserve.config import ModelSpec
from jaxserve.engine.limits import RequestLimits
from jaxserve.engine.sequence import InvalidRequest, SamplingParams, TokenEvent
from jaxserve.metrics import Metrics
from jaxserve.serving.app import build_app
from jaxserve.serving.registry import ModelRegistry, ServedModel
from jaxserve.tokenizer import Tokenizer

log = logging.getLogger(__name__)

REPLICA_DEPLOYMENT = "ModelReplica"


class ReplicaFailed(RuntimeError):
    """The replica serving a request died or became unreachable."""


class RemoteRunner:
    """AsyncEngine.generate's contract over a deployment handle."""

    def __init__(self, handle):
        self.handle = handle.options(stream=True)
        self.dead: str | None = None

    async def generate(self, prompt: list[int], params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, timeout: float | None = None, arrival: float | None = None,
                       cache_salt: str | None = None) -> AsyncIterator[TokenEvent]:
        body = {"prompt_ids": list(prompt), "params": params or SamplingParams(), "request_id": request_id,
                "priority": priority, "timeout": timeout, "cache_salt": cache_salt,
                "age": 0.0 if arrival is None else time.monotonic() - arrival}
        stream = self.handle.generate.remote(body)
        finished = False
        try:
            async for ev in stream:
                finished = ev.finished
                yield ev
        except InvalidRequest:
            raise
        except ray.exceptions.RayError as e:
            raise ReplicaFailed(f"the replica serving this request failed ({type(e).__name__}); "
                                f"retry the request") from None
        finally:
            if not finished:
                stream.cancel()  # the replica's generator is cancelled: its engine request aborts


@dataclasses.dataclass
class RemoteModel(ServedModel):
    """A model served by replicas elsewhere; `replicas` is the hub's latest word on them."""

    remote_tokenizer: Tokenizer | None = None
    remote_limits: RequestLimits | None = None
    digest: str | None = None  # of the settings its card came from
    serve: dict | None = None  # Ray Serve's status of its application (serve.status())
    replicas: list[dict] = dataclasses.field(default_factory=list)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.remote_tokenizer

    @property
    def limits(self) -> RequestLimits | None:
        return self.remote_limits

    def stats(self) -> dict:
        if self.runner is None:
            return {"ready": False, "error": self.error}
        reps = self.replicas
        return {"ready": True, "replicas": len(reps), "running": sum(r["running"] for r in reps),
                "waiting": sum(r["waiting"] for r in reps), "replica_stats": reps, "serve": self.serve}


class ClusterRegistry(ModelRegistry):
    """ModelRegistry's interface over a cluster's model applications. The model list is the
    hub's (deploy.py sets it): a model added or removed by `jaxserve cluster` appears or goes
    here within a second, without a new ingress."""

    def __init__(self, period_s: float):
        self.models: dict[str, RemoteModel] = {}
        self.engine_config = None
        self.loaded = threading.Event()
        self.metrics: Metrics | None = None
        self.period_s = period_s
        self.snapshot: dict[str, tuple[dict, bytes]] = {}
        self._stop = threading.Event()

    def load_all(self) -> None:
        """Follow the hub: the model list, and every replica's report, once a period."""
        hub = ray.get_actor(HUB_NAME, namespace=NAMESPACE)
        while True:
            try:
                wanted, snapshot = ray.get([hub.models.remote(), hub.snapshot.remote()], timeout=30)
                self.snapshot = snapshot
                self._sync(wanted, replica_counts(snapshot))
                status = _serve_status({w["app_name"] for w in wanted})
                for w in wanted:
                    self.models[w["name"]].serve = status.get(w["app_name"])
                self.loaded.set()
            except Exception:  # noqa: BLE001 - keep serving what we have; the hub may be restarting
                log.warning("reading the telemetry hub failed", exc_info=True)
            if self._stop.wait(self.period_s):
                return

    def _sync(self, wanted: list[dict], replicas: dict[str, list[dict]]) -> None:
        models = {}
        for w in wanted:
            m = self.models.get(w["name"])
            digests = {r["digest"] for r in replicas.get(w["name"], [])}
            if m is None or m.spec.path != w["path"] or (m.digest is not None and digests and m.digest not in digests):
                m = self._connect(w, m)  # new, moved, or redeployed with other settings: read its card
            m.replicas = replicas.get(w["name"], [])
            models[w["name"]] = m
        self.models = models  # one assignment: request handlers see the old dict or the new one

    def _connect(self, w: dict, old: RemoteModel | None) -> RemoteModel:
        m = RemoteModel(name=w["name"], spec=ModelSpec(path=w["path"], name=w["name"]),
                        created=old.created if old is not None else int(time.time()))
        try:
            handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=w["app_name"])
            card = handle.card.remote().result(timeout_s=60)
            m.remote_limits = RequestLimits(**card["limits"])
            m.digest = card["digest"]
            m.remote_tokenizer = old.remote_tokenizer if old is not None and old.spec.path == w["path"] \
                else Tokenizer(w["path"])
            m.runner = RemoteRunner(handle)
            log.info("model %s: %d-token context, %d KV tokens per replica", m.name, m.remote_limits.max_model_len,
                     m.remote_limits.pool_tokens)
        except Exception as e:  # noqa: BLE001 - reported on /health (503); the next period tries again
            log.exception("model %s is unreachable", m.name)
            m.error = f"{type(e).__name__}: {e}"
            return old if old is not None and old.ready else m
        return m

    def attach_metrics(self, metrics: Metrics) -> None:
        self.metrics = metrics
        metrics.peers = lambda: [(rid, text) for rid, (_, text) in sorted(self.snapshot.items())]
        metrics.registry.register(_ReplicaCount(self))

    def health(self) -> tuple[bool, dict]:
        models = self.models
        status = {name: m.stats() for name, m in models.items()}
        ok = self.loaded.is_set() and bool(models) and all(m.ready and m.replicas for m in models.values())
        return ok, status

    def shutdown(self) -> None:
        self._stop.set()


def _serve_status(apps: set[str]) -> dict[str, dict]:
    """serve.status() of the models' applications: status and replica states by deployment."""
    out = {}
    for name, app in serve.status().applications.items():
        if name in apps:
            out[name] = {"status": _word(app.status), "deployments": {
                d: {"status": _word(ds.status), "replica_states": {_word(k): v for k, v in ds.replica_states.items()}}
                for d, ds in app.deployments.items()}}
    return out


def _word(status) -> str:
    return getattr(status, "value", str(status))


class _ReplicaCount:
    def __init__(self, registry: ClusterRegistry):
        self.registry = registry

    def collect(self):
        g = GaugeMetricFamily("jaxserve:replicas", "Replicas of a model that reported lately.", labels=["model_name"])
        for name, m in self.registry.models.items():
            g.add_metric([name], len(m.replicas))
        yield g


class Ingress:
    """The ingress deployment: Serve builds the app once the replica starts."""

    def __init__(self, cfg: ClusterConfig, digest: str):
        self.cfg, self.digest = cfg, digest

    def config_digest(self) -> str:
        return self.digest

    def __serve_build_asgi_app__(self):
        return _WithoutRequestIdHeader(build_app(ClusterRegistry(self.cfg.cluster.telemetry_period_s), self.cfg.server))


class _WithoutRequestIdHeader:
    """Serve's proxy puts the request id in the ASGI scope's X-Request-Id (the client's, or
    one it makes), where the app reads it, and adds the header to every response itself:
    the app's own copy would make it appear twice."""

    def __init__(self, app):
        self.app = app

    def __getattr__(self, name):  # Serve reads the app's routes for its metrics
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        async def strip(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(k, v) for k, v in message.get("headers", [])
                                                  if k.lower() != b"x-request-id"]}
            await send(message)

        await self.app(scope, receive, strip)
