"""Run by test_cell_restarts in its own process: the default single-cell Serve app under 12 greedy
streams while its scheduler, its `Cell` replica, both, or its decode worker are SIGKILLed.

`python -m tests.deploy.serving.restart_scenario CHECKPOINT [FAULT ...]` prints one JSON line: the
no-fault run, then per fault each stream's text, errors and longest gap between two chunks, the
scheduler actors seen after it, and the actors of pdserve left after a scale-down, after the app is
deleted, and after it is deleted while its replica is dead. Faults: replica, scheduler, both,
handoff (the scheduler killed while a prompt's KV is handed off), burst (the replica killed while a
burst of requests is being admitted), worker (the decode worker killed mid-stream: its streams are
recomputed on it once Ray restarts it).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import ray
import yaml
from ray import serve

from deploy.serving.app import build_app
from deploy.serving.cell_actors import NAMESPACE, WORKER_NAMESPACE, named_actors
from tests.deploy.serving.cells_scenario import decoding, outcome, prompts, stats_when, stream_all
from tests.factories import free_port
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[3]
APP = "restarts"
NUM_STREAMS = 12
MAX_TOKENS = 900  # streams still run seconds after the kill


def default_args(checkpoint: str, **more: Any) -> dict[str, Any]:
    """deploy/serve_config.yaml's app, on the tiny checkpoint."""
    config = yaml.safe_load((ROOT / "deploy/serve_config.yaml").read_text())
    args = dict(config["applications"][0]["args"])
    return args | {"model": checkpoint, "served_model_name": "tiny", "max_model_len": 1024} | more


def get(base: str, path: str) -> dict[str, Any]:
    reply = httpx.get(f"{base}{path}", timeout=30)
    assert reply.status_code == 200, f"{path} answered {reply.status_code}: {reply.text[:300]}"
    return reply.json()


def pdserve_actors() -> list[str]:
    return named_actors(NAMESPACE, "") + named_actors(WORKER_NAMESPACE, "")


def cell_replicas() -> list[str]:
    """The actor names of the Cell replicas Serve lists."""
    return [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == "serve" and f"{APP}#Cell#" in a["name"]
    ]


def cell_replica(timeout_s: float = 60.0) -> str:
    """The Cell replica's actor name, once Serve lists exactly one (a replica that died is being
    replaced)."""
    (name,) = wait_for(lambda names: len(names) == 1, timeout_s, value=cell_replicas, poll_s=0.2)
    return name


def replica_pid() -> int:
    replica = ray.get_actor(cell_replica(), "serve")
    return ray.get(replica.__ray_call__.remote(lambda self: os.getpid()))


def scheduler_pid() -> int:
    (name,) = named_actors(NAMESPACE, "")
    return ray.get(ray.get_actor(name, NAMESPACE).ready.remote(), timeout=60)["scheduler_pid"]


def cell_health(base: str, replaced: str | None) -> dict[str, Any]:
    """Serve's view of the Cell deployment and, once it has one healthy replica (not `replaced`),
    the error of a request sent to it (None: it answered)."""
    cell = serve.status().applications[APP].deployments["Cell"]
    health: dict[str, Any] = {"status": str(cell.status), "replicas": dict(cell.replica_states)}
    running = cell.replica_states.get("RUNNING", 0)
    if replaced is not None and replaced in [
        a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
    ]:
        health["replaced"] = "still listed"
    elif cell.status == "HEALTHY" and running == 1 and sum(cell.replica_states.values()) == 1:
        health["error"] = asyncio.run(stream_all(base, ["hello"], 2))[0].error
    return health


def wait_healthy(base: str, replaced: str | None, timeout_s: float = 120) -> None:
    """One Cell replica running (not `replaced`), every pool up, answering a request."""
    wait_for(
        lambda health: "error" in health and health["error"] is None,
        timeout_s,
        value=lambda: cell_health(base, replaced),
        what="the cell to come back",
        poll_s=0.5,
    )


def decode_worker_pid() -> int:
    (name,) = named_actors(NAMESPACE, "")
    worker = ray.get_actor(f"{name}/decode-0", WORKER_NAMESPACE)
    return ray.get(worker.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


async def with_fault(base: str, fault: str, texts: list[str]) -> tuple[list[Any], dict[str, Any]]:
    """Stream `texts`, kill what `fault` says mid-stream; returns the streams and what was seen
    at the kill (seconds after the streams started, handoffs in flight, the replica).

    handoff: the decode worker is stopped (SIGSTOP) before the streams start, so the prompts'
    KV, exported by the prefill worker, cannot be imported: the scheduler is killed with their
    handoffs in flight, and the decode worker resumes (SIGCONT) after."""
    pids = await asyncio.to_thread(lambda: (replica_pid(), scheduler_pid()))
    worker = await asyncio.to_thread(decode_worker_pid) if fault == "worker" else None
    stopped = None
    if fault == "handoff":
        stopped = await asyncio.to_thread(decode_worker_pid)
        os.kill(stopped, signal.SIGSTOP)
    start = time.monotonic()
    run = asyncio.ensure_future(stream_all(base, texts, MAX_TOKENS))
    handoffs = 0
    try:
        if fault == "burst":
            # a moment into the burst, requests still arriving and being admitted: the fault is
            # the kill at that point, whatever each request reached
            await asyncio.sleep(0.05)
        elif fault == "handoff":
            seen = await stats_when(base, lambda s: s["live_handoffs"] > 0, 60)
            handoffs = seen["live_handoffs"]
        else:  # every stream has tokens
            await stats_when(base, lambda s: decoding(s) == len(texts), 60)
        killed_s = time.monotonic() - start
        if fault in ("replica", "both", "burst"):
            os.kill(pids[0], signal.SIGKILL)
        if fault in ("scheduler", "both", "handoff"):
            os.kill(pids[1], signal.SIGKILL)
        if worker is not None:
            os.kill(worker, signal.SIGKILL)
    finally:
        if stopped is not None:
            os.kill(stopped, signal.SIGCONT)
    return await run, {"killed_s": round(killed_s, 2), "handoffs_at_kill": handoffs}


def main(checkpoint: str, faults: list[str]) -> dict[str, Any]:
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    base = f"http://127.0.0.1:{port}"
    serve.run(build_app(default_args(checkpoint)), name=APP, route_prefix="/")
    texts = prompts(NUM_STREAMS)
    start = time.monotonic()
    reference = asyncio.run(stream_all(base, texts, MAX_TOKENS))
    result: dict[str, Any] = {"reference": outcome(reference)}
    result["reference"]["seconds"] = round(time.monotonic() - start, 2)
    result["actors_before"] = pdserve_actors()
    for fault in faults:
        replica = cell_replica()
        done, seen = asyncio.run(with_fault(base, fault, texts))
        wait_healthy(base, replica if fault in ("replica", "both", "burst") else None)
        result[fault] = outcome(done) | seen | {"actors": pdserve_actors()}
    result["counters"] = get(base, "/stats")["counters"]
    result["metrics"] = [
        line
        for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines()
        if line.startswith("pdserve:scheduler_restarts_total")
    ]
    print(json.dumps(result), flush=True)  # (what the faults gave, whatever comes after)
    # a scale-down stops the cell it removes, with its workers
    serve.run(build_app(default_args(checkpoint, cells=2)), name=APP, route_prefix="/")
    result["actors_two_cells"] = pdserve_actors()
    serve.run(build_app(default_args(checkpoint, cells=1)), name=APP, route_prefix="/")
    wait_for(
        lambda cells: len(cells) == 1,
        120,
        value=lambda: named_actors(NAMESPACE, ""),
        what="the scale-down to stop a cell",
        poll_s=0.5,
    )
    result["actors_scaled_down"] = pdserve_actors()
    serve.delete(APP)
    result["actors_deleted"] = pdserve_actors()
    # the app deleted while its only replica is dead: nobody stops the cell, which stops itself
    serve.run(build_app(default_args(checkpoint, orphan_timeout_s=5)), name=APP, route_prefix="/")
    wait_healthy(base, None)
    os.kill(replica_pid(), signal.SIGKILL)
    serve.delete(APP)
    start = time.monotonic()
    wait_for(
        lambda actors: not actors,
        60,
        value=pdserve_actors,
        what="the orphaned cell to stop itself",
        poll_s=0.5,
    )
    result["actors_orphaned"] = pdserve_actors()
    result["orphan_stopped_s"] = round(time.monotonic() - start, 1)
    return result


if __name__ == "__main__":
    ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
    try:
        print(json.dumps(main(sys.argv[1], sys.argv[2:])))
    finally:
        serve.shutdown()
        ray.shutdown()
