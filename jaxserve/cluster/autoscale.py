"""The autoscaling policy: scale on what limits an LLM server, not on a request count.

Ray Serve's default policy counts ongoing requests per replica. For a continuous-batching
engine that count says little: forty streams may run well on one replica, while four
long prompts can fill its KV cache. Each replica reports (ModelReplica.
record_autoscaling_stats) the sequences waiting for a slot, the sequences running, and the
fraction of its KV pages in use; Serve averages each over its look-back window and calls
`LLMPolicy` with them. The policy asks:

    out  when the waiting sequences per replica exceed `target_waiting`, or the mean KV usage
         exceeds `target_kv_usage`: one more replica;
    in   when nothing waits and the sequences in flight would stay under `target_running`
         per replica with one replica fewer: one fewer;
    else keep the count.

Serve applies the rest, as for its own policy: a decision must hold for `upscale_delay_s`
(out) or `downscale_delay_s` (in) before it acts, and the count stays in
[min_replicas, max_replicas]. One replica at a time, because a new replica takes tens of
seconds to load and compile, and the next decision sees the load it took.
"""

from __future__ import annotations

from typing import Any


def desired_replicas(current: int, waiting: float, running: float, kv_usage_sum: float, *,
                     target_waiting: float, target_kv_usage: float, target_running: float) -> int:
    """The count the load asks for, from the sums over replicas of each replica's mean."""
    if current < 1:
        return current
    if waiting / current > target_waiting or kv_usage_sum / current > target_kv_usage:
        return current + 1
    if current > 1 and waiting < 1 and running <= target_running * (current - 1):
        return current - 1
    return current


class LLMPolicy:
    """Ray Serve policy (AutoscalingPolicy(policy_function="jaxserve.cluster.autoscale:LLMPolicy",
    policy_kwargs={...targets})): Serve builds it once per deployment and calls it every tick
    with a ray.serve.config.AutoscalingContext. The sums are over the running replicas that
    have reported; a replica still loading is not running and not counted."""

    def __init__(self, target_waiting: float = 2.0, target_kv_usage: float = 0.85, target_running: float = 16.0):
        self.targets = dict(target_waiting=target_waiting, target_kv_usage=target_kv_usage,
                            target_running=target_running)

    def __call__(self, ctx) -> tuple[int, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}

        def total(name: str) -> float:
            return float(sum(metrics.get(name, {}).values()))

        want = desired_replicas(ctx.current_num_replicas, total("waiting"), total("running"), total("kv_usage"),
                                **self.targets)
        return want, {}
