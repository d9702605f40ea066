"""Serve's request router of the `Cell` deployment: it tells the ingress which cells run.

It lives in each ingress replica (the router of its handle to the cells). Serve tells it which
replicas run: not one still starting, nor one being scaled down; it records them in `cell_choice`
for the ingress, which places requests itself (deploy/serving/cell_choice.py). The calls that still
go through Serve (health checks) go to the less loaded of two random cells. (A module of its own:
Serve copies a request router's module into the process that uses it, so state kept here would not
be the ingress's.)
"""

from __future__ import annotations

import random

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deploy.serving import cell_choice


class CellRouter(RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        return (
            [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
            if candidate_replicas
            else []
        )

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        cell_choice.set_live(
            self._deployment_id.app_name, (r.replica_id.unique_id for r in replicas)
        )

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        app = self._deployment_id.app_name
        cell_choice.set_live(
            app, (r for r in cell_choice.live_cells(app) or () if r != replica_id.unique_id)
        )
