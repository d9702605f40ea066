"""A cell's actors outlive its Serve replica: found again, adopted, and stopped with the cell.

Each cell's scheduler is a detached actor named `<app>-cell-<replica id of its first replica>` in
`NAMESPACE`, which Ray restarts when it dies; its workers are detached actors named
`<scheduler>/<worker>` in `WORKER_NAMESPACE`, which a restarted scheduler finds again by name. A
replica that starts adopts a scheduler whose replica has died (`CellActor.adopt`) before it creates
one, so a killed replica's streams never stop; a cell scaled down or shut down stops its scheduler
and every worker named after it (`stop_cell`), so nothing is left behind.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from deploy.config import EngineConfig
from deploy.ray_cell import create_cell_actor

log = logging.getLogger(__name__)
NAMESPACE = "pdserve-cells"  # the scheduler actors
WORKER_NAMESPACE = "pdserve-cell-workers"  # their workers, named "<scheduler>/<worker>"
_ADOPT_TIMEOUT_S = 60.0  # a scheduler that is restarting answers once it is back


def cell_name(app_name: str, replica: str) -> str:
    return f"{app_name}-cell-{replica}"


def named_actors(namespace: str, prefix: str) -> list[str]:
    return sorted(
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == namespace and a["name"].startswith(prefix)
    )


async def adopt_or_create(
    config: EngineConfig, app_name: str, replica: str, me: Any, orphan_timeout_s: float
) -> tuple[str, Any]:
    """The scheduler this replica serves: one whose replica has died (a broken one is stopped
    instead), else a new one, which stops itself once no replica has adopted it for
    `orphan_timeout_s` with no request open. Returns its name and handle."""
    names = await asyncio.to_thread(named_actors, NAMESPACE, cell_name(app_name, ""))
    for name in names:
        try:
            handle = await asyncio.to_thread(ray.get_actor, name, NAMESPACE)
            answer = await asyncio.wait_for(handle.adopt.remote(replica, me), _ADOPT_TIMEOUT_S)
        except Exception as e:  # gone meanwhile
            log.info("cell %s: not adopted (%s)", name, e)
            continue
        if answer == "adopted":
            log.info("replica %s adopted cell %s", replica, name)
            return name, handle
        if answer == "broken":
            await stop_cell(name, handle)
    name = cell_name(app_name, replica)
    handle = create_cell_actor(
        config,
        cell={
            "worker_namespace": WORKER_NAMESPACE,
            "owner": (replica, me),
            "orphan_timeout_s": orphan_timeout_s,
        },
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        max_restarts=-1,
        max_task_retries=0,
    )
    return name, handle


async def find_scheduler(app_name: str, replica: str) -> Any:
    """The scheduler that a running replica serves: the one it created, or the one it adopted."""
    try:
        return await asyncio.to_thread(ray.get_actor, cell_name(app_name, replica), NAMESPACE)
    except ValueError:  # not found by that name
        pass
    for name in await asyncio.to_thread(named_actors, NAMESPACE, cell_name(app_name, "")):
        try:
            handle = await asyncio.to_thread(ray.get_actor, name, NAMESPACE)
            if await handle.owner_replica.remote() == replica:
                return handle
        except Exception:  # gone meanwhile
            continue
    raise LookupError(f"no scheduler serves cell {replica}")


async def stop_cell(name: str, handle: Any) -> None:
    """Stop a cell's scheduler and every worker named after it (those a restarted scheduler no
    longer knew of too)."""
    try:
        await asyncio.wait_for(handle.shutdown.remote(), 30)
    except Exception as e:  # dead or hung: killed below all the same
        log.info("cell %s: no clean shutdown (%s)", name, e)
    ray.kill(handle, no_restart=True)
    for worker in await asyncio.to_thread(named_actors, WORKER_NAMESPACE, f"{name}/"):
        try:
            ray.kill(ray.get_actor(worker, WORKER_NAMESPACE), no_restart=True)
        except ValueError:  # gone meanwhile
            pass
    log.info("cell %s stopped", name)
