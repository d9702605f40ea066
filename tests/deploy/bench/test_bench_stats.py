"""Percentiles and goodput on synthetic timings with known answers."""

import pytest

from deploy.bench.stats import goodput, percentile, summarize


def test_percentiles_interpolate_between_ranks():
    values = [5.0, 1.0, 4.0, 2.0, 3.0]  # order does not matter
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 50) == 3.0
    assert percentile(values, 90) == pytest.approx(4.6)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([], 50) == 0.0
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_summary_has_mean_and_tail():
    s = summarize("ttft_ms", [10.0] * 99 + [1000.0])
    assert s["ttft_ms_mean"] == pytest.approx(19.9)
    assert s["ttft_ms_p50"] == 10.0 and s["ttft_ms_p99"] == pytest.approx(19.9)


def test_goodput_counts_requests_meeting_every_slo():
    ttft = [0.1, 0.2, 0.5, 1.0]
    tpot = [0.01, 0.05, 0.01, 0.01]
    assert goodput(ttft, tpot, duration_s=2.0) == 2.0  # no SLO: all 4 in 2 s
    assert goodput(ttft, tpot, 2.0, slo_ttft_ms=500) == 1.5  # 3 meet TTFT
    assert goodput(ttft, tpot, 2.0, slo_ttft_ms=500, slo_tpot_ms=20) == 1.0  # 2 meet both
    assert goodput(ttft, tpot, 2.0, slo_tpot_ms=5) == 0.0


def test_a_chats_later_turns_report_their_ttft_and_the_tokens_they_computed_beyond_new_ones():
    from deploy.bench.stats import later_turns
    from deploy.bench.workload import chat_workload, next_turns
    from scheduler.outputs import Completion

    work = chat_workload(1, 3, "20", "8", 384, seed=0).copy_prompts()
    next_turn = next_turns(work)
    done = {}
    # turn 2 found turn 1's prompt and reply cached but its last token (whole blocks: 16 of 28);
    # turn 3 found nothing
    for i, cached in enumerate((0, 16, 0)):
        c = Completion(str(i), len(work.prompts[i]), token_ids=[7] * 8)
        c.metrics = {"ttft_s": 0.1 * (i + 1), "cached_tokens": cached}
        done[str(i)] = c
        next_turn(c)
    out = later_turns(work, done, list(done.values()))
    assert out["later_turn_ttft_ms_p50"] == pytest.approx(250.0)
    # turn 2: 48 tokens, 16 cached, 21 new (its message and the reply's last token): 11 more;
    # turn 3: 76 tokens, none cached, 21 new: 55 more
    assert out["later_turn_extra_computed_max"] == 55
    assert out["later_turn_extra_computed_mean"] == pytest.approx((11 + 55) / 2)


def test_spread_loras_cycles_the_served_model_and_each_adapter_and_a_chat_keeps_its_own():
    from deploy.bench.workload import chat_workload, engine_requests, make_workload, spread_models
    from scheduler.request import LoraRef

    loras = {"a": LoraRef("a", "/a"), "b": LoraRef("b", "/b")}
    work = spread_models(make_workload(7, "8", "4", 100, seed=0), ["a", "b"])
    assert work.models == (None, "a", "b", None, "a", "b", None)
    requests = engine_requests(work, False, loras)
    assert [r.lora for r in requests[:3]] == [None, loras["a"], loras["b"]]
    chat = spread_models(chat_workload(3, 2, "20", "8", 384, seed=0), ["a", "b"])
    for i, before in enumerate(chat.after):  # a later turn asks for its conversation's model
        if before is not None:
            assert chat.models[i] == chat.models[before]
    assert set(chat.models) == {None, "a", "b"}
