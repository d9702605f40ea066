"""Applies sampled tokens to requests: text deltas, stop strings, and what each request's stream
gets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from scheduler.detokenizer import IncrementalDetokenizer
from scheduler.plan import StepUpdate
from scheduler.request import OPENAI_FINISH_REASON, FinishReason, Request, TokenLogprob
from scheduler.step_planner import StepPlanner


@dataclass
class RequestOutput:
    """What one request's stream receives after a step: its new tokens and text, and whether it
    ended."""

    req_id: str
    token_ids: list[int] = field(default_factory=list)  # new since the last output
    text: str = ""  # new since the last output; never a broken character or part of a stop string
    finish_reason: str | None = None  # OpenAI's name; None while the request runs
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)  # on the last output only
    # one per token of token_ids, when asked for
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # prompt tokens 1.. (the first has none), on the request's first output, when asked for (echo)
    prompt_logprobs: list[TokenLogprob] | None = None
    # an error only: no engine could take the request now (retrying later may work)
    unavailable: bool = False
    # an error only, what ended it: "queue_timeout" (waited past its queue deadline), "timeout"
    # (past its own), None (a failure)
    error_code: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output and the request's next one as one: tokens and text joined, the later one's
        ending."""
        return RequestOutput(
            self.req_id,
            self.token_ids + later.token_ids,
            self.text + later.text,
            later.finish_reason,
            later.error,
            later.metrics or self.metrics,
            self.logprobs + later.logprobs,
            self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
            later.unavailable,
            later.error_code,
        )


def coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Successive outputs of each request as one (a consumer that polls once per decode burst gets
    one output per request, not one per step); never across a request's final output, since its id
    may already be in use again."""
    merged: list[RequestOutput] = []
    open_at: dict[str, int] = {}  # req_id -> index in merged of its unfinished output
    for out in outputs:
        at = open_at.pop(out.req_id, None)
        if at is None:
            at = len(merged)
            merged.append(out)
        else:
            merged[at] = merged[at].then(out)
        if not out.finished:
            open_at[out.req_id] = at
    return merged


class OutputProcessor:
    """Keeps each request's detokenizer; finishes requests whose text reaches a stop string.

    Without a tokenizer it only reports tokens (text stays empty and stop strings do not apply).
    """

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        # unfinished requests: their log-probs are read from them
        self.requests: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        self.requests[request.req_id] = request
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_ids,
                request.stop_strings,
                request.sampling.min_tokens,
            )
            # a continuation: its first outputs were streamed by another scheduler
            if request.output_ids:
                detok.resume(request.output_ids, request.text_sent)
            self.detokenizers[request.req_id] = detok

    def apply(self, scheduler: StepPlanner, update: StepUpdate) -> list[RequestOutput]:
        """After `scheduler.update`: push each token it took, apply stop strings, close finished
        requests."""
        outputs: dict[str, RequestOutput] = {}
        finished = list(update.finished)
        for req_id, tokens in update.accepted.items():
            detok = self.detokenizers.get(req_id)
            out = outputs.setdefault(req_id, RequestOutput(req_id))
            request = self.requests.get(req_id)
            # the request's outputs before this step's: the step took tokens[0], tokens[1], ...
            first = None if request is None else len(request.output_ids) - len(tokens)
            for i, token in enumerate(tokens):
                out.token_ids.append(token)
                if request is not None and first is not None:
                    index = first + i  # this token's output index
                    if request.sampling.logprobs is not None and index < len(request.logprobs):
                        out.logprobs.append(request.logprobs[index])
                    if request.sampling.prompt_logprobs is not None and index == 0:
                        out.prompt_logprobs = list(request.prompt_logprobs)
                if detok is None:
                    continue
                out.text += detok.push(token)
                if detok.stopped:
                    if request is not None and first is not None and i + 1 < len(tokens):
                        # a stop string inside an accepted run: what follows it is not output
                        del request.output_ids[first + i + 1 :]
                        del request.logprobs[first + i + 1 :]
                        del request.token_times_s[
                            len(request.token_times_s) - (len(tokens) - i - 1) :
                        ]
                    stopped = scheduler.finish(req_id, FinishReason.STOP)
                    if stopped is not None:
                        finished.append(stopped)
                    break
        for request in finished:
            out = outputs.setdefault(request.req_id, RequestOutput(request.req_id))
            out.text += self.close(request)
            assert request.finish_reason is not None
            out.finish_reason = OPENAI_FINISH_REASON[request.finish_reason]
            out.error = request.error
            out.metrics = request.metrics()
        return list(outputs.values())

    def close(self, request: Request) -> str:
        """Forget a finished request; set its full text and return the text not yet emitted."""
        self.requests.pop(request.req_id, None)
        detok = self.detokenizers.pop(request.req_id, None)
        if detok is None:
            return ""
        rest = detok.flush()
        request.text = detok.text
        return rest


@dataclass
class Completion:
    """A finished request as every mode reports it."""

    req_id: str
    prompt_tokens: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    # when the consumer got each token (perf_counter): inter-token latency as a client sees it
    token_times_s: list[float] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] | None = None

    @classmethod
    def from_request(cls, request: Request) -> Completion:
        assert request.finish_reason is not None
        prompt_logprobs = (
            list(request.prompt_logprobs) if request.sampling.prompt_logprobs is not None else None
        )
        return cls(
            request.req_id,
            len(request.prompt_ids),
            list(request.output_ids),
            request.text,
            OPENAI_FINISH_REASON[request.finish_reason],
            request.error,
            request.metrics(),
            list(request.token_times_s),
            list(request.logprobs),
            prompt_logprobs,
        )

    def arrival_gaps_s(self) -> list[tuple[float, float]]:
        """(arrival time, gap since the previous arrival) as a client sees them: tokens that arrive
        in one output (a reader that fell behind gets them merged) are one arrival, and its gap
        holds the whole wait (vLLM's benchmark counts inter-token latency per chunk received the
        same way)."""
        arrivals = [
            t for i, t in enumerate(self.token_times_s) if i == 0 or t != self.token_times_s[i - 1]
        ]
        return [(b, b - a) for a, b in zip(arrivals, arrivals[1:], strict=False)]

    def inter_token_s(self) -> list[float]:
        """The inter-token latencies a client sees: the gaps between successive arrivals."""
        return [gap for _, gap in self.arrival_gaps_s()]
