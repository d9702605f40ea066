"""Serve's request router for cells: a prompt goes to the cell its prefix went to, unless that cell is busier.

Each ingress replica's router remembers which cell it last sent each prompt block to (the block names of
the prefix cache: equal names, equal prefixes), so a conversation's next turn and prompts sharing a
system prompt meet the cell whose workers hold their KV. When that cell has `imbalance` more requests
open than the least loaded one, or no prefix is known, it falls back to Serve's power of two choices
(the less loaded of two random cells). A cell's load is its open requests: each request keeps its
`Cell.run` call open while it runs, so Serve's own queue lengths count exactly that. Cells the ingress
has seen die (`avoid`) are left out even while Serve still lists them.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from scheduler.prefix_cache import block_names
from scheduler.request import Request


class CellRouter(RequestRouter):
    """Routes each request on its own (not in FIFO order), so the cell chosen for a prompt is the one it gets."""

    def initialize_state(self, imbalance: int = 8, max_blocks: int = 1 << 16, **kwargs: Any) -> None:
        self.imbalance, self.max_blocks = imbalance, max_blocks
        self.owners: OrderedDict[bytes, ReplicaID] = OrderedDict()  # block name -> cell it was sent to, LRU

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if pending_request is not None:  # retries back off (and wait longer for busy cells' queue lengths)
            pending_request.routing_context.should_backoff = True
            avoid = set(pending_request.kwargs.get("avoid", ()))  # cells the ingress saw die: Serve may not yet
            candidate_replicas = [r for r in candidate_replicas if r.replica_id.unique_id not in avoid]
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        owner = next((by_id[self.owners[n]] for n in reversed(_blocks(pending_request))
                      if n in self.owners and self.owners[n] in by_id), None)
        if owner is not None and not self._busier(owner, candidate_replicas):
            return [[owner]]
        return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]

    def _busier(self, replica: RunningReplica, candidates: list[RunningReplica]) -> bool:
        cache = self.replica_queue_len_cache
        load = cache.get(replica.replica_id)
        known = [n for r in candidates if (n := cache.get(r.replica_id)) is not None]
        return load is not None and bool(known) and load - min(known) > self.imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        for name in _blocks(pending_request):
            self.owners[name] = replica_id
            self.owners.move_to_end(name)
        while len(self.owners) > self.max_blocks:
            self.owners.popitem(last=False)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._forget(replica_id)

    def _forget(self, replica_id: ReplicaID) -> None:
        for name in [n for n, owner in self.owners.items() if owner == replica_id]:
            del self.owners[name]


def _blocks(pending: PendingRequest | None) -> list[bytes]:
    """The block names of a `Cell.run` call's request (none for other calls)."""
    request = pending.args[0] if pending is not None and pending.args else None
    return block_names(request) if isinstance(request, Request) else []
