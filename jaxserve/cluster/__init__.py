"""jaxserve on Ray Serve: replicas of each model behind one OpenAI-compatible ingress.

    config.py    configs/cluster.toml -> frozen ClusterConfig / ClusterModel
    replica.py   ModelReplica: one full engine (KV cache, scheduler, compiled steps) per replica
    router.py    prefix-affinity request routing among a model's replicas
    autoscale.py the scaling policy: waiting sequences and KV usage, not only ongoing requests
    telemetry.py the hub actor every replica reports its load and metrics to
    ingress.py   the HTTP app of `jaxserve serve`, its models reached through deployment handles
    deploy.py    `jaxserve cluster`: start or join Ray, deploy, update in place

Ray is an optional dependency (`pip install 'jaxserve[cluster]'`); nothing outside this
package imports it.
"""
