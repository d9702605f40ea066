"""The bench's scenario workloads (shared prefixes, chat replays, interference) and their
reports."""

import json

import pytest

from deploy.bench.workload import (
    chat_workload,
    interference_workload,
    next_turns,
    shared_prefix_workload,
)
from deploy.cli import main
from scheduler.outputs import Completion
from tests.factories import served_app


def test_shared_prefix_and_chat_workloads_share_what_they_say():
    work = shared_prefix_workload(20, 3, 50, "5:9", "4", 384, seed=1)
    prefixes = {tuple(p[:50]) for p in work.prompts}
    assert len(prefixes) == 3 and all(55 <= len(p) <= 59 for p in work.prompts)
    chat = chat_workload(2, 3, "6", "5", 384, seed=1).copy_prompts()
    assert len(chat.prompts) == 6
    # each turn holds the turn before it, a 5-token reply, then a new 6-token message; it is sent
    # when that turn ends
    for i in range(2, 6):
        before = chat.prompts[i - 2]
        assert (
            chat.prompts[i][: len(before)] == before and len(chat.prompts[i]) == len(before) + 5 + 6
        )
    assert chat.conversation and chat.after == (None, None, 0, 1, 2, 3)
    # when a turn ends, the next turn's prompt is rewritten with the reply the model gave
    message = chat.prompts[2][-6:]
    next_turn = next_turns(chat)
    next_turn(Completion("0", 6, token_ids=[1, 2, 3]))  # a reply shorter than the stand-in
    assert chat.prompts[2] == chat.prompts[0] + [1, 2, 3] + message
    next_turn(Completion("2", len(chat.prompts[2]), token_ids=[7] * 5))
    assert chat.prompts[4] == chat.prompts[2] + [7] * 5 + chat.prompts[4][-6:]
    assert len(chat.prompts[4]) == 6 + 3 + 6 + 5 + 6


def test_interference_arrivals_start_the_streams_then_the_long_prompts():
    work = interference_workload(
        3, "8", "40", 4, "100:120", "2", 384, seed=0, long_start_s=2.0
    ).at_rate(5.0, 0)
    assert work.steady == (True,) * 3 + (False,) * 4
    assert work.arrival_s[:3] == [0.0] * 3 and work.arrival_s[3] == 2.0
    assert sorted(work.arrival_s[3:]) == work.arrival_s[3:]
    assert all(100 <= len(p) <= 120 for p in work.prompts[3:]) and work.output_lens[:3] == [40] * 3
    assert work.after == (None,) * 7  # one generation: no chains
    population = interference_workload(
        3, "8", "30:50", 2, "100", "2", 384, seed=0, long_start_s=1.0, generations=3
    ).at_rate(5.0, 0)
    # streams 0-2 start at once, 3-5 each after one of them, 6-8 after those; the long prompts are 9
    # and 10
    assert population.after == (None, None, None, 0, 1, 2, 3, 4, 5, None, None)
    assert population.steady == (True,) * 9 + (False,) * 2 and population.arrival_s[9] == 1.0
    assert (
        len(set(map(tuple, population.prompts[:9]))) == 9
        and len(set(population.output_lens[:9])) > 1
    )
    with pytest.raises(ValueError, match="generations"):
        interference_workload(
            3, "8", "40", 1, "100", "2", 384, seed=0, long_start_s=1.0, generations=0
        )


@pytest.mark.slow
def test_interference_and_prefix_reports(ray_session, tiny_checkpoint, tmp_path):
    """Both modes side by side at equal workers: the steady streams' ITL, the long prompts' TTFT,
    the handoff gap and the P:D ratio; the figure of ITL over time; and the prefix cache compared on
    and off. The steady streams are a population: each replaced when it ends while the long prompts
    last."""
    out = tmp_path / "intf.jsonl"
    rc = main(
        [
            "bench",
            "--model",
            tiny_checkpoint,
            "--workload",
            "interference",
            "--steady",
            "3",
            "--steady-output-len",
            "60:100",
            "--steady-generations",
            "200",
            "--num-requests",
            "3",
            "--prompt-len",
            "200:300",
            "--output-len",
            "3",
            "--rate",
            "2",
            "--long-start-s",
            "0.02",
            "--modes",
            "colocated,disaggregated",
            "--colocated-workers",
            "2",
            "--baselines",
            "none",
            "--max-model-len",
            "512",
            "--slots",
            "4",
            "--output",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    lines = list(map(json.loads, out.read_text().splitlines()))
    summaries = {s["mode"]: s for s in lines if "rid" not in s}
    assert (
        summaries["colocated"]["decode_workers"] == 2
        and summaries["disaggregated"]["prefill_workers"] == 1
    )
    # the threads the workers ran with (one per CPU of their actors), not the driver's
    assert all(s["torch_threads"] == 1 for s in summaries.values())
    for s in summaries.values():
        assert 0 < s["steady_itl_ms_p50"] <= s["steady_itl_ms_p99"] and s["long_ttft_ms_p50"] > 0
        assert 0 < s["steady_itl_during_ms_p50"] <= s["steady_itl_during_ms_p99"]
        # more streams than the 3 at the start ran, and the last generations did not (the long
        # prompts ended)
        ran = {
            int(line["rid"]) for line in lines if line.get("mode") == s["mode"] and "rid" in line
        }
        # (200 generations of 60-100 tokens outlast the long prompts' second of arrivals on any
        # machine)
        assert (
            3 < s["steady_streams"] < 600 and {600, 601, 602} <= ran and s["failed_requests"] == 0
        )
    split = summaries["disaggregated"]
    assert split["handoff_gap_ms_p50"] > 0 and split["prefill_workers_per_decode_worker"] > 0
    assert 0 < split["long_handoff_gap_ms_p50"] <= split["long_handoff_gap_ms_p99"]
    assert "long_handoff_gap_ms_p50" not in summaries["colocated"]  # nothing is handed off there
    assert (tmp_path / "intf-interference.png").stat().st_size > 10_000
    out = tmp_path / "prefix.jsonl"
    assert (
        main(
            [
                "bench",
                "--model",
                tiny_checkpoint,
                "--workload",
                "shared-prefix",
                "--groups",
                "2",
                "--prefix-len",
                "64",
                "--prompt-len",
                "4",
                "--output-len",
                "3",
                "--num-requests",
                "8",
                "--compare-prefix-cache",
                "--baselines",
                "none",
                "--max-model-len",
                "256",
                "--slots",
                "2",
                "--output",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    runs = {
        s["prefix_cache"]: s
        for s in map(json.loads, out.read_text().splitlines())
        if "rid" not in s
    }
    assert "prefix_hit_rate" not in runs[False] and runs[True]["prefix_hit_rate"] > 0.5


def test_the_shifting_workload_moves_from_prompts_to_outputs_and_back():
    from deploy.bench.workload import shifting_workload

    work = shifting_workload(30, "16:512", "16:256", 384, seed=3).at_rate(5.0, seed=3)
    thirds = [range(0, 10), range(10, 20), range(20, 30)]
    prompts = [[len(work.prompts[i]) for i in part] for part in thirds]
    outputs = [[work.output_lens[i] for i in part] for part in thirds]
    assert min(prompts[0] + prompts[2]) >= 264 >= max(prompts[1])
    assert max(outputs[0] + outputs[2]) <= 136 <= min(outputs[1])
    assert work.arrival_s == sorted(work.arrival_s) and work.arrival_s[-1] > 0


@pytest.mark.slow
def test_a_chats_later_turns_compute_only_their_new_tokens_through_the_serve_app(
    ray_session, tiny_checkpoint, tmp_path
):
    """The chat workload through the default deployment's shape (disaggregated, one prefill and
    one decode worker) over HTTP: each later turn is sent with the model's reply (asked for with
    `return_token_ids`) and finds the conversation before it cached, computing at most a block
    more than its new message."""
    out = tmp_path / "chat.jsonl"
    args = dict(mode="disaggregated", slots=4, max_model_len=512, token_budget=64, prefill_chunk=32)
    with served_app(tiny_checkpoint, "chat", **args) as url:
        rc = main(
            ["bench", "--url", f"{url}/v1", "--model", tiny_checkpoint, "--workload", "chat"]
            + ["--groups", "3", "--turns", "3", "--prompt-len", "30:40", "--output-len", "20:40"]
            + ["--baselines", "none", "--output", str(out), "--quiet"]
        )
    assert rc == 0
    (summary,) = [s for s in map(json.loads, out.read_text().splitlines()) if "rid" not in s]
    assert summary["failed_requests"] == 0 and summary["requests"] == 9
    assert 0 <= summary["later_turn_extra_computed_max"] < 16  # the block size
