"""The KV a cell has in flight between its pools, and the decode worker each prompt's KV goes to.

A prompt on a prefill worker sends its KV out a piece per step (`KVPiece`); when its last chunk is done
the pieces become a `KVHandoff` that waits until a decode worker imports it. The book holds the only
references to those objects, so dropping an entry frees their bytes. From its first piece a prompt is
bound to the decode worker it will go to; when that worker is on another node, each piece is named to
it as soon as it exists (`take_prefetches`), so the worker pulls the bytes to its node while the prompt
is still prefilling and only the last piece's transfer is left between the first token and the second.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from scheduler.cell import WorkerState, WorkerStatus
from scheduler.messages import KVHandoff, KVPiece


class HandoffBook:
    def __init__(self) -> None:
        self.pieces: dict[str, list[KVPiece]] = {}  # prompts on prefill workers: the KV pieces sent so far
        self.handoffs: dict[str, KVHandoff] = {}  # handed off, not yet imported
        self.bound: dict[str, WorkerState] = {}  # prompts on prefill workers: the decode worker they go to
        self.prefetches: dict[str, list[Any]] = {}  # decode worker name -> piece refs to pull to its node

    def add_piece(self, piece: KVPiece, prefill: WorkerState, decode: list[WorkerState]) -> None:
        """Keep a piece of a prompt still prefilling; name it to its decode worker if that is elsewhere."""
        self.pieces.setdefault(piece.req_id, []).append(piece)
        target = self.target(piece.req_id, decode)
        if target is not None and target.placement.get("node_id") != prefill.placement.get("node_id"):
            refs = self.prefetches.setdefault(target.name, [])
            if not any(ref is piece.ref for ref in refs):  # a step's pieces share one object
                refs.append(piece.ref)

    def target(self, req_id: str, decode: list[WorkerState]) -> WorkerState | None:
        """The decode worker a prompt's KV goes to: the one it was bound to while it answers, else the
        least loaded, counting the prompts already bound to each (it is bound to it from now on); None
        when no decode worker is left."""
        bound = self.bound.get(req_id)
        if bound is None or bound.status is not WorkerStatus.UP:
            self.bound.pop(req_id, None)
            bound = WorkerState.least_loaded(decode, coming=Counter(w.name for w in self.bound.values()))
            if bound is None:
                self.bound.pop(req_id, None)
            else:
                self.bound[req_id] = bound
        return bound

    def release(self, req_id: str, decode: list[WorkerState]) -> WorkerState | None:
        """Where a finished prompt's KV goes now (`target`); its binding ends here."""
        target = self.target(req_id, decode)
        self.bound.pop(req_id, None)
        return target

    def finish(self, req_id: str, prefill_worker: int) -> KVHandoff:
        """A prompt's last chunk is done: its pieces, in order, as one handoff (not yet booked)."""
        return KVHandoff(req_id, tuple(self.pieces.pop(req_id, ())), prefill_worker)

    def void_pieces(self, req_id: str) -> None:
        """A preempted prompt exports again from its first row: the pieces sent so far are void."""
        self.pieces.pop(req_id, None)

    def drop(self, req_id: str) -> None:
        """Forget a request's pieces, handoff and binding: the object store frees their bytes."""
        self.pieces.pop(req_id, None)
        self.handoffs.pop(req_id, None)
        self.bound.pop(req_id, None)

    def take_prefetches(self) -> dict[str, list[Any]]:
        """The refs each decode worker should pull to its node now (the actor shell sends them)."""
        prefetches, self.prefetches = self.prefetches, {}
        return prefetches
