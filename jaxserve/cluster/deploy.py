"""`jaxserve cluster`: start or join a Ray cluster and deploy (or update) the models.

Layout on Ray Serve:

    application "jaxserve"            the ingress (route "/"): one app for every model
    application "jaxserve.<model>"    one per model: a ModelReplica deployment with its own
                                      replicas, autoscaling policy and request router
    actor "jaxserve-telemetry"        the hub (telemetry.py): replica load and metrics,
                                      and the list of models the ingress serves

Running the command again with an edited config is the update: a model whose settings
(its digest) did not change is not redeployed at all, so its replicas keep serving;
a changed model is redeployed by Serve (a rolling update), a new one deployed, a removed
one deleted; the ingress learns the model list from the hub and is redeployed only when
`[server]` or `[cluster]` change. The models are deployed before the list changes, so
the ingress never names a model with no replica.

Without --address the command starts a local Ray cluster, serves until Ctrl-C or
SIGTERM, then shuts it down. With --address it joins that cluster, deploys, and returns:
the cluster keeps serving.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import signal
import threading

from jaxserve.cluster.autoscale import LLMPolicy
from jaxserve.cluster.config import ClusterConfig, ClusterModel
from jaxserve.cluster.ingress import REPLICA_DEPLOYMENT, Ingress
from jaxserve.cluster.replica import ModelReplica
from jaxserve.cluster.router import ROUTER_CLASSES
from jaxserve.cluster.telemetry import get_or_create_hub

log = logging.getLogger(__name__)

INGRESS_APP = "jaxserve"
MODEL_APP_PREFIX = "jaxserve."


def _env(cfg: ClusterConfig) -> dict[str, str]:
    """Environment of every replica: how often Serve's replica metrics (the autoscaling
    inputs) are pushed (Serve's default, 10 s, is slow for upscale delays of seconds)."""
    return {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": str(cfg.cluster.metrics_push_interval_s),
            "TOKENIZERS_PARALLELISM": "false"}


def model_application(m: ClusterModel, cfg: ClusterConfig):
    """The Serve application of one model."""
    from ray import serve
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

    engine = m.engine_config(cfg.engine)
    options = dict(
        name=REPLICA_DEPLOYMENT,
        max_ongoing_requests=m.max_ongoing_requests,
        health_check_period_s=m.health_check_period_s,
        health_check_timeout_s=m.health_check_timeout_s,
        graceful_shutdown_timeout_s=m.graceful_shutdown_timeout_s,
        graceful_shutdown_wait_loop_s=1.0,
        ray_actor_options={"num_cpus": m.num_cpus, "num_gpus": m.num_gpus,
                           "runtime_env": {"env_vars": _env(cfg)}},
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASSES[m.router],
            request_router_kwargs={"block_size": engine.page_size, "imbalance_threshold": m.imbalance_threshold},
            request_routing_stats_period_s=1.0),
    )
    if m.min_replicas == m.max_replicas:
        options["num_replicas"] = m.max_replicas
    else:
        options["autoscaling_config"] = AutoscalingConfig(
            min_replicas=m.min_replicas, max_replicas=m.max_replicas,
            initial_replicas=m.initial_replicas if m.initial_replicas is not None else m.min_replicas,
            upscale_delay_s=m.upscale_delay_s, downscale_delay_s=m.downscale_delay_s,
            look_back_period_s=m.look_back_period_s,
            policy=AutoscalingPolicy(policy_function=LLMPolicy, policy_kwargs={
                "target_waiting": m.target_waiting, "target_kv_usage": m.target_kv_usage,
                "target_running": m.target_running}))
    deployment = serve.deployment(ModelReplica).options(**options)
    return deployment.bind(m, engine, m.digest(cfg.engine), cfg.cluster.telemetry_period_s)


def ingress_digest(cfg: ClusterConfig) -> str:
    body = {"server": dataclasses.asdict(cfg.server), "cluster": dataclasses.asdict(cfg.cluster)}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


def ingress_application(cfg: ClusterConfig):
    from ray import serve

    cls = serve.ingress()(Ingress)
    deployment = serve.deployment(cls).options(
        name="Ingress", num_replicas=cfg.cluster.ingress_replicas, max_ongoing_requests=100_000,
        ray_actor_options={"num_cpus": cfg.cluster.ingress_num_cpus, "runtime_env": {"env_vars": _env(cfg)}})
    return deployment.bind(cfg, ingress_digest(cfg))


def _running_digest(app_name: str, method: str = "config_digest") -> str | None:
    """The digest the running application was deployed with (None: none answers)."""
    from ray import serve

    try:
        return getattr(serve.get_app_handle(app_name), method).remote().result(timeout_s=30)
    except Exception:  # noqa: BLE001 - not running, or an older deployment: redeploy
        return None


def deploy(cfg: ClusterConfig) -> dict[str, str]:
    """Bring the connected cluster to `cfg`; returns what happened to each application."""
    import ray
    from ray import serve
    from ray.serve import RunTarget

    hub = get_or_create_hub()
    running = serve.status().applications
    actions, targets = {}, []
    for m in cfg.models:
        live = running.get(m.app_name)
        if live is not None and live.status == "RUNNING" and _running_digest(m.app_name) == m.digest(cfg.engine):
            actions[m.app_name] = "unchanged"
            continue
        actions[m.app_name] = "updated" if live is not None else "deployed"
        targets.append(RunTarget(model_application(m, cfg), name=m.app_name, route_prefix=None))
    if targets:
        log.info("deploying %s", ", ".join(t.name for t in targets))
        serve.run_many(targets)
    ray.get(hub.set_models.remote([{"name": m.served_name, "path": m.path, "app_name": m.app_name}
                                   for m in cfg.models]))
    if _running_digest(INGRESS_APP) != ingress_digest(cfg):
        actions[INGRESS_APP] = "updated" if INGRESS_APP in running else "deployed"
        serve.run(ingress_application(cfg), name=INGRESS_APP, route_prefix="/")
    else:
        actions[INGRESS_APP] = "unchanged"
    wanted = {m.app_name for m in cfg.models}
    for name in running:
        if name.startswith(MODEL_APP_PREFIX) and name not in wanted:
            serve.delete(name)
            actions[name] = "deleted"
    return actions


def run_cluster(cfg: ClusterConfig, address: str | None, host: str, port: int) -> int:
    """`jaxserve cluster`: see the module docstring."""
    import ray
    from ray import serve

    own = address is None
    if own:
        info = ray.init(num_cpus=cfg.cluster.num_cpus, include_dashboard=False, runtime_env={"env_vars": _env(cfg)})
        log.info("started a local Ray cluster at %s", info.address_info.get("gcs_address"))
    else:
        ray.init(address=address)
        log.info("joined the Ray cluster at %s", address)
    print(f"ray cluster: {ray.get_runtime_context().gcs_address}", flush=True)
    serve.start(http_options={"host": host, "port": port})
    actions = deploy(cfg)
    for app, what in actions.items():
        print(f"{app}: {what}", flush=True)
    print(f"serving {', '.join(m.served_name for m in cfg.models)} on http://{host}:{port}", flush=True)
    if not own:
        return 0
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    log.info("shutting down")
    serve.shutdown()
    ray.shutdown()
    return 0
