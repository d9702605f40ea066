"""The scheduler's metrics reach Ray's Prometheus endpoint."""

import re
import urllib.request

import pytest

from deploy.config import EngineConfig
from deploy.driver import RayEngine
from tests.factories import make_requests, prompt_ids
from tests.waiting import wait_for

pytestmark = pytest.mark.slow


def pdserve_lines(port: int) -> str:
    """The lines of pdserve's metrics in Ray's Prometheus endpoint."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return "\n".join(line for line in text.splitlines() if "pdserve" in line)


def sample_sum(text: str, name: str, worker_id: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'WorkerId="{worker_id}"' in line:
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
    return total


def test_ttft_histogram_counts_every_served_request(ray_session, tiny_checkpoint):
    config = EngineConfig(
        model=tiny_checkpoint,
        mode="disaggregated",
        slots=3,
        max_model_len=128,
        token_budget=16,
        prefill_chunk=8,
    )
    with RayEngine(config) as engine:
        worker_id = ray_session.get(engine.handle.ready.remote())["scheduler_worker_id"]
        requests = make_requests(7, [5, 20, 9], [4, 9, 6])
        # four requests start with the second's 20-token prompt: its one full 16-token block is
        # cached on the prefill worker; their own 30 tokens after it are too many to compute on
        # the decode worker that holds it, so they are prefilled (and hit) there
        for i, r in enumerate(requests[3:]):
            r.prompt_ids = requests[1].prompt_ids + prompt_ids(30, seed=100 + i)
        results = engine.run(requests[:3])
        results |= engine.run(requests[3:])
        prefill_cache = engine.stats()["workers"]["prefill-0"]["kv_cache"]
    assert len(results) == 7
    assert prefill_cache["hit_tokens"] == 4 * 16 and prefill_cache["blocks_cached"] >= 1, (
        prefill_cache
    )

    def finished(text: str) -> float:
        return sum(
            sample_sum(text, "ray_pdserve_requests_finished_total", worker_id, reason=r)
            for r in ("stop", "length")
        )

    def exported(text: str) -> bool:
        return (
            sample_sum(text, "ray_pdserve_ttft_seconds_count", worker_id) >= 7
            and finished(text) >= 7
            and "ray_pdserve_prefix_cache_hit_rate{" in text
        )

    # Ray exports metrics every few seconds, not all in one batch
    text = wait_for(exported, 60, value=lambda: pdserve_lines(ray_session.metrics_port), poll_s=1)
    counts = {
        name: sample_sum(text, f"ray_pdserve_{name}_count", worker_id)
        for name in ("ttft_seconds", "e2e_seconds", "kv_handoff_bytes")
    } | {"finished": finished(text)}
    assert counts == dict.fromkeys(counts, 7), text
    assert sample_sum(text, "ray_pdserve_step_seconds_count", worker_id, kind="decode") > 0
    assert re.search(r"ray_pdserve_slots_in_use\{", text)
    hit_rate = sample_sum(text, "ray_pdserve_prefix_cache_hit_rate", worker_id, worker="prefill-0")
    assert hit_rate == pytest.approx(prefill_cache["hit_rate"])
