"""The bench's streaming client against a scripted SSE server on loopback: whole streams timed,
broken ones counted as failed with the reason."""

import asyncio
import json

import pytest
from aiohttp import web

from deploy.bench.http_client import session, stream_request


def _event(data: dict) -> bytes:
    return f"data: {json.dumps(data)}\n\n".encode()


def _chunk(text: str, finish: str | None = None) -> bytes:
    return _event({"choices": [{"index": 0, "text": text, "finish_reason": finish}]})


USAGE = _event(
    {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}}
)
DONE = b"data: [DONE]\n\n"
SCRIPTS = {  # what each path streams, event by event
    # two events in one write
    "whole": [_chunk("a"), _chunk("b") + _chunk("c", "length"), USAGE, DONE],
    "crlf": [
        _chunk("a").replace(b"\n", b"\r\n"),
        _chunk("b", "stop").replace(b"\n", b"\r\n"),
        USAGE,
        DONE,
    ],
    "no_done": [_chunk("a"), _chunk("b", "length"), USAGE],
    "no_usage": [_chunk("a", "length"), DONE],
    "no_finish": [_chunk("a"), USAGE, DONE],
    "error": [_chunk("a"), _event({"error": {"message": "Generation failed: boom"}}), DONE],
    "bad_json": [b"data: {not json\n\n", DONE],
}


async def _serve(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    if name == "busy":
        return web.json_response({"error": {"message": "the waiting queue is full"}}, status=429)
    reply = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await reply.prepare(request)
    for part in SCRIPTS[name]:
        await reply.write(part)
        await asyncio.sleep(0.01)  # the parts come apart, as a server's events do
    return reply


async def _run_all() -> dict:
    app = web.Application()
    app.router.add_post("/{name}", _serve)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        async with session(8, 30.0) as http:
            names = [*SCRIPTS, "busy"]
            done = await asyncio.gather(
                *(stream_request(http, f"http://127.0.0.1:{port}/{n}", {}, n, 2) for n in names)
            )
            return dict(zip(names, done, strict=True))
    finally:
        await runner.cleanup()


def test_whole_streams_are_timed_and_broken_ones_fail_with_their_reason():
    done = asyncio.run(_run_all())
    for name in ("whole", "crlf"):
        whole = done[name]
        assert whole.error is None and whole.text == ("abc" if name == "whole" else "ab"), name
        assert len(whole.token_ids) == 3 and whole.finish_reason in ("length", "stop")
        m = whole.metrics
        assert 0 < m["ttft_s"] < m["e2e_s"] and m["tpot_s"] == pytest.approx(
            (m["e2e_s"] - m["ttft_s"]) / 2
        )
    assert "[DONE]" in done["no_done"].error
    assert "usage" in done["no_usage"].error
    assert "finish_reason" in done["no_finish"].error
    assert done["error"].error == "error event: Generation failed: boom"
    assert done["bad_json"].error.startswith("JSONDecodeError")
    assert done["busy"].error.startswith("status 429") and "queue is full" in done["busy"].error
