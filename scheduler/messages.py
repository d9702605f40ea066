"""Messages between the scheduler and the workers: plain dataclasses of ints, lists and object refs.

They live in the pure `scheduler` package so that the coordinator can read them and `workers/` can
build them, with imports pointing one way (workers -> scheduler).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.request import TokenLogprob


@dataclass(frozen=True)
class KVHandoff:
    """A prompt's KV rows, exported by a prefill worker into Ray's object store.

    The only place a handoff's ObjectRef lives: the scheduler passes this object to the decode worker
    and drops it once imported (or the request ends), which frees the bytes.
    """

    req_id: str
    ref: Any  # ray.ObjectRef of a numpy array [layers, 2, kv_heads, num_tokens, head_dim]
    num_tokens: int  # positions 0..num_tokens-1 of the request's sequence
    num_bytes: int
    export_s: float  # time the prefill worker spent exporting (copy out and put)
    prefill_worker: int


@dataclass(frozen=True)
class KVImport:
    """Put a handoff into a decode slot before this step's forward."""

    slot: int
    handoff: KVHandoff


@dataclass
class Samples:
    """What one forward produced: a token per sampling chunk, and the log-probs the chunks asked for."""

    tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # of the sampled token
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)  # of a chunk's prompt_targets


@dataclass
class StepResult:
    """What a worker returns for one step."""

    sampled: dict[str, int]  # req_id -> token, for every sampling chunk that ran
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)  # see Samples
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    handoffs: list[KVHandoff] = field(default_factory=list)  # prefill workers: prompts finished this step
    failed_imports: list[str] = field(default_factory=list)  # decode workers: handoffs whose bytes were lost
    import_s: dict[str, float] = field(default_factory=dict)  # decode workers: seconds to fetch and copy in
    step_s: float = 0.0  # wall time of the step on the worker
    forward_s: float = 0.0  # of which inside the model's forward
