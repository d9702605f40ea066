"""Draining an ingress replica: not ready at once, new requests refused, open streams given time.

`pdserve serve` asks for a drain on SIGTERM (or Ctrl-C) by setting a mark in Ray's internal
key-value store, which every ingress replica of the app watches (`Drain.watch`), so one signal
reaches every replica however many there are. A replica that Serve stops (a scale-down, a new
version) drains too: the watch sees Serve list it as no longer running (Serve has stopped routing
to it and waits for its open requests), and its `__del__` waits for the drain.

Draining, a replica answers `/ready` and every new request with 503 and `Retry-After`, lets its
open streams run for `drain_timeout_s`, then ends those still open with an error event
(`code: shutting_down`) and `data: [DONE]`, never a cut connection.
"""

from __future__ import annotations

import asyncio
import logging
import time

from deploy.engine_client import EngineClient
from deploy.serving.cells import cell_stats
from deploy.serving.replies import SHUTTING_DOWN
from deploy.serving.schemas import APIError

log = logging.getLogger(__name__)
_NAMESPACE = "pdserve"
_WATCH_PERIOD_S = 0.25
_SERVE_CHECKS = 4  # Serve's list of replicas is read every this many watch periods


def _key(app_name: str) -> bytes:
    return f"drain:{app_name}".encode()


def request_drain(app_name: str) -> None:
    """Ask every ingress replica of the app to drain (from any process connected to the Ray)."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(_key(app_name), b"1", overwrite=True, namespace=_NAMESPACE)


def clear_drain(app_name: str) -> None:
    """Forget an earlier drain of the app (before it is deployed again)."""
    from ray.experimental.internal_kv import _internal_kv_del

    _internal_kv_del(_key(app_name), namespace=_NAMESPACE)


def _running_in_serve(app_name: str, deployment: str, replica_id: str) -> bool:
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    replicas = details["applications"][app_name]["deployments"][deployment]["replicas"]
    return any(r["replica_id"] == replica_id and r["state"] == "RUNNING" for r in replicas)


def _drain_requested(app_name: str) -> bool:
    from ray.experimental.internal_kv import _internal_kv_get

    return _internal_kv_get(_key(app_name), namespace=_NAMESPACE) is not None


def wait_drained(app_name: str, timeout_s: float) -> bool:
    """After `request_drain`: wait until no cell of the app has an open request (each replica's
    streams finished or were ended at its drain timeout), at most `timeout_s`; True if so."""

    async def open_requests() -> int:
        return sum((await cell_stats(app_name, "num_open")).values())  # type: ignore[arg-type]

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if asyncio.run(open_requests()) == 0:
            return True
        time.sleep(0.2)
    return False


class Drain:
    """One ingress replica's drain: `refuse()` raises the 503 once it has begun; `run()` begins
    it (once) and returns when no stream is left open."""

    def __init__(self, client: EngineClient, timeout_s: float) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.started_s: float | None = None
        self.done = asyncio.Event()

    @property
    def draining(self) -> bool:
        return self.started_s is not None

    def refuse(self) -> None:
        """Raise the 503 a draining replica answers a new request (and `/ready`) with."""
        if self.draining:
            raise APIError(
                503,
                "The server is shutting down and takes no new request; retry shortly.",
                "service_unavailable",
                code=SHUTTING_DOWN,
                headers={"Retry-After": "5"},
            )

    async def run(self) -> None:
        """Refuse new requests from now on; let the open streams run up to `timeout_s`, then end
        the rest with an error."""
        if self.started_s is not None:
            await self.done.wait()
            return
        self.started_s = time.monotonic()
        deadline = self.started_s + self.timeout_s
        log.warning(
            "draining: %d streams open, %g s to finish", len(self.client.streams), self.timeout_s
        )
        while self.client.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        ended = self.client.end_all(
            f"the server is shutting down and stopped this stream after {self.timeout_s:g} s",
            SHUTTING_DOWN,
        )
        log.warning("drained; %d streams ended at the drain timeout", ended)
        self.done.set()

    async def watch(self, app_name: str, deployment: str, replica_id: str) -> None:
        """Drain when `request_drain(app_name)` is called anywhere on the Ray, or when Serve stops
        this replica."""
        running = False  # Serve has listed it as running (before, it is starting)
        checks = 0
        while not self.draining:
            try:
                if await asyncio.to_thread(_drain_requested, app_name):
                    await self.run()
                    return
                checks += 1
                if checks % _SERVE_CHECKS == 0:
                    now = await asyncio.to_thread(
                        _running_in_serve, app_name, deployment, replica_id
                    )
                    if running and not now:
                        log.warning("Serve is stopping this replica: draining")
                        await self.run()
                        return
                    running = running or now
            except Exception as e:  # the store or the controller not answering: look again
                log.warning("drain watch: %s", e)
            await asyncio.sleep(_WATCH_PERIOD_S)
