"""Messages between the scheduler and the workers: plain dataclasses of ints, lists and object refs.

They live in the pure `scheduler` package so that the coordinator can read them and `workers/` can
build them, with imports pointing one way (workers -> scheduler).

A step call's plans travel packed (`pack_plans`): pickled by the standard library's C pickler before
Ray sees them. Ray pickles a call's arguments with cloudpickle, whose hook on every object made a
64-chunk decode plan cost 281 us to pickle and 133 us to load against 87 and 104 us (a script timing
both on one plan). Plans hold no object refs; the KV imports, which do, stay Ray's to serialize.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from scheduler.plan import StepPlan
from scheduler.request import TokenLogprob


class WorkerRestarted(Exception):
    """A step call reached a worker restarted since the scheduler last asked it `ready()`: the call
    assumes cache and sampling state the fresh worker never had, so it runs nothing. The
    scheduler treats it as the worker's death (its requests are recomputed), as it would a failed
    call; without this, a worker killed while it had no call in flight would take its next call
    as if nothing had happened."""


@dataclass(frozen=True)
class KVPiece:
    """KV rows of one request, positions start..start+num_tokens-1, that a prefill worker sent out
    after the step that computed them (`workers/kv_transfer.py`): an object shared by the step's
    pieces where the transport batches them, each request's rows at `offset`."""

    req_id: str
    start: int
    num_tokens: int
    # a reference to the rows, [layers, 2, kv_heads, tokens, head_dim]: a ray.ObjectRef
    ref: Any
    num_bytes: int
    # time the prefill worker spent on it (copy out and put; its step's, when shared)
    export_s: float
    # where its rows start along the token axis of the object (a step's pieces share one)
    offset: int = 0
    transport: str = "object_store"  # how the decode worker gets the bytes


@dataclass(frozen=True)
class KVHandoff:
    """A finished prompt's KV rows: the pieces its prefill worker sent out chunk by chunk, in order.

    The only place the pieces' ObjectRefs live once the prompt is done: the scheduler passes this
    object to the decode worker and drops it once imported (or the request ends), which frees the
    bytes.
    """

    req_id: str
    pieces: tuple[KVPiece, ...]
    prefill_worker: int
    imported: int = 0  # pieces already in its decode blocks (imported while the prompt prefilled)

    @property
    def num_tokens(self) -> int:  # positions 0..num_tokens-1 of the request's sequence
        return self.pieces[-1].start + self.pieces[-1].num_tokens if self.pieces else 0

    @property
    def num_bytes(self) -> int:
        return sum(p.num_bytes for p in self.pieces)

    @property
    def export_s(self) -> float:
        """Time on the critical path, after the prompt's last chunk: its last piece's export."""
        return self.pieces[-1].export_s if self.pieces else 0.0


@dataclass(frozen=True)
class KVImport:
    """Put a handoff's pieces past `handoff.imported` into a request's blocks on a decode worker
    before this step's forward. Not `final`: the pieces so far of a prompt still prefilling, into
    the blocks reserved for it."""

    block_table: list[int]
    handoff: KVHandoff
    final: bool = True
    # positions 0..held-1 are in the blocks already (the decode worker had them cached): not copied
    held: int = 0


@dataclass
class Samples:
    """What one forward produced: a token per sampling chunk, and the log-probs the chunks asked
    for."""

    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # of the sampled token
    # a chunk with drafts: the tokens after the first that it took (drafts that matched, then the
    # token sampled after the last of them), and their log-probs
    more: dict[str, list[int]] = field(default_factory=dict)
    more_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # of a chunk's prompt_targets
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


@dataclass
class StepResult:
    """What a worker returns for one step."""

    samples: Samples  # a token for every sampling chunk that ran, and the log-probs asked for
    kv_pieces: list[KVPiece] = field(default_factory=list)  # prefill workers: the plan's exports
    # decode workers: handoffs whose bytes were lost
    failed_imports: list[str] = field(default_factory=list)
    # decode workers: seconds to fetch and copy in
    import_s: dict[str, float] = field(default_factory=dict)
    # decode workers: per transport, (bytes fetched, seconds fetching, transfers lost)
    kv_transfers: dict[str, tuple[int, float, int]] = field(default_factory=dict)
    step_s: float = 0.0  # wall time of the step on the worker
    forward_s: float = 0.0  # of which inside the model's forward


def pack_plans(plans: list[StepPlan]) -> bytes:
    """A step call's plans as the bytes the worker unpacks (`unpack_plans`)."""
    return pickle.dumps(plans, protocol=pickle.HIGHEST_PROTOCOL)


def unpack_plans(packed: bytes) -> list[StepPlan]:
    plans: list[StepPlan] = pickle.loads(packed)
    return plans
