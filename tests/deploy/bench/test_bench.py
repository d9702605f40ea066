"""`pdserve bench` end to end on a tiny model: the sweeps, the JSON lines and the figure; its
inputs."""

import json

import pytest

from deploy.bench.plot import plot_bench
from deploy.bench.workload import load_workload, make_workload, poisson_arrivals
from deploy.cli import main
from scheduler.outputs import Completion
from tests.factories import tiny_tokenizer

SUMMARY_FIELDS = [
    f"{m}_ms_{s}" for m in ("ttft", "tpot", "itl", "e2e") for s in ("mean", "p50", "p90", "p99")
] + [
    "output_tok_s",
    "requests_per_s",
    "goodput_req_s",
    "queue_ms_mean",
    "prefill_ms_mean",
    "decode_ms_mean",
]


def test_bench_sweeps_write_json_and_png(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "bench" / "results.jsonl"
    rc = main(
        [
            "bench",
            "--model",
            tiny_checkpoint,
            "--num-requests",
            "6",
            "--prompt-len",
            "4:24",
            "--output-len",
            "2:10",
            "--sweep-slots",
            "1,4",
            "--sweep-token-budget",
            "16,64",
            "--rate",
            "0,200",
            "--prefill-chunk",
            "16",
            "--serial-requests",
            "2",
            "--slo-ttft-ms",
            "1e9",
            "--slo-tpot-ms",
            "1e-6",
            "--output",
            str(out),
            "--quiet",
        ]
    )
    assert rc == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    summaries = [line for line in lines if "rid" not in line]
    per_request = [line for line in lines if "rid" in line]
    runs = {(s["slots"], s["token_budget"], s["rate"]) for s in summaries}
    assert runs == {(s, b, r) for s in (1, 4) for b in (16, 64) for r in (0.0, 200.0)}
    assert len(per_request) == 6 * len(summaries)
    asked = make_workload(6, "4:24", "2:10", 384, seed=0).output_lens
    for summary in summaries:
        assert all(isinstance(summary[k], float) for k in SUMMARY_FIELDS), summary
        assert (
            summary["ttft_ms_p50"] <= summary["ttft_ms_p99"]
            and summary["itl_ms_p50"] <= summary["itl_ms_p99"]
        )
        assert (
            summary["serial_tok_s"] > 0 and summary["static_tok_s"] > 0 and summary["x_static"] > 0
        )
        assert summary["goodput_req_s"] == 0.0  # nothing meets a 1e-6 ms TPOT
        assert summary["prefill_chunk"] == min(16, summary["token_budget"])
        mine = [
            r
            for r in per_request
            if (r["slots"], r["token_budget"], r["rate"])
            == (summary["slots"], summary["token_budget"], summary["rate"])
        ]
        assert [r["tokens"] for r in sorted(mine, key=lambda r: int(r["rid"]))] == asked
    png = out.with_suffix(".png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    # the figure plots these runs' own figures: tok/s per slots series, the static baseline, three
    # panels
    drawn = plot_bench(summaries, str(tmp_path / "check.png"))
    slots_panel, budget_panel, rate_panel = drawn.values()
    tok_s = {label: ys for label, ys in slots_panel.items() if label.startswith("tok/s")}
    assert all(len(ys) == 2 for ys in tok_s.values())  # slots 1 and 4 in each series
    assert sorted(y for ys in tok_s.values() for y in ys) == sorted(
        s["output_tok_s"] for s in summaries if s["rate"] == 0
    )
    static = next(ys for label, ys in slots_panel.items() if label.startswith("static generate"))
    assert static[0] == summaries[0]["static_tok_s"]
    ttft = sorted(
        y for label, ys in budget_panel.items() if "p99" in label and "TTFT" in label for y in ys
    )
    assert ttft == sorted(s["ttft_ms_p99"] for s in summaries if s["rate"] > 0)
    assert rate_panel  # several rates ran
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [p["slots"] for p in printed] == [s["slots"] for s in summaries]
    # the figure again from the file, and a clear error for a file with no summaries
    assert main(["bench-plot", str(out), "--plot", str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "empty.jsonl").write_text('{"rid": "0"}\n')
    assert (
        main(["bench-plot", str(tmp_path / "empty.jsonl"), "--plot", str(tmp_path / "x.png")]) == 2
    )
    assert "no bench summary lines" in capsys.readouterr().err


def test_repeated_rounds_alternate_the_order_and_end_with_medians(
    tiny_checkpoint, tmp_path, capsys
):
    out = tmp_path / "repeat.jsonl"
    assert (
        main(
            [
                "bench",
                "--model",
                tiny_checkpoint,
                "--num-requests",
                "4",
                "--prompt-len",
                "4:12",
                "--output-len",
                "2:6",
                "--sweep-slots",
                "1,2",
                "--repeat",
                "3",
                "--baselines",
                "none",
                "--output",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    summaries = [line for line in lines if "rid" not in line]
    assert [(s["round"], s["slots"]) for s in summaries] == [
        (0, 1),
        (0, 2),
        (1, 2),
        (1, 1),
        (2, 1),
        (2, 2),
    ]
    assert all(line["round"] in (0, 1, 2) for line in lines if "rid" in line)
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    repeats = [p for p in printed if "repeat" in p]
    assert [(r["repeat"], r["slots"], r["rounds"]) for r in repeats] == [
        ("local", 1, 3),
        ("local", 2, 3),
    ]
    for r in repeats:
        mine = sorted(s["output_tok_s"] for s in summaries if s["slots"] == r["slots"])
        assert r["output_tok_s"] == {
            "median": round(mine[1], 3),
            "min": round(mine[0], 3),
            "max": round(mine[2], 3),
        }


def test_bench_rejects_bad_input_before_running(tiny_checkpoint, tmp_path, capsys):
    for extra in (
        ["--rate", "1,x"],
        ["--sweep-slots", "0"],
        ["--modes", "remote"],
        ["--url", "http://127.0.0.1:9/v1", "--sweep-slots", "2"],
        ["--prompt-len", "9:3"],
        ["--max-model-len", "64", "--prompt-len", "60", "--output-len", "8"],
        ["--repeat", "0"],
    ):
        assert (
            main(["bench", "--model", tiny_checkpoint, "--baselines", "none", "--quiet", *extra])
            == 2
        ), extra
        assert "pdserve bench: error:" in capsys.readouterr().err
    assert main(["bench", "--url", "http://127.0.0.1:9/v1", "--ready-timeout", "0", "--quiet"]) == 2
    assert "/health is not ready after" in capsys.readouterr().err  # nothing listens there


def test_poisson_arrivals_are_reproducible_at_the_asked_rate():
    arrivals = poisson_arrivals(4000, rate=5.0, seed=3)
    assert (
        arrivals
        == poisson_arrivals(4000, rate=5.0, seed=3)
        != poisson_arrivals(4000, rate=5.0, seed=4)
    )
    assert arrivals[0] == 0.0 and all(b >= a for a, b in zip(arrivals, arrivals[1:], strict=False))
    assert 4.7 < len(arrivals) / arrivals[-1] < 5.3
    assert poisson_arrivals(3, rate=0.0, seed=0) == [0.0, 0.0, 0.0]
    # prompts and output lengths do not depend on the rate
    assert (
        make_workload(5, "3:9", "2:4", 384, seed=1).prompts
        == make_workload(5, "3:9", "2:4", 384, 1, 2.0).prompts
    )


def test_prompts_file_workload(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(
        '{"prompt": "hello world", "max_tokens": 7}\n\n{"prompt_token_ids": [5, 6, 7]}\n'
        '{"messages": [{"role": "user", "content": "hi"}]}\n'
    )
    work = load_workload(str(path), tiny_tokenizer(), 0, "3", seed=0)
    assert work.output_lens == [7, 3, 3] and work.prompts[1] == [5, 6, 7]
    assert work.prompts[0] == tiny_tokenizer().encode("hello world")
    assert len(load_workload(str(path), tiny_tokenizer(), 2, "3", seed=0).prompts) == 2
    path.write_text('{"prompt": "ok"}\n{"prompt_token_ids": [99999]}\n')
    with pytest.raises(ValueError, match=r"prompts.jsonl:2"):
        load_workload(str(path), tiny_tokenizer(), 0, "3", seed=0)


def test_inter_token_gaps():
    done = Completion("x", 3, token_ids=[1, 2, 3, 4], token_times_s=[1.0, 1.5, 1.5, 2.25])
    assert done.inter_token_s() == [0.5, 0.75]  # tokens 2 and 3 came in one output: one arrival
    assert Completion("y", 3, token_ids=[1], token_times_s=[1.0]).inter_token_s() == []


def test_wait_ready_waits_through_a_starting_service():
    """A service that answers 503 while it starts is waited for; one that stays down fails with its
    last answer."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from deploy.bench.http_client import EndpointError, wait_ready

    answers = [503, 503, 200]

    class Health(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(answers.pop(0) if len(answers) > 1 else answers[0])
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1"
        wait_ready(url, timeout_s=30)
        assert answers == [200]  # it asked until the service was up
        answers[:] = [503]
        with pytest.raises(EndpointError, match="status 503"):
            wait_ready(url, timeout_s=1.5)
    finally:
        server.shutdown()


def test_a_sequential_url_run_sends_one_request_at_a_time(monkeypatch):
    """`--sequential` against an endpoint is the low-load case there too: each request waits for the
    last."""
    import asyncio

    from deploy.bench import http_client

    in_flight, most = 0, 0

    async def fake_stream(http, url, body, rid, prompt_tokens=0):
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return Completion(rid, prompt_tokens, finish_reason="length")

    monkeypatch.setattr(http_client, "stream_request", fake_stream)
    args = ("http://127.0.0.1:9/v1", "tiny", [[5, 6]] * 4, [3] * 4, [0.0] * 4, [1] * 4)
    done, elapsed = http_client.run_http(*args, sequential=True)
    # four 10 ms requests in turn
    assert sorted(done) == ["0", "1", "2", "3"] and most == 1 and elapsed >= 0.04
    most = 0
    assert len(http_client.run_http(*args)[0]) == 4 and most == 4
