"""Operating the Serve app: /metrics in vLLM's names, /ready, /stats behind the key, deadlines."""

import json
import re
import threading

import httpx
import pytest

from tests.factories import served_app

pytestmark = pytest.mark.slow
KEY = {"Authorization": "Bearer sekret"}
ARGS = dict(
    mode="colocated",
    slots=1,
    max_model_len=1024,
    token_budget=16,
    prefill_chunk=8,
    api_key="sekret",
    max_queue_time_s=1.0,
)


@pytest.fixture(scope="module")
def server(ray_session, tiny_checkpoint):
    with served_app(tiny_checkpoint, "ops", **ARGS) as url:
        yield url


def sample(text, name, **labels):
    """A sample's value in Prometheus' text format (0 when absent)."""
    wanted = {"model_name": "tiny"} | labels
    for line in text.splitlines():
        match = re.fullmatch(r"([^{ ]+)\{(.*)\} (\S+)", line)
        if match and match[1] == name:
            got = dict(re.findall(r'(\w+)="([^"]*)"', match[2]))
            if got == wanted:
                return float(match[3])
    return 0.0


def complete(server, **body):
    return httpx.post(
        f"{server}/v1/completions",
        headers=KEY,
        json={"model": "tiny", "prompt": [5, 6, 7], "temperature": 0} | body,
        timeout=60,
    )


def test_probes_and_the_key_on_stats(server):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    ready = httpx.get(f"{server}/ready")
    assert ready.status_code == 200 and ready.json() == {"status": "ready", "cells": 1}
    assert httpx.get(f"{server}/stats").status_code == 401
    assert httpx.get(f"{server}/stats", headers=KEY).json()["num_cells"] == 1


def test_metrics_count_what_the_clients_received(server):
    before = httpx.get(f"{server}/metrics").text
    got = [complete(server, max_tokens=n, ignore_eos=True).json() for n in (3, 5)]
    assert [g["usage"]["completion_tokens"] for g in got] == [3, 5]
    response = httpx.get(f"{server}/metrics")
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    after = response.text

    def moved(name, **labels):
        return sample(after, name, **labels) - sample(before, name, **labels)

    assert moved("vllm:request_success_total", finished_reason="length") == 2
    assert moved("vllm:prompt_tokens_total") == 6
    assert moved("vllm:generation_tokens_total") == 8
    assert moved("vllm:time_to_first_token_seconds_count") == 2
    assert moved("vllm:e2e_request_latency_seconds_count") == 2
    assert moved("vllm:inter_token_latency_seconds_count") == 2 + 4
    assert moved("vllm:time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert sample(after, "vllm:num_requests_running") == 0
    assert sample(after, "pdserve:cells") == 1
    assert sample(after, "pdserve:workers_alive", pool="decode") == 1


def test_requests_waiting_past_the_queue_deadline_get_503_and_free_their_place(server):
    """One slot and eight long requests at once (each about 0.5 s here): those still waiting
    after --max-queue-time-s (1 s) get 503 with Retry-After, streaming or not; the others run
    whole."""
    before = httpx.get(f"{server}/metrics").text
    answers: list = [None] * 8

    def send(i):
        answers[i] = complete(server, max_tokens=1000, ignore_eos=True, stream=i % 2 == 1)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    refused = [a for a in answers if a.status_code == 503]
    served = [a for a in answers if a.status_code == 200]
    assert len(refused) + len(served) == 8 and refused and served, [a.text for a in answers]
    for answer in refused:
        assert answer.json()["error"]["code"] == "queue_timeout" and answer.headers["Retry-After"]
    for answer in served:
        if not answer.headers["content-type"].startswith("text/event-stream"):
            assert answer.json()["usage"]["completion_tokens"] == 1000
        else:
            assert answer.text.rstrip().endswith("data: [DONE]") and '"error"' not in answer.text
    after = httpx.get(f"{server}/metrics").text
    timeouts = sample(after, "pdserve:request_timeouts_total", deadline="queue") - sample(
        before, "pdserve:request_timeouts_total", deadline="queue"
    )
    assert timeouts == len(refused)
    stats = httpx.get(f"{server}/stats", headers=KEY).json()
    assert sum(w["waiting"] + w["running"] for w in stats["workers"].values()) == 0


def test_a_request_past_its_own_timeout_ends_with_an_error_naming_it(server):
    whole = complete(server, max_tokens=1000, ignore_eos=True, timeout=0.2)
    assert whole.status_code == 504 and whole.json()["error"]["code"] == "timeout"
    assert whole.json()["error"]["param"] == "timeout"
    with httpx.stream(
        "POST",
        f"{server}/v1/completions",
        headers=KEY,
        json={"model": "tiny", "prompt": [5, 6], "max_tokens": 1000, "ignore_eos": True}
        | {"stream": True, "timeout": 0.2},
        timeout=60,
    ) as r:
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2][6:])["error"]
    assert error["code"] == "timeout" and "past its deadline" in error["message"]
    metrics = httpx.get(f"{server}/metrics").text
    assert sample(metrics, "pdserve:request_timeouts_total", deadline="request") == 2
