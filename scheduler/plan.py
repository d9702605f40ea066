"""The step plan: plain data the policy hands to a worker, naming which tokens to compute where; and
the policy's other plain records (its queue entries, what a step's results did)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from scheduler.request import LoraRef, Request, SamplingParams

History = tuple[tuple[int, ...], tuple[int, ...]]  # a request's (prompt, output so far)


@dataclass(slots=True)
class Chunk:
    """Tokens of one request to compute in this step, at consecutive positions of its sequence."""

    req_id: str
    # its KV blocks on the worker that runs the chunk: position p is in block_table[p // block size]
    block_table: list[int]
    token_ids: list[int]  # the tokens to compute now (one for a decode step)
    start_pos: int  # position of token_ids[0] in the request's sequence
    sample: bool  # the last token's logits choose the request's next output token
    output_index: int  # index that next token will have in the output; seeds its draw
    # sent with the request's first chunk on a worker (and again after its cache there was lost);
    # None otherwise: the worker keeps them (`scheduler/worker_copy.py`)
    sampling: SamplingParams | None
    # (prompt, output so far): the worker (re)builds the request's sampling state from it. Sent with
    # a request's first sampling chunk on a worker, and again after its cache was lost, when its
    # sampling needs history (penalties, a grammar); None otherwise.
    history: History | None = None
    # echo: prompt tokens start_pos+1.. whose log-probs this chunk returns; target i is predicted by
    # position start_pos + i
    prompt_targets: tuple[int, ...] = ()
    # the request's `num_admissions` when planned: a result for an earlier admission of it is void
    admission: int = 0
    # speculative decoding: draft tokens appended to a decode chunk's token (token_ids[1:]); the
    # worker samples at every position and takes drafts while they equal its samples
    draft: tuple[int, ...] = ()
    # drafts a draft model proposes (all PROPOSED): the request's tokens at the positions before
    # start_pos that the worker's draft model has not seen yet, which it computes first
    draft_context: tuple[int, ...] = ()
    # the LoRA adapter its tokens run with (None: the base model)
    lora: LoraRef | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    """One step for one worker: decode tokens first, then prompt chunks, never over the token
    budget."""

    decode: list[Chunk]  # one token per decoding request, all sampled
    prefill: list[Chunk]  # prompt (or recompute) chunks, most urgent then oldest request first
    # preempted while planning; they wait to recompute
    preempted: list[str] = field(default_factory=list)
    # left this worker since its last plan, or their copy there is void: drop their state
    forget: list[str] = field(default_factory=list)
    # (source block, destination block): blocks to copy before the forward (n > 1: a choice takes
    # its sibling's partly filled last prompt block; the full ones it shares)
    copies: list[tuple[int, int]] = field(default_factory=list)
    # prefill workers: (req_id, block table, first position, end) of KV to send out after the
    # forward, as each chunk is computed, so a finished prompt's handoff has only its last piece
    # left to send
    exports: list[tuple[str, list[int], int, int]] = field(default_factory=list)

    @property
    def chunks(self) -> list[Chunk]:
        return self.decode + self.prefill

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.decode) + sum(c.num_tokens for c in self.prefill)

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill or self.copies)


class StepUpdate(NamedTuple):
    """What a step's results did: the tokens taken, in order (a request that left while the step
    ran takes none; one whose drafts were accepted, several) and the requests that finished."""

    accepted: dict[str, list[int]]
    finished: list[Request]


class WaitingEntry(NamedTuple):
    """A queued request and the key it is admitted by: most urgent priority, then oldest, then first
    in."""

    priority: int
    arrival_s: float
    order: int
    request: Request
