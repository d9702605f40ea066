"""`/metrics` without Ray: cells' answers summed into vLLM's names, in a text Prometheus parses;
a cell that goes keeps its counts in the totals."""

from prometheus_client.parser import text_string_to_metric_families

from deploy.serving.prometheus import METRICS, CellTotals, render
from scheduler.cell.serving_metrics import ServingMetrics
from scheduler.outputs import RequestOutput


def cell_answer(
    num_requests,
    running=1,
    waiting=2,
    kv_transfer=None,
    instance="i0",
    restarts=0,
    changes=None,
):
    book = ServingMetrics()
    metrics = {"ttft_s": 0.03, "e2e_s": 0.9, "queue_s": 0.0, "prefill_s": 0.03, "decode_s": 0.8}
    for i in range(num_requests):
        book.on_admit(7, continuation=False)
        book.on_output(RequestOutput(f"r{i}", [1]), now=0.0)
        book.on_output(RequestOutput(f"r{i}", [2], finish_reason="stop", metrics=metrics), now=0.1)
    cache = {"blocks": 10, "blocks_used": 5, "queried_tokens": 32, "hit_tokens": 16}
    stats = {
        "workers": {
            "prefill-0": {"alive": True, "running": running, "waiting": waiting, "kv_cache": cache},
            "decode-0": {"alive": True, "running": 2, "waiting": 0, "kv_cache": cache},
        },
        "counters": {
            "preemptions": 1,
            "handoffs": num_requests,
            "handoff_bytes": 1000,
            "scheduler_restarts": restarts,
        },
    }
    if kv_transfer is not None:
        stats["kv_transfer"] = kv_transfer
    if changes is not None:  # a disaggregated cell's pools, and the planner's decisions
        stats["pools"] = {"prefill": 1, "decode": 1, "changes": changes}
    return {"stats": stats, "serving": book.snapshot(), "instance": instance}


def samples(text):
    """{(name, labels without model_name): value}, parsed by Prometheus' own client."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert s.labels.pop("model_name") == "tiny"
            out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def test_cells_sum_into_vllm_names_and_a_gone_cell_keeps_its_counts():
    totals = CellTotals()
    transfer = {"object_store": {"bytes": 4096, "seconds": 0.5, "failures": 1}}
    text = render(
        totals.update({"a": cell_answer(3, kv_transfer=transfer), "b": cell_answer(2)}), "tiny"
    )
    got = samples(text)
    assert got["vllm:prompt_tokens_total", ()] == 5 * 7
    assert got["vllm:generation_tokens_total", ()] == 10
    assert got["vllm:request_success_total", (("finished_reason", "stop"),)] == 5
    assert got["vllm:time_to_first_token_seconds_count", ()] == 5
    assert got["vllm:time_to_first_token_seconds_bucket", (("le", "0.04"),)] == 5
    assert got["vllm:time_to_first_token_seconds_bucket", (("le", "0.02"),)] == 0
    assert got["vllm:inter_token_latency_seconds_count", ()] == 5
    assert got["vllm:num_requests_running", ()] == 2 * (1 + 2)
    assert got["vllm:num_requests_waiting", ()] == 2 * 2
    assert got["pdserve:num_requests_waiting", (("pool", "prefill"),)] == 4
    assert got["vllm:kv_cache_usage_perc", ()] == 0.5
    assert got["vllm:prefix_cache_queries_total", ()] == 4 * 32
    assert got["vllm:prefix_cache_hits_total", ()] == 4 * 16
    assert got["vllm:num_preemptions_total", ()] == 2
    assert got["pdserve:cells", ()] == 2
    assert got["pdserve:kv_transfer_bytes_total", (("transport", "object_store"),)] == 4096
    assert got["pdserve:kv_transfer_failures_total", (("transport", "object_store"),)] == 1
    # every metric of the list is there, with its type
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    for metric in METRICS:
        base = metric.name.removesuffix("_total")
        assert families.get(base) == metric.kind, metric.name

    # cell b is gone (scaled down) or did not answer: its counters stay, its gauges do not
    got = samples(render(totals.update({"a": cell_answer(4, kv_transfer=transfer)}), "tiny"))
    assert got["vllm:request_success_total", (("finished_reason", "stop"),)] == 4 + 2
    assert got["vllm:e2e_request_latency_seconds_count", ()] == 6
    assert got["vllm:num_requests_running", ()] == 3 and got["pdserve:cells", ()] == 1
    # b answers again, having served one more: counted once
    got = samples(render(totals.update({"a": cell_answer(4), "b": cell_answer(3)}), "tiny"))
    assert got["vllm:request_success_total", (("finished_reason", "stop"),)] == 4 + 3


def test_the_pool_planner_s_decisions_are_counted_by_change_and_pool():
    totals = CellTotals()
    moved = {"start": {"prefill": 2, "decode": 1}, "role_change": {"decode": 1}}
    got = samples(
        render(totals.update({"a": cell_answer(1, changes=moved), "b": cell_answer(1)}), "tiny")
    )
    assert got["pdserve:pool_changes_total", (("change", "start"), ("pool", "prefill"))] == 2
    assert got["pdserve:pool_changes_total", (("change", "role_change"), ("pool", "decode"))] == 1
    # every change of a disaggregated cell shows, at 0 until it happens
    assert got["pdserve:pool_changes_total", (("change", "release"), ("pool", "decode"))] == 0
    assert sum(1 for name, _ in got if name == "pdserve:pool_changes_total") == 6
    # cell a restarted (a new instance counting from zero): its predecessor's count stays
    later = {"release": {"prefill": 1}}
    got = samples(
        render(totals.update({"a": cell_answer(1, changes=later, instance="i1")}), "tiny")
    )
    assert got["pdserve:pool_changes_total", (("change", "start"), ("pool", "prefill"))] == 2
    assert got["pdserve:pool_changes_total", (("change", "release"), ("pool", "prefill"))] == 1


def test_no_cell_yet_still_names_every_unlabelled_metric():
    got = samples(render(CellTotals().update({}), "tiny"))
    assert got["vllm:num_requests_running", ()] == 0 and got["pdserve:cells", ()] == 0


def test_a_restarted_scheduler_adds_to_its_predecessors_counts():
    totals = CellTotals()
    before = samples(render(totals.update({"a": cell_answer(5)}), "tiny"))
    assert before["pdserve:scheduler_restarts_total", ()] == 0
    # Ray restarted a's scheduler: a new instance under the same name, counting from zero
    got = samples(render(totals.update({"a": cell_answer(2, instance="i1", restarts=1)}), "tiny"))
    assert got["vllm:request_success_total", (("finished_reason", "stop"),)] == 5 + 2
    assert got["vllm:prompt_tokens_total", ()] == 7 * 7
    assert got["pdserve:scheduler_restarts_total", ()] == 1  # Ray's count, not one per instance
    assert got["vllm:num_requests_running", ()] == 1 + 2  # gauges: the live instance only
    # the new instance answers again: its counts replace its own last answer, not the old one's
    got = samples(render(totals.update({"a": cell_answer(3, instance="i1", restarts=1)}), "tiny"))
    assert got["vllm:request_success_total", (("finished_reason", "stop"),)] == 5 + 3
    assert got["pdserve:scheduler_restarts_total", ()] == 1


def test_every_finished_reason_shows_at_zero_from_start_up():
    """As vLLM's: rate() over request_success_total sees the first finish of each reason."""
    got = samples(render(CellTotals().update({}), "tiny"))
    reasons = {
        dict(labels)["finished_reason"]: v
        for (name, labels), v in got.items()
        if name == "vllm:request_success_total"
    }
    assert reasons == {"stop": 0, "length": 0, "abort": 0, "error": 0}
    got = samples(render(CellTotals().update({"a": cell_answer(3)}), "tiny"))
    assert got["vllm:request_success_total", (("finished_reason", "stop"),)] == 3
    assert got["vllm:request_success_total", (("finished_reason", "error"),)] == 0


def test_lora_adapters_running_and_waiting_show_in_vllms_info_gauge():
    """One `vllm:lora_requests_info` sample naming the adapters of every cell's running and
    waiting requests (vLLM's labels); none where adapters are not served."""
    a, b = cell_answer(1), cell_answer(1)
    a["stats"]["lora"] = {"max_loras": 2, "running": {"x": 2, "y": 1}, "waiting": {"z": 1}}
    b["stats"]["lora"] = {"max_loras": 2, "running": {"w": 1}, "waiting": {}}
    got = samples(render(CellTotals().update({"a": a, "b": b}), "tiny"))
    (labels,) = [labels for name, labels in got if name == "vllm:lora_requests_info"]
    assert dict(labels) == {
        "max_lora": "2",
        "running_lora_adapters": "w,x,y",
        "waiting_lora_adapters": "z",
    }
    plain = samples(render(CellTotals().update({"a": cell_answer(1)}), "tiny"))
    assert not [name for name, _ in plain if name == "vllm:lora_requests_info"]
