"""Request state: what a request asked for, how far it has got, and why it finished."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field

# a token id that is not known yet: sampled by the step in flight, fed in by its worker
PENDING = -1


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no slot yet
    RUNNING = "running"  # holds a slot; computing its prompt or decoding
    FINISHED = "finished"  # done for any reason; its slot has been returned


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled by the caller (e.g. a client disconnect)
    ERROR = "error"  # failed inside the engine; the message is on the request


# The one table from our finish reasons to OpenAI's `finish_reason` field.
OPENAI_FINISH_REASON: dict[FinishReason, str] = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


MAX_LOGPROBS = 20  # most alternatives a token's log-probs can list (OpenAI's top_logprobs limit)
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each logit_bias value


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each token. temperature 0 means greedy; top_k 0, top_p 1 and min_p 0 disable
    those filters.

    Logit processing runs in this order on each row: logit_bias, the penalties, the
    structured-output mask, min_tokens (stop ids masked); then temperature, top-k, top-p and the
    draw. Log-probs are the model's own (before any of that), as vLLM and OpenAI report them.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    # drop tokens less likely than min_p times the most likely one (after temperature)
    min_p: float = 0.0
    # with the token's index, seeds that token's draw: samples never depend on the batch
    seed: int = 0
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    # divides positive / multiplies negative logits of prompt+output tokens
    repetition_penalty: float = 1.0
    # `suppress_ids` cannot be sampled (and stop strings do not match) before this many
    min_tokens: int = 0
    # the request's stop ids, masked while under min_tokens
    suppress_ids: frozenset[int] = frozenset()
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: no log-probs; k: the sampled token's and the k most likely
    prompt_logprobs: int | None = None  # likewise for every prompt token after the first (echo)
    structured: str | None = None  # JSON of an OpenAI response_format (json_object / json_schema)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(
                    f"logit_bias needs token ids >= 0 and biases in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {token}: {bias}"
                )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    @property
    def needs_history(self) -> bool:
        """The worker must know the tokens so far (penalties count them; a grammar follows them)."""
        return self.penalized or self.structured is not None

    @property
    def processes_logits(self) -> bool:
        """Anything to do to a row's logits before temperature and the draw."""
        return (
            self.needs_history
            or bool(self.logit_bias)
            or (self.min_tokens > 0 and bool(self.suppress_ids))
        )


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability under the model, and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-prob), most likely first


@dataclass(frozen=True)
class LoraRef:
    """A LoRA adapter a request runs with: its name (the OpenAI `model` it is asked by) and the
    path of its PEFT checkpoint, which every worker that runs the request reads."""

    name: str
    path: str

    @property
    def salt(self) -> bytes:
        """What block names of its requests start from: KV of two adapters is never shared."""
        return f"lora:{self.name}:{self.path}".encode()


@dataclass(eq=False)
class Request:
    """One generation request and its progress.

    The tokens a request has are its prompt followed by its output; `num_computed` counts how many
    of them are in its cache row. There is no separate prefill phase: a request whose uncomputed
    tokens are exactly its last sampled token is decoding; otherwise it is computing a prompt (or,
    after preemption or a lost worker, recomputing prompt + output).
    """

    req_id: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset[int] = frozenset()  # EOS unless ignore_eos, plus the caller's
    stop_strings: tuple[str, ...] = ()  # matched on the detokenized text by the engine, not here
    priority: int = 0  # lower is more urgent
    # n > 1: a sibling with the same prompt whose prompt KV this one may copy
    fork_of: str | None = None
    # deadlines from its arrival: to start (be given a slot), and to finish; past one it ends
    # with an error (`Coordinator.expire`)
    max_queue_s: float | None = None
    timeout_s: float | None = None
    # placed again after its cell was lost (`continuation`): what it already got was counted there
    is_continuation: bool = False
    lora: LoraRef | None = None  # the adapter it runs with; None: the base model

    status: RequestStatus = RequestStatus.WAITING
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens in its KV blocks, counting those of a step still in flight
    num_pending: int = 0  # tokens sampled by a step in flight: planned for, not yet known
    slot: int | None = None  # its slot among the worker's `max_num_seqs` running requests
    # the KV blocks of its positions 0, B, 2B, ... on the worker that holds it
    block_table: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    text: str = ""  # detokenized output, cut before a stop string; filled by the engine
    num_recomputes: int = 0  # times its cache was lost (worker died, handoff lost) and recomputed
    num_preemptions: int = 0  # times it was preempted for a more urgent request (then recomputed)
    # times it took a slot on the worker it is on (its chunks carry the count: a result planned for
    # an earlier admission, in flight when the request left, is void)
    num_admissions: int = 0
    # on a prefill worker: leading rows of its cache row already sent out (KV pieces)
    num_exported: int = 0
    # positions whose KV the decode worker's draft model holds (speculation by a draft model)
    num_drafted: int = 0
    num_cached: int | None = None  # prompt tokens its first admission loaded from the prefix cache

    arrival_s: float = field(default_factory=time.perf_counter)
    scheduled_s: float | None = None  # first admitted into a slot
    first_token_s: float | None = None
    finish_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # when each output token was sampled
    # per output token, if sampling.logprobs is set
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # prompt tokens 1.. (echo), as computed
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # prefix cache: its full blocks' names, per block size
    block_names: dict[int, list[bytes]] = field(default_factory=dict, repr=False)
    # a continuation (see `continuation`): characters of its text the client already has
    text_sent: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"request {self.req_id!r}: the prompt is empty")
        if self.max_tokens < 1:
            raise ValueError(
                f"request {self.req_id!r}: max_tokens must be >= 1, got {self.max_tokens}"
            )

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens known so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_outputs_planned(self) -> int:
        """Output tokens known or being sampled: what max_tokens and seeds count against."""
        return len(self.output_ids) + self.num_pending

    def token_ids(self, start: int, stop: int) -> list[int]:
        """Tokens start..stop-1 of prompt + output, without building the joined list; a token still
        being sampled by a step in flight reads as PENDING (the worker that samples it feeds it
        in)."""
        known = self.num_tokens
        if stop > known:
            return self.token_ids(start, known) + [PENDING] * (stop - max(start, known))
        num_prompt = len(self.prompt_ids)
        if stop <= num_prompt:
            return self.prompt_ids[start:stop]
        if start >= num_prompt:
            return self.output_ids[start - num_prompt : stop - num_prompt]
        return self.prompt_ids[start:] + self.output_ids[: stop - num_prompt]

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens + self.num_pending - self.num_computed

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled (or being sampled) token is missing from the cache."""
        return self.num_outputs_planned > 0 and self.num_uncomputed == 1

    @property
    def wants_prompt_logprobs(self) -> bool:
        """It still needs prompt log-probs (echo): every prompt position must be computed, none
        copied."""
        return (
            self.sampling.prompt_logprobs is not None
            and len(self.prompt_logprobs) < len(self.prompt_ids) - 1
        )

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def mark_finished(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error
        self.num_pending = 0  # whatever a step in flight samples for it is dropped
        self.slot = None
        self.block_table = []
        self.finish_s = time.perf_counter()

    def reset_cache(self) -> None:
        """Its cache is gone (preempted, or lost with a worker): recompute prompt + output so far,
        then continue where it stopped. The one recompute path for preemption and faults."""
        self.num_computed = 0
        self.num_pending = 0
        self.slot = None
        self.block_table = []
        self.status = RequestStatus.WAITING
        self.num_exported = 0
        self.num_drafted = 0

    def metrics(self) -> dict[str, float]:
        """Latencies in seconds: TTFT, TPOT (after the first token), end to end, and the phases
        queue (arrival to first slot), prefill (to first token), decode (first token to finish);
        and how often it was preempted."""
        end = self.finish_s if self.finish_s is not None else time.perf_counter()
        first = self.first_token_s
        scheduled = self.scheduled_s
        num_later = len(self.output_ids) - 1
        return {
            "ttft_s": first - self.arrival_s if first is not None else 0.0,
            "tpot_s": (end - first) / num_later if num_later > 0 and first is not None else 0.0,
            "e2e_s": end - self.arrival_s,
            "queue_s": (scheduled if scheduled is not None else end) - self.arrival_s,
            "prefill_s": first - scheduled if first is not None and scheduled is not None else 0.0,
            "decode_s": end - first if first is not None else 0.0,
            "preemptions": self.num_preemptions,
            "cached_tokens": self.num_cached or 0,
        }


def continuation(
    request: Request, output_ids: list[int], logprobs: list[TokenLogprob], text_sent: int
) -> Request:
    """`request` as it stands after its client received `output_ids` (with their log-probs and
    `text_sent` characters of text): queued anywhere, it is recomputed from prompt + those tokens
    like a preempted request and continues exactly where it stopped, since each draw is seeded by
    (seed, token index). It computes its own prompt (no sibling to copy from) and, once a token was
    sent, sends no prompt log-probs again (they came with the first output)."""
    sampling = (
        dataclasses.replace(request.sampling, prompt_logprobs=None)
        if output_ids
        else request.sampling
    )
    return Request(
        request.req_id,
        list(request.prompt_ids),
        request.max_tokens,
        sampling,
        request.stop_token_ids,
        request.stop_strings,
        request.priority,
        max_queue_s=request.max_queue_s,
        timeout_s=request.timeout_s,
        is_continuation=True,
        lora=request.lora,
        output_ids=list(output_ids),
        logprobs=list(logprobs),
        text_sent=text_sent,
    )
