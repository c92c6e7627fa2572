"""Where every replica's load and metrics meet, so one scrape target shows them all.

A Serve handle reaches *some* replica of a deployment, never a chosen one, so the ingress
cannot ask each replica for its numbers. Instead every replica reports to one named actor,
the hub, every `telemetry_period_s`: its model, pid, running / waiting sequences, KV usage,
and its whole Prometheus exposition. The hub also holds the list of models the ingress
serves (deploy.py sets it), so adding a model does not redeploy the ingress. The ingress
reads the hub once a second and serves:

    /metrics  every replica's families merged under one name each, every sample labelled
              `replica` (the ingress's own samples: replica="ingress"), and
              jaxserve:replicas{model_name} (replicas that reported lately);
    /stats    per model, the list of its replicas and their load;
    /health   503 while a model has no live replica.

A replica that stops reporting (dead, replaced, scaled in) drops out after `STALE_S`.
"""

from __future__ import annotations

import time
from collections import defaultdict

HUB_NAME = "jaxserve-telemetry"
NAMESPACE = "jaxserve"
STALE_S = 5.0


class Hub:
    """The named actor (one per cluster). Reports are small: a few KB of metrics text each."""

    def __init__(self):
        self.reports: dict[str, tuple[float, dict, bytes]] = {}  # replica id -> (time, info, metrics)
        self.served: list[dict] = []  # the ingress's models: name, path, app_name (set by deploy.py)

    def set_models(self, models: list[dict]) -> None:
        self.served = list(models)

    def models(self) -> list[dict]:
        return self.served

    def report(self, replica: str, info: dict, metrics: bytes) -> None:
        self.reports[replica] = (time.time(), info, metrics)

    def forget(self, replica: str) -> None:
        self.reports.pop(replica, None)

    def snapshot(self, max_age: float = STALE_S) -> dict[str, tuple[dict, bytes]]:
        """The reports younger than `max_age` seconds (older ones are dropped for good)."""
        now = time.time()
        for rid in [r for r, (t, _, _) in self.reports.items() if now - t > max_age]:
            del self.reports[rid]
        return {rid: (info, metrics) for rid, (_, info, metrics) in self.reports.items()}


def get_or_create_hub():
    """The cluster's hub actor (detached: it outlives the `jaxserve cluster` that made it)."""
    import ray

    return ray.remote(Hub).options(name=HUB_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                                   num_cpus=0).remote()


def replica_counts(snapshot: dict[str, tuple[dict, bytes]]) -> dict[str, list[dict]]:
    """model name -> the infos of its replicas that reported lately."""
    out: dict[str, list[dict]] = defaultdict(list)
    for rid, (info, _) in sorted(snapshot.items()):
        out[info["model"]].append({"replica": rid, **info})
    return dict(out)
