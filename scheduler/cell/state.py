"""A cell as plain data (config, workers' states, request records, counts), and how many prompts its
prefill pool starts."""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from scheduler.request import LoraRef
from scheduler.speculation import SpeculativeConfig
from scheduler.step_planner import StepPlanner

MODES_ON_RAY = ("colocated", "disaggregated")


@dataclass(frozen=True)
class CellConfig:
    """What one scheduler and its workers are: the pools, their slots, the budget and the limits."""

    mode: str  # colocated: decode workers prefill too; disaggregated: prompts go to prefill workers
    num_decode_workers: int
    num_prefill_workers: int  # ignored when colocated
    decode_slots: int  # requests decoding at once per decode worker
    prefill_slots: int  # prompts prefilling at once per prefill worker
    capacity: int  # tokens a request may have (prompt + output): max_model_len
    token_budget: int = 256
    prefill_chunk: int = 128
    max_waiting: int | None = None  # past this many waiting requests, new ones are refused
    max_preemptions: int = 2
    max_recomputes: int = 3  # cache losses a request survives before it ends with an error
    local_prefill_max_tokens: int = 0  # shorter prompts are prefilled on the decode worker
    # KV blocks of one decode (or colocated) worker, of one prefill worker; None: room for every
    # slot's whole context
    decode_blocks: int | None = None
    prefill_blocks: int | None = None
    block_size: int = 16
    # full blocks stay named and are shared by later requests with the same prefix
    prefix_caching: bool = False
    # decode chunks carry n-gram drafts the decode workers verify (scheduler/speculation.py)
    speculative: SpeculativeConfig | None = None
    # LoRA adapters a worker runs at once (None: adapters are not served)
    max_loras: int | None = None
    # send a prompt where its prefix is cached (weighed against queued work)
    cache_routing: bool = True
    # decode steps one worker call may carry, in time (scheduler/cell/bursts.py); 0: one
    max_burst_ms: float = 20.0
    # a handoff whose KV cannot be had: recompute its request (as a lost cache), or fail it
    kv_transfer_failure: str = "recompute"
    # move workers between the pools as the load asks (scheduler/pool_planner.py), every window
    pool_planner: bool = False
    slo_itl_ms: float = 50.0  # the planner sizes decode batches to keep steps under this
    slo_ttft_ms: float = 2000.0  # past it (p90 of a window), the planner grows prefill at once
    planner_window_s: float = 10.0
    # devices (tensor-parallel ranks) of one prefill and of one decode worker: the planner counts
    # devices, and moves whole workers between pools whose sizes differ
    prefill_tensor_parallel_size: int = 1
    decode_tensor_parallel_size: int = 1
    # set: the planner also starts and releases workers, each pool within 1..max
    max_prefill_workers: int | None = None
    max_decode_workers: int | None = None
    # a worker is released only once the load has needed fewer this long
    planner_release_delay_s: float = 30.0
    # set: the load repeats with this period (a day): the planner sizes the pools a start-up
    # ahead by what the last period saw (scheduler/load_forecast.py)
    planner_period_s: float | None = None

    def __post_init__(self) -> None:
        if self.kv_transfer_failure not in ("recompute", "fail"):
            raise ValueError(
                f"kv_transfer_failure is recompute or fail, not {self.kv_transfer_failure!r}"
            )
        if self.mode not in MODES_ON_RAY:
            raise ValueError(
                f"a scheduler cell runs {' or '.join(MODES_ON_RAY)} mode, not {self.mode!r}"
            )


class CellClosed(RuntimeError):
    """This cell takes no new request (it is draining before it stops): place the request on
    another."""


class WorkerStatus(enum.Enum):
    UP = "up"  # answering
    RESTARTING = "restarting"  # died; Ray is restarting it and its queue waits for it
    GONE = "gone"  # its restarts are spent: it never comes back


@dataclass(eq=False)
class WorkerState:
    """One worker as the coordinator sees it: its pool, its slots' policy and whether it answers."""

    kind: str  # "prefill" or "decode"
    index: int
    step_planner: StepPlanner
    status: WorkerStatus = WorkerStatus.UP
    # node, pid, device, incarnation, KV cache: what `ready` reported
    ready_info: dict[str, Any] = field(default_factory=dict)
    # the actor's own name, kept when the worker changes pools (its first `name`)
    actor: str = ""
    # the pool it is leaving for: it takes no new work, and changes once empty
    next_kind: str | None = None
    # step calls sent whose results have not come back (the actor shell counts them): a worker
    # changes pools only with none, so no result planned for its old role reaches its new one
    calls_in_flight: int = 0

    def __post_init__(self) -> None:
        self.actor = self.actor or self.name

    @property
    def accepts(self) -> bool:
        """Up, and not leaving its pool: new work may go here."""
        return self.status is WorkerStatus.UP and self.next_kind is None

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"

    @property
    def slots_used(self) -> int:
        return self.step_planner.num_slots - len(self.step_planner.free_slots)

    def stats(self) -> dict[str, Any]:
        """What /stats shows of this worker: up or not, slots, queue, and its KV blocks."""
        line: dict[str, Any] = {
            "alive": self.status is WorkerStatus.UP,
            "slots_used": self.slots_used,
            "running": len(self.step_planner.running),
            "peak_running": self.step_planner.peak_running,
            "waiting": self.step_planner.num_waiting,
        }
        line["kv_cache"] = self.step_planner.blocks.stats()
        return line

    def load(self) -> tuple[int, int]:
        """Lower is less loaded: (requests here beyond free slots, requests running)."""
        return (
            len(self.step_planner.running)
            + self.step_planner.num_waiting
            - self.step_planner.num_slots,
            len(self.step_planner.running),
        )

    def adapter_miss(self, lora: LoraRef | None, coming: Collection[LoraRef] = ()) -> int:
        """What routing a request of `lora` here costs in requests queued: a worker that neither
        holds the adapter nor has a request of it queued (or `coming`, on its way) must read it
        first, and may evict another that its requests will need: half its slots, and one (the
        preference gives way to a worker that much less loaded)."""
        if lora is None or lora in coming or self.step_planner.holds(lora):
            return 0
        return self.step_planner.num_slots // 2 + 1

    @staticmethod
    def least_loaded(
        pool: list[WorkerState],
        exclude: WorkerState | None = None,
        coming: Mapping[str, int] | None = None,
        lora: LoraRef | None = None,
        coming_adapters: Mapping[str, Collection[LoraRef]] | None = None,
    ) -> WorkerState | None:
        """The least loaded worker that is up; else one being restarted (its queue waits); else
        None. `coming`: requests on their way to a worker (by name), counted as queued there.
        `lora`: a worker that lacks the request's LoRA adapter (held, queued, or among its
        `coming_adapters`) counts `adapter_miss` more."""
        candidates = [w for w in pool if w.accepts and w is not exclude] or [
            w for w in pool if w.status is WorkerStatus.RESTARTING and w is not exclude
        ]
        coming = coming or {}
        adapters = coming_adapters or {}
        return min(
            candidates,
            key=lambda w: (
                w.load()[0]
                + coming.get(w.name, 0)
                + w.adapter_miss(lora, adapters.get(w.name, ())),
                w.load()[1],
            ),
            default=None,
        )


@dataclass
class RequestRecord:
    """Where a request ran and what its handoff cost: the Ray modes' extra per-request metrics."""

    prefill_worker: int | None = None
    decode_worker: int | None = None
    kv_handoff_bytes: int = 0
    kv_handoff_s: float = 0.0

    def as_metrics(self) -> dict[str, Any]:
        return {
            "prefill_worker": self.prefill_worker,
            "decode_worker": self.decode_worker,
            "kv_handoff_bytes": self.kv_handoff_bytes,
            "kv_handoff_s": self.kv_handoff_s,
        }


@dataclass
class CellCounts:
    """Totals since start, for /stats."""

    handoffs: int = 0
    handoff_bytes: int = 0
    recomputes: int = 0
    worker_failures: int = 0
    aborts: int = 0  # requests ended by abort (a client's disconnect or cancel)
    early_imports: int = 0  # KV imports into a slot reserved for a prompt still prefilling


@dataclass
class TransferTotals:
    """KV moved into decode workers since start, per transport: bytes fetched, seconds spent
    fetching, transfers lost (for /stats)."""

    totals: dict[str, dict[str, float]] = field(default_factory=dict)

    def add(self, transport: str, num_bytes: int, seconds: float, failures: int) -> None:
        line = self.totals.setdefault(transport, {"bytes": 0, "seconds": 0.0, "failures": 0})
        line["bytes"] += num_bytes
        line["seconds"] += seconds
        line["failures"] += failures

    def stats(self) -> dict[str, dict[str, float]]:
        return {name: dict(line) for name, line in self.totals.items()}


def prefill_room(
    worker: WorkerState, prefill: list[WorkerState], decode: list[WorkerState], prefill_slots: int
) -> int:
    """Prompts a prefill worker may start now. A prompt's KV waits (in the object store) from its
    handoff until a decode worker has a slot for it: those prompts and the ones still prefilling are
    held to the decode pool's free slots plus one round of the prefill pool's slots, so an overload
    queues prompts, not KV. The worker's most urgent waiting prompt may always start if it would
    preempt a running request on a decode worker: the bound never delays a priority."""
    free = sum(
        len(w.step_planner.free_slots) + len(w.step_planner.reserved)
        for w in decode
        if w.status is not WorkerStatus.GONE and w.next_kind is None
    )
    queued = sum(w.step_planner.num_waiting for w in decode) + sum(
        len(w.step_planner.running) for w in prefill
    )
    room = free + prefill_slots * sum(w.status is not WorkerStatus.GONE for w in prefill) - queued
    urgent = worker.step_planner.waiting[0].request if worker.step_planner.waiting else None
    if (
        room < 1
        and urgent is not None
        and any(w.step_planner.victim(urgent) for w in decode if w.status is WorkerStatus.UP)
    ):
        return 1
    return room
