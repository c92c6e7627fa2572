"""Request routing among one model's replicas (Ray Serve's RequestRouter API).

Each replica has its own prefix cache, so where a request goes decides whether its
prompt's prefix is found cached. `PrefixAffinityRouter` remembers, per replica, the
hashes of the prompt blocks it has sent there (the same page-sized blocks and hash
chain the engine's prefix cache uses, so a block matches only with everything before
it), and sends a request to the replica that holds the longest run of its leading
blocks, unless that replica is already `imbalance_threshold` ongoing requests past the
least loaded one: one hot system prompt must not pin all traffic on one replica. With no
match, or past the threshold, the least loaded replica wins (ties at random, so equal
replicas share work). The memory is bounded (`max_blocks` per replica, least recently
sent dropped first) and forgotten when a replica dies.

The router runs inside each ingress replica (one router per deployment handle), so with
several ingress replicas each remembers only what it sent; that is the price of no shared
state and costs only some hits.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from jaxserve.engine.prefix_cache import chain_hashes


def prompt_of(request: PendingRequest | None) -> tuple[list[int], bytes]:
    """The prompt ids and the chain's root (its cache salt) of a ModelReplica.generate call
    (its one positional argument)."""
    if request is None or not request.args or not isinstance(request.args[0], dict):
        return [], b""
    body = request.args[0]
    return list(body.get("prompt_ids") or []), (body.get("cache_salt") or "").encode()


class LoadRanking:
    """Shared by the routers: replicas ranked by the ongoing requests Serve last saw."""

    def load(self, r: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(r.replica_id) or 0

    def by_load(self, candidates: list[RunningReplica]) -> list[list[RunningReplica]]:
        """Least loaded first; one rank per load level, shuffled within it."""
        levels: dict[int, list[RunningReplica]] = {}
        for r in candidates:
            levels.setdefault(self.load(r), []).append(r)
        ranks = []
        for load in sorted(levels):
            rank = levels[load]
            random.shuffle(rank)
            ranks.append(rank)
        return ranks


class PrefixAffinityRouter(LoadRanking, RequestRouter):
    def initialize_state(self, block_size: int = 16, imbalance_threshold: int = 8, max_blocks: int = 200_000,
                         **_: Any) -> None:
        self.block_size = block_size
        self.imbalance_threshold = imbalance_threshold
        self.max_blocks = max_blocks
        self.blocks: dict[ReplicaID, OrderedDict[bytes, None]] = {}

    def _hashes(self, request: PendingRequest | None) -> list[bytes]:
        ids, root = prompt_of(request)
        return chain_hashes(ids, self.block_size, root)

    def matched(self, replica: ReplicaID, hashes: list[bytes]) -> int:
        """Leading blocks of the prompt this router has sent to `replica`."""
        held = self.blocks.get(replica)
        n = 0
        while held is not None and n < len(hashes) and hashes[n] in held:
            n += 1
        return n

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ranks = self.by_load(candidate_replicas)
        hashes = self._hashes(pending_request)
        if not hashes or not candidate_replicas:
            return ranks
        least = min(self.load(r) for r in candidate_replicas)
        best, best_n = None, 0
        for r in candidate_replicas:
            n = self.matched(r.replica_id, hashes)
            if n > best_n and self.load(r) - least <= self.imbalance_threshold:
                best, best_n = r, n
        if best is None:
            return ranks
        return [[best], *([r for r in rank if r is not best] for rank in ranks)]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        held = self.blocks.setdefault(replica_id, OrderedDict())
        for h in self._hashes(pending_request):
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.max_blocks:
            held.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self.blocks.pop(replica_id, None)
        super().on_replica_actor_died(replica_id)


class LeastLoadedRouter(LoadRanking, RequestRouter):
    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        return self.by_load(candidate_replicas)


class RandomRouter(RequestRouter):
    """Uniformly random: the baseline prefix affinity is measured against."""

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        ranks = list(candidate_replicas)
        random.shuffle(ranks)
        return [[r] for r in ranks]


ROUTER_CLASSES = {"prefix": PrefixAffinityRouter, "least_loaded": LeastLoadedRouter, "random": RandomRouter}
