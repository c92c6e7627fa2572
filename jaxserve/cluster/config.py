"""`jaxserve cluster`'s configuration: configs/cluster.toml documents every key.

    [cluster]        where Ray runs and how the ingress is placed
    [server]         the ingress: the same table as `jaxserve serve` (keys, admission, limits)
    [engine]         engine options shared by every model
    [[models]]       one Ray Serve application per model: its directory, its own engine
                     options (`engine = {...}` over the shared ones), replicas and scaling
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from jaxserve.config import ConfigError, EngineConfig, ServerConfig, _build, read_toml

ROUTERS = ("prefix", "least_loaded", "random")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterModel:
    """One model: a Ray Serve application of `ModelReplica`s, each a full engine."""

    path: str
    name: str | None = None  # the `model` clients ask for; None: the directory's name
    engine: dict[str, Any] = dataclasses.field(default_factory=dict)  # over [engine]
    # Replicas and scaling (Ray Serve's autoscaling, with jaxserve's policy: autoscale.py).
    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None  # None: min_replicas
    target_waiting: float = 2.0  # scale out when waiting sequences per replica stay above this
    target_kv_usage: float = 0.85  # ... or the mean KV cache usage stays above this
    target_running: float = 16.0  # scale in when the sequences left would stay under this per replica
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 120.0
    look_back_period_s: float = 10.0  # the window Serve averages the replicas' reports over
    # What one replica holds: Ray resources, and how many requests Serve sends it at once.
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    max_ongoing_requests: int = 256
    # Health and shutdown: a replica whose engine loop is dead or stuck for `stall_timeout_s`
    # fails its health check and Serve replaces it; a replica removed by scaling in gets
    # `graceful_shutdown_timeout_s` to finish its streams.
    health_check_period_s: float = 10.0
    health_check_timeout_s: float = 30.0
    stall_timeout_s: float = 60.0
    graceful_shutdown_timeout_s: float = 600.0
    # Routing among this model's replicas (router.py).
    router: str = "prefix"
    imbalance_threshold: int = 8  # prefix affinity yields to load past this many ongoing requests
    test_hooks: bool = False  # ModelReplica.debug_block_engine (tests only)

    def __post_init__(self):
        if not isinstance(self.engine, dict):
            raise ConfigError(f"model {self.served_name}: engine must be a table")
        if self.min_replicas < 0 or self.max_replicas < max(1, self.min_replicas):
            raise ConfigError(f"model {self.served_name}: need 0 <= min_replicas <= max_replicas and "
                              f"max_replicas >= 1, got {self.min_replicas} and {self.max_replicas}")
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ConfigError(f"model {self.served_name}: initial_replicas {initial} is outside "
                              f"[{self.min_replicas}, {self.max_replicas}]")
        if self.router not in ROUTERS:
            raise ConfigError(f"model {self.served_name}: router must be one of {', '.join(ROUTERS)}, "
                              f"got {self.router!r}")
        for name in ("target_waiting", "target_running", "upscale_delay_s", "downscale_delay_s", "num_cpus",
                     "num_gpus", "health_check_period_s", "health_check_timeout_s", "stall_timeout_s",
                     "graceful_shutdown_timeout_s", "imbalance_threshold", "look_back_period_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model {self.served_name}: {name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.target_kv_usage <= 1:
            raise ConfigError(f"model {self.served_name}: target_kv_usage must be in (0, 1]")
        if self.max_ongoing_requests < 1:
            raise ConfigError(f"model {self.served_name}: max_ongoing_requests must be >= 1")

    @property
    def served_name(self) -> str:
        return self.name or Path(self.path).resolve().name

    @property
    def app_name(self) -> str:
        """Its Ray Serve application (one per model, so an update leaves the others alone)."""
        return f"jaxserve.{self.served_name}"

    def engine_config(self, shared: EngineConfig) -> EngineConfig:
        try:
            return dataclasses.replace(shared, **self.engine)
        except TypeError as e:
            raise ConfigError(f"model {self.served_name}: engine: {e}") from None

    def digest(self, shared: EngineConfig) -> str:
        """Changes exactly when a redeploy would change this model's replicas."""
        body = {"model": dataclasses.asdict(self), "engine": dataclasses.asdict(self.engine_config(shared)),
                "weights": str(Path(self.path).resolve())}
        return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterOptions:
    """[cluster]: the local Ray cluster `jaxserve cluster` starts when given no --address."""

    num_cpus: int | None = None  # logical CPUs of the local cluster; None: the machine's
    ingress_replicas: int = 1
    ingress_num_cpus: float = 0.5
    telemetry_period_s: float = 1.0  # how often each replica reports its load and metrics
    metrics_push_interval_s: float = 1.0  # how often replicas push Serve's autoscaling inputs


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    cluster: ClusterOptions
    server: ServerConfig
    engine: EngineConfig
    models: tuple[ClusterModel, ...]

    def __post_init__(self):
        if not self.models:
            raise ConfigError("the cluster needs at least one [[models]] entry")
        names = [m.served_name for m in self.models]
        if len(names) != len(set(names)):
            raise ConfigError(f"two models share a served name: {names}")
        for m in self.models:
            m.engine_config(self.engine)  # unknown engine keys fail here, not in a replica

    def model(self, name: str) -> ClusterModel:
        return next(m for m in self.models if m.served_name == name)


def load_cluster_config(path: str | Path) -> ClusterConfig:
    data = read_toml(path, ("cluster", "server", "engine", "models"))
    server = data.get("server", {})
    if "models" in server:
        raise ConfigError(f"{path}: a cluster lists its models as [[models]], not [[server.models]]")
    models = tuple(_build(ClusterModel, m, f"{path} [[models]] #{i + 1}") for i, m in enumerate(data.get("models", [])))
    return ClusterConfig(cluster=_build(ClusterOptions, data.get("cluster", {}), f"{path} [cluster]"),
                         server=_build(ServerConfig, server, f"{path} [server]"),
                         engine=_build(EngineConfig, data.get("engine", {}), f"{path} [engine]"),
                         models=models)
