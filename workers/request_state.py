"""What a worker keeps per request between steps: its sampling parameters, the tokens penalties
count, and its grammar matcher."""

from __future__ import annotations

from collections import Counter
from typing import Any, Protocol

import torch

from scheduler.plan import Chunk, History
from scheduler.request import SamplingParams


class Matcher(Protocol):
    """A grammar following one request's output (workers.grammar.GrammarMatcher)."""

    def mask_logits(self, logits: torch.Tensor) -> None: ...
    def accept(self, token_id: int) -> None: ...
    @property
    def ended(self) -> bool: ...


class RequestState:
    """Built from a request's prompt and output so far (`history` of its first sampling chunk on
    this worker), then advanced by every token this worker samples for it."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: tuple[int, ...],
        output_ids: tuple[int, ...],
        matcher: Matcher | None,
    ) -> None:
        self.prompt_ids = frozenset(prompt_ids) if params.repetition_penalty != 1.0 else frozenset()
        self.counts: Counter[int] = Counter()
        self.matcher = matcher
        self.num_outputs = 0
        for token in output_ids:
            self.consume(token)

    def consume(self, token: int) -> None:
        """The request's next output token."""
        self.counts[token] += 1
        self.num_outputs += 1
        # after EOS the request has ended: a step already in flight may still sample for it
        # (dropped)
        if self.matcher is not None and not self.matcher.ended:
            self.matcher.accept(token)


class RequestStates:
    """A worker's sampling parameters and states by request id. `grammars` compiles response formats
    (built on first use)."""

    def __init__(self, grammar_factory: Any = None) -> None:
        self.params: dict[str, SamplingParams] = {}  # from each request's first chunk here
        self.states: dict[str, RequestState] = {}
        # () -> GrammarCompiler, or None: no structured output here
        self._grammar_factory = grammar_factory
        self._compiler: Any = None

    def remember(self, chunks: list[Chunk]) -> None:
        """Keep the sampling parameters that came with a request's first chunk here."""
        for c in chunks:
            if c.sampling is not None:
                self.params[c.req_id] = c.sampling

    def params_of(self, chunk: Chunk) -> SamplingParams:
        params = self.params.get(chunk.req_id) if chunk.sampling is None else chunk.sampling
        if params is None:
            raise RuntimeError(f"{chunk.req_id}: its sampling parameters never came to this worker")
        return params

    def get(self, req_id: str) -> RequestState | None:
        return self.states.get(req_id)

    def rebuild(self, req_id: str, params: SamplingParams, history: History) -> None:
        """(Re)build a request's state from its prompt and outputs so far."""
        matcher = None
        if params.structured is not None:
            if self._compiler is None:
                if self._grammar_factory is None:
                    raise ValueError(
                        "this worker has no tokenizer, so it cannot follow a response_format"
                    )
                self._compiler = self._grammar_factory()
            matcher = self._compiler.matcher(params.structured)
        self.states[req_id] = RequestState(params, history[0], history[1], matcher)

    def drop(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.params.pop(req_id, None)
            self.states.pop(req_id, None)
