"""The KV a cell has in flight between its pools, and the decode worker each prompt's KV goes to.

A prompt on a prefill worker sends its KV out a piece per step (`KVPiece`); when its last chunk is
done the pieces become a `KVHandoff` that waits until a decode worker imports it. The book holds the
only references to those objects, so dropping an entry frees their bytes. From its first piece a
prompt is bound to the decode worker it will go to; when that worker is on another node, each piece
is named to it as soon as it exists (`take_prefetches`), so the worker pulls the bytes to its node
while the prompt is still prefilling and only the last piece's transfer is left between the first
token and the second. When that worker has a slot to spare, the slot is reserved for the prompt and
each piece is imported into it with the worker's next step (`early_imports`), so only the last
piece's copy is left at the handoff.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from scheduler.block_pool import block_names
from scheduler.cell.state import WorkerState, WorkerStatus
from scheduler.messages import KVHandoff, KVImport, KVPiece
from scheduler.plan import StepPlan
from scheduler.request import LoraRef, Request


class HandoffBook:
    def __init__(self, adapter_routing: bool = True) -> None:
        # a decode worker that holds a prompt's LoRA adapter is preferred (cache routing)
        self.adapter_routing = adapter_routing
        # prompts on prefill workers: the KV pieces sent so far
        self.pieces: dict[str, list[KVPiece]] = {}
        self.handoffs: dict[str, KVHandoff] = {}  # handed off, not yet imported
        # of those, sent in a step whose result has not come yet
        self.importing: dict[str, KVHandoff] = {}
        # prompts on prefill workers: the decode worker they go to
        self.bound: dict[str, WorkerState] = {}
        # of those, the LoRA adapter of each that has one (routing prefers a worker they go to)
        self.bound_adapters: dict[str, LoraRef] = {}
        # decode worker (its actor's name) -> pieces to pull to its node
        self.prefetches: dict[str, list[KVPiece]] = {}
        # prompts with a reserved slot: pieces sent to be imported into it
        self.sent: dict[str, int] = {}

    def add_piece(
        self, piece: KVPiece, request: Request, prefill: WorkerState, decode: list[WorkerState]
    ) -> WorkerState | None:
        """Keep a piece of a prompt still prefilling; name it to its decode worker if that is
        elsewhere. Returns that worker when the piece is to be imported into blocks reserved there
        (for the prompt and its first output; those of its leading blocks the worker has cached are
        taken as they are)."""
        self.pieces.setdefault(piece.req_id, []).append(piece)
        target = self.target(piece.req_id, decode, request.lora if self.adapter_routing else None)
        if target is not None and target.status is WorkerStatus.UP:
            names = block_names(request, target.step_planner.blocks.block_size)
            target.step_planner.reserve(piece.req_id, request.num_tokens + 1, names)
        if target is not None and target.ready_info.get("node_id") != prefill.ready_info.get(
            "node_id"
        ):
            named = self.prefetches.setdefault(target.actor, [])
            if not any(p.ref is piece.ref for p in named):  # a step's pieces may share one object
                named.append(piece)
        return (
            target if target is not None and piece.req_id in target.step_planner.reserved else None
        )

    def target(
        self, req_id: str, decode: list[WorkerState], lora: LoraRef | None = None
    ) -> WorkerState | None:
        """The decode worker a prompt's KV goes to: the one it was bound to while it answers, else
        the least loaded, counting the prompts already bound to each and preferring one that holds
        its LoRA adapter `lora` (it is bound to it from now on); None when no decode worker is
        left."""
        bound = self.bound.get(req_id)
        if bound is None or not bound.accepts:
            self.unbind(req_id)
            adapters: dict[str, set[LoraRef]] = {}  # of the prompts bound to each worker
            for other, lora_of in self.bound_adapters.items():
                adapters.setdefault(self.bound[other].name, set()).add(lora_of)
            bound = WorkerState.least_loaded(
                decode,
                coming=Counter(w.name for w in self.bound.values()),
                lora=lora,
                coming_adapters=adapters,
            )
            if bound is None:
                self.bound.pop(req_id, None)
            else:
                self.bound[req_id] = bound
                if lora is not None:
                    self.bound_adapters[req_id] = lora
        return bound

    def unbind(self, req_id: str) -> None:
        """End a prompt's binding: its reserved slot is free again, and what was imported into it
        void."""
        if (bound := self.bound.pop(req_id, None)) is not None:
            bound.step_planner.unreserve(req_id)
        self.bound_adapters.pop(req_id, None)
        self.sent.pop(req_id, None)

    def worker_lost(self, worker: WorkerState) -> None:
        """A decode worker died with its slots: the prompts bound to it go elsewhere, and the
        handoffs waiting there import every piece again, wherever they go."""
        for req_id in [r for r, w in self.bound.items() if w is worker]:
            self.unbind(req_id)
        for req_id, handoff in self.handoffs.items():
            if req_id in worker.step_planner.requests:
                self.handoffs[req_id] = dataclasses.replace(handoff, imported=0)
                self.importing.pop(req_id, None)

    def book(self, handoff: KVHandoff) -> None:
        """A handoff waits for its decode worker (a request's earlier one, if any, is void)."""
        self.handoffs[handoff.req_id] = handoff
        self.importing.pop(handoff.req_id, None)

    def final_imports(self, plan: StepPlan, held: dict[str, int]) -> list[KVImport]:
        """The handoffs of the plan's decode chunks that no step has been sent to import yet: with a
        step in flight ahead, the one after it must not import them again. `held`: the leading
        positions of each that the decode worker has already."""
        imports = [
            KVImport(c.block_table, self.handoffs[c.req_id], held=held.get(c.req_id, 0))
            for c in plan.decode
            if c.req_id in self.handoffs and c.req_id not in self.importing
        ]
        self.importing |= {i.handoff.req_id: i.handoff for i in imports}
        return imports

    def imported(self, req_id: str) -> KVHandoff | None:
        """A step imported a request's handoff: forget it (the object store frees the bytes) and
        return it; None if a later handoff of the request has replaced it since the step was
        sent."""
        handoff = self.importing.pop(req_id, None)
        if handoff is None or self.handoffs.get(req_id) is not handoff:
            return None
        return self.handoffs.pop(req_id)

    def early_imports(self, worker: WorkerState) -> list[KVImport]:
        """The pieces not yet sent of the prompts with blocks reserved on this decode worker."""
        imports = []
        for req_id, (_, blocks) in worker.step_planner.reserved.items():
            pieces = self.pieces.get(req_id, [])
            sent = self.sent.get(req_id, 0)
            if self.bound.get(req_id) is worker and len(pieces) > sent:
                handoff = KVHandoff(req_id, tuple(pieces), -1, sent)
                held = worker.step_planner.held.get(req_id, 0)
                imports.append(KVImport(blocks, handoff, final=False, held=held))
                self.sent[req_id] = len(pieces)
        return imports

    def hand_over(
        self, handoff: KVHandoff, decode: list[WorkerState], request: Request
    ) -> tuple[WorkerState | None, KVHandoff]:
        """Where a finished prompt's KV goes now (`target`), and its handoff with the pieces already
        in the slot reserved there; its binding ends here (the slot stays reserved until the prompt
        takes it)."""
        lora = request.lora if self.adapter_routing else None
        target = self.target(handoff.req_id, decode, lora)
        self.bound.pop(handoff.req_id, None)
        self.bound_adapters.pop(handoff.req_id, None)
        sent = self.sent.pop(handoff.req_id, 0)
        return target, dataclasses.replace(
            handoff,
            imported=sent if target and handoff.req_id in target.step_planner.reserved else 0,
        )

    def finish(self, req_id: str, prefill_worker: int) -> KVHandoff:
        """A prompt's last chunk is done: its pieces, in order, as one handoff (not yet booked)."""
        return KVHandoff(req_id, tuple(self.pieces.pop(req_id, ())), prefill_worker)

    def reservation_dropped(self, req_id: str) -> None:
        """The decode worker gave back the blocks reserved for a prompt (it needed them): what was
        imported into them is void, and its handoff imports every piece."""
        self.sent.pop(req_id, None)
        if (handoff := self.handoffs.get(req_id)) is not None:
            self.handoffs[req_id] = dataclasses.replace(handoff, imported=0)

    def void_pieces(self, req_id: str) -> None:
        """A preempted prompt exports again from its first row: the pieces sent so far are void."""
        self.pieces.pop(req_id, None)
        self.sent.pop(req_id, None)

    def drop(self, req_id: str) -> None:
        """Forget a request's pieces, handoff and binding: the object store frees their bytes."""
        self.pieces.pop(req_id, None)
        self.handoffs.pop(req_id, None)
        self.importing.pop(req_id, None)
        self.unbind(req_id)

    def take_prefetches(self) -> dict[str, list[KVPiece]]:
        """The pieces each decode worker should pull to its node now (the actor shell sends
        them)."""
        prefetches, self.prefetches = self.prefetches, {}
        return prefetches
