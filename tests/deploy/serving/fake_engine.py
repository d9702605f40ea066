"""A scripted stand-in for the engine client, and the OpenAI server on it: replies shaped in
milliseconds, no Ray."""

import asyncio
import json

from fastapi.responses import StreamingResponse

from deploy.serving.openai_api import OpenAIServer, ServedModel
from deploy.serving.schemas import ChatBody, CompletionBody
from scheduler.outputs import RequestOutput
from scheduler.request import Request, TokenLogprob
from scheduler.step_planner import QueueFullError
from tests.factories import tiny_tokenizer


def sampled_ids(request: Request) -> list[int]:
    """The tokens the fake engine 'samples' (ids 10..309, inside the tiny vocabulary): a function of
    the seed, so choice i of n matches seed + i."""
    return [10 + (request.sampling.seed * 7 + 3 * j) % 300 for j in range(request.max_tokens)]


def token_logprob(token_id: int, position: int, k: int) -> TokenLogprob:
    """The sampled token's log-prob and k alternatives; the last of two or more is -inf (JSON cannot
    say so)."""
    top = [(10 + (token_id + m) % 300, -0.1 * (m + 1)) for m in range(k)]
    if k >= 2:
        top[-1] = (top[-1][0], float("-inf"))
    return TokenLogprob(token_id, -0.25 * (position + 1), tuple(top))


def script(request: Request) -> list[RequestOutput]:
    """One output per token; text only on every second one (as held-back text lags its tokens), the
    last output finished ('length'). Log-probs as the request asks: one per token, the prompt's on
    the first."""
    tokenizer, outs = tiny_tokenizer(), []
    ids = sampled_ids(request)
    for j, token_id in enumerate(ids):
        text = tokenizer.decode(ids[j - 1 : j + 1]) if j % 2 else ""
        if j == len(ids) - 1 and not j % 2:
            text = tokenizer.decode([token_id])
        out = RequestOutput(request.req_id, [token_id], text)
        if request.sampling.logprobs is not None:
            out.logprobs = [token_logprob(token_id, j, request.sampling.logprobs)]
        outs.append(out)
    if request.sampling.prompt_logprobs is not None:
        k = request.sampling.prompt_logprobs
        outs[0].prompt_logprobs = [
            token_logprob(t, p, k) for p, t in enumerate(request.prompt_ids[1:])
        ]
    outs[-1].finish_reason = "length"
    return outs


class FakeEngine:
    """Streams `script(request)` for each request. Records the requests, and those whose stream was
    closed before its end (what the real client turns into an abort). Requests named in `refuse` get
    a full queue."""

    def __init__(
        self,
        fail: set[str] = frozenset(),
        refuse: set[str] = frozenset(),
        unavailable: bool = False,
    ) -> None:
        self.requests: dict[str, Request] = {}
        self.aborted: list[str] = []
        self.fail, self.refuse, self.unavailable = fail, refuse, unavailable

    async def generate(self, request: Request):  # type: ignore[no-untyped-def]
        if request.req_id.rsplit("-", 1)[1] in self.refuse:
            raise QueueFullError("the queue is full")
        self.requests[request.req_id] = request
        finished = False
        try:
            for j, out in enumerate(script(request)):
                await asyncio.sleep(0)  # (a turn of the loop between outputs, as a stream has)
                if j == 2 and request.req_id.rsplit("-", 1)[1] in self.fail:
                    out = RequestOutput(
                        request.req_id,
                        [],
                        "",
                        finish_reason="error",
                        error="worker lost",
                        unavailable=self.unavailable,
                    )
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.aborted.append(request.req_id)


class Says:
    """An engine whose every request generates `text`, in pieces of `step` characters, then
    stops."""

    def __init__(self, text: str, step: int = 3, finish_reason: str = "stop") -> None:
        self.text, self.step, self.finish_reason = text, step, finish_reason
        self.requests: list[Request] = []

    async def generate(self, request: Request):  # type: ignore[no-untyped-def]
        self.requests.append(request)
        pieces = [self.text[i : i + self.step] for i in range(0, len(self.text), self.step)]
        for j, piece in enumerate(pieces):
            await asyncio.sleep(0)
            yield RequestOutput(
                request.req_id,
                [10 + j],
                piece,
                finish_reason=self.finish_reason if j == len(pieces) - 1 else None,
            )


def make_server(  # type: ignore[no-untyped-def]
    engine=None,
    capacity: int = 256,
    parser: str | None = None,
    reasoning: str | None = None,
    tokenizer=None,
) -> OpenAIServer:
    """The OpenAI server on `engine` (a `FakeEngine` by default) serving "tiny" with the tiny
    tokenizer, reading tool calls with `parser` and reasoning with `reasoning`."""
    tokenizer = tokenizer or tiny_tokenizer()
    eos = frozenset({tokenizer.eos_token_id})
    model = ServedModel("tiny", tokenizer, eos, capacity, parser, reasoning)
    return OpenAIServer(engine or FakeEngine(), model)


def reply(server: OpenAIServer, body: CompletionBody | ChatBody) -> dict | list[dict]:
    """The JSON body, or a stream's events (JSON objects; `[DONE]` checked and left out)."""

    async def run() -> dict | list[dict]:
        response = await server.respond(body)
        if not isinstance(response, StreamingResponse):
            return json.loads(response.body)
        events = [event async for event in response.body_iterator]
        assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events)
        assert events[-1] == "data: [DONE]\n\n"
        return [json.loads(e[6:]) for e in events[:-1]]

    return asyncio.run(run())
