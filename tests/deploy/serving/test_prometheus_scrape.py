"""A real Prometheus server scrapes the running Serve app: every metric of /metrics is there, the
counters and histograms moved by what the clients received, and every expression of the Grafana
dashboard (deploy/grafana/pdserve.json) names only metrics that exist and evaluates."""

import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import httpx
import pytest
import ray

from deploy.serving.cell_actors import NAMESPACE, WORKER_NAMESPACE, cell_name, named_actors
from deploy.serving.prometheus import METRICS, OPTIONAL
from tests.factories import free_port, served_app
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
APP = "scraped"
ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve.json"
ARGS = dict(
    mode="disaggregated",
    slots=2,
    prefill_slots=2,
    max_model_len=1024,
    token_budget=32,
    prefill_chunk=16,
)


def prometheus_binary() -> str:
    """`make test` unpacks Debian's prometheus into .venv (Makefile); PROMETHEUS or PATH also
    work."""
    for candidate in (os.environ.get("PROMETHEUS"), ROOT / ".venv" / "prometheus" / "prometheus"):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    found = shutil.which("prometheus")
    if found is None:
        pytest.skip("no prometheus binary: `make prometheus` unpacks Debian's into .venv")
    return found


# each test its own app and Prometheus: the counts one test asserts are only its own requests'
@pytest.fixture
def app(ray_session, tiny_checkpoint):
    with served_app(tiny_checkpoint, APP, **ARGS) as url:
        yield url


@pytest.fixture
def prometheus(app, tmp_path_factory):
    """A Prometheus scraping the app's /metrics every second; its HTTP API's base URL."""
    work = tmp_path_factory.mktemp("prometheus")
    target = app.removeprefix("http://")
    (work / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        "scrape_configs:\n"
        "  - job_name: pdserve\n"
        f"    static_configs: [{{targets: ['{target}']}}]\n"
    )
    port = free_port()
    log = open(work / "prometheus.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            prometheus_binary(),
            f"--config.file={work / 'prometheus.yml'}",
            f"--storage.tsdb.path={work / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"

    def log_tail() -> str:
        return (work / "prometheus.log").read_text()[-2000:]

    try:
        wait_for(lambda: answers(f"{base}/-/ready"), 60, poll_s=0.5, context=log_tail)
        wait_for(
            lambda up: up == 1,
            60,
            value=lambda: value(base, 'up{job="pdserve"}'),
            what="Prometheus to scrape the app",
            poll_s=0.5,
            context=log_tail,
        )
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def answers(url: str) -> bool:
    """200 from a server that may not listen yet."""
    try:
        return httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def query(base: str, expr: str) -> list:
    answer = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert answer["status"] == "success", (expr, answer)
    return answer["data"]["result"]


def value(base: str, expr: str) -> float:
    """The sum of an instant query's series (0 when it has none)."""
    try:
        return sum(float(series["value"][1]) for series in query(base, expr))
    except httpx.HTTPError:
        return 0.0


def decode_load(app: str) -> int:
    """Requests on the decode worker: running, or handed off and waiting for a slot."""
    worker = httpx.get(f"{app}/stats", timeout=10).json()["workers"]["decode-0"]
    return worker["running"] + worker["waiting"]


def complete(app: str, prompt: list[int], max_tokens: int, **extra) -> httpx.Response:
    return httpx.post(
        f"{app}/v1/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        | {"temperature": 0}
        | extra,
        timeout=120,
    )


def test_prometheus_reads_every_metric_and_the_counts_clients_saw(app, prometheus):
    # 1. requests whose tokens are known; the 40-token prompt twice (its 2 full blocks before its
    # last token are cached)
    shared = list(range(5, 45))
    plan = [([5, 6, 7], 8), (shared, 12), (list(range(50, 70)), 5), (shared, 6)]
    for prompt, max_tokens in plan:
        assert complete(app, prompt, max_tokens).json()["usage"]["completion_tokens"] == max_tokens
    # 2. load that lasts: ten long requests of low priority on two decode slots (eight wait for
    # seconds), then two urgent ones, which preempt them
    pending = send_all(app, [([9, i + 1], 1000, {"priority": 1}) for i in range(10)])
    wait_for(
        lambda stats: stats["workers"]["decode-0"]["running"] == 2,
        60,
        value=lambda: httpx.get(f"{app}/stats", timeout=10).json(),
        what="the two decode slots taken",
    )
    pending += send_all(app, [([8, i], 20, {}) for i in range(2)])
    answers = [answer() for answer in pending]
    assert sorted(a.json()["usage"]["completion_tokens"] for a in answers) == [20] * 2 + [1000] * 10
    num_requests = len(plan) + len(answers)
    prompt_tokens = sum(len(p) for p, _ in plan) + 12 * 2
    generated = sum(n for _, n in plan) + 10 * 1000 + 2 * 20

    def got(name: str, **labels: str) -> float:
        selector = ",".join(f'{k}="{v}"' for k, v in ({"model_name": "tiny"} | labels).items())
        return value(prometheus, f"{name}{{{selector}}}")

    # Prometheus has scraped the last counts (a scrape reads every counter of one answer)
    wait_for(
        lambda n: n == 16,
        60,
        value=lambda: got("vllm:request_success_total", finished_reason="length"),
        poll_s=0.5,
    )
    stats = httpx.get(f"{app}/stats").json()
    assert num_requests == 16
    assert got("vllm:prompt_tokens_total") == prompt_tokens
    assert got("vllm:generation_tokens_total") == generated
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert got(f"vllm:{histogram}_seconds_count") == num_requests, histogram
        assert got(f"vllm:{histogram}_seconds_bucket", le="+Inf") == num_requests, histogram
    for histogram in ("request_prefill_time", "request_decode_time"):
        assert got(f"vllm:{histogram}_seconds_count") == num_requests, histogram
    # one interval between each two successive tokens of a request
    assert got("vllm:inter_token_latency_seconds_count") == generated - num_requests
    # what the cells count themselves, as Prometheus read it
    counters = stats["counters"]
    assert got("vllm:num_preemptions_total") == counters["preemptions"] >= 1
    assert got("pdserve:kv_handoffs_total") == counters["handoffs"] >= len(plan) - 1
    assert got("pdserve:kv_handoff_bytes_total") == counters["handoff_bytes"] > 0
    assert got("pdserve:kv_handoff_seconds_total") > 0
    transfers = stats["kv_transfer"]  # per transport, as the cells count it
    assert transfers and sum(line["bytes"] for line in transfers.values()) > 0, transfers
    for transport, line in transfers.items():
        for field in ("bytes", "seconds", "failures"):
            name = f"pdserve:kv_transfer_{field}_total"
            assert got(name, transport=transport) == pytest.approx(line[field]), name
    caches = [w["kv_cache"] for w in stats["workers"].values()]
    assert got("vllm:prefix_cache_hits_total") == sum(c["hit_tokens"] for c in caches) >= 32
    assert got("vllm:prefix_cache_queries_total") == sum(c["queried_tokens"] for c in caches)

    # the gauges moved under load (eight requests waited on the decode worker for seconds) and
    # are back at rest
    def peak(expr: str) -> float:
        return value(prometheus, f"max_over_time({expr}[5m])")

    assert peak("vllm:num_requests_running") >= 2 and peak("vllm:num_requests_waiting") >= 2
    assert peak('pdserve:num_requests_running{pool="decode"}') >= 2
    assert peak('pdserve:num_requests_waiting{pool="decode"}') >= 2
    assert peak("vllm:kv_cache_usage_perc") > 0
    assert peak('pdserve:kv_cache_usage_perc{pool="decode"}') > 0
    assert got("vllm:num_requests_running") == 0 and got("vllm:num_requests_waiting") == 0
    assert got("pdserve:cells") == 1 and got("pdserve:workers_alive", pool="prefill") == 1

    # 3. a request past its own timeout (the tokens it made are counted, whoever saw them)
    timed_out = complete(app, [7, 7], 1000, timeout=0.05)
    assert timed_out.status_code == 504 and timed_out.json()["error"]["code"] == "timeout"
    wait_for(
        lambda n: n == 1,
        30,
        value=lambda: got("pdserve:request_timeouts_total", deadline="request"),
        poll_s=0.5,
    )
    assert got("vllm:request_success_total", finished_reason="error") == 1

    # 4. faults under load: the scheduler, then the decode worker, killed mid-stream (Ray restarts
    # both); every request still gets all its tokens
    scheduler_name = named_actors(NAMESPACE, cell_name(APP, ""))[0]
    before = got("vllm:generation_tokens_total")
    for victim in ("scheduler", "decode-0"):
        pending = send_all(app, [([4, i], 1000, {}) for i in range(3)])
        # every request has its first token: handed off to the decode worker
        wait_for(lambda n: n == 3, 60, value=lambda: decode_load(app))
        if victim == "scheduler":
            ray.kill(ray.get_actor(scheduler_name, NAMESPACE), no_restart=False)
        else:
            ray.kill(
                ray.get_actor(f"{scheduler_name}/{victim}", WORKER_NAMESPACE), no_restart=False
            )
        tokens = [answer().json()["usage"]["completion_tokens"] for answer in pending]
        assert tokens == [1000] * 3, victim
    wait_for(lambda n: n >= 1, 60, value=lambda: got("pdserve:worker_failures_total"), poll_s=0.5)
    assert got("pdserve:scheduler_restarts_total") >= 1
    assert got("pdserve:failovers_total") >= 1  # streams continued on the restarted scheduler
    assert got("pdserve:recomputes_total") >= 1  # requests recomputed after the lost worker
    # the restarted scheduler counts afresh; the totals keep its predecessor's counts
    assert got("vllm:generation_tokens_total") > before
    for counter in ("vllm:generation_tokens_total", "vllm:request_success_total"):
        assert value(prometheus, f"resets({counter}[10m])") == 0, counter
    # every metric of the list is there, with the model's name (but those of features left off)
    names = {s["metric"]["__name__"] for s in query(prometheus, '{model_name="tiny"}')}
    for metric in (m for m in METRICS if m.name not in OPTIONAL):
        wanted = metric.name + ("_count" if metric.kind == "histogram" else "")
        assert wanted in names, metric.name


def send_all(app: str, requests: list[tuple[list[int], int, dict]]) -> list:
    """Send each (prompt, max_tokens, extra fields) from its own thread; returns one function per
    request that waits for its answer."""
    answers: dict[int, httpx.Response] = {}

    def send(i: int, prompt: list[int], max_tokens: int, extra: dict) -> None:
        answers[i] = complete(app, prompt, max_tokens, **extra)

    threads = [threading.Thread(target=send, args=(i, *r)) for i, r in enumerate(requests)]
    for thread in threads:
        thread.start()

    def waiter(i: int):
        def answer() -> httpx.Response:
            threads[i].join(timeout=180)
            return answers[i]

        return answer

    return [waiter(i) for i in range(len(requests))]


def dashboard_expressions() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p["targets"]]


def test_the_dashboard_uses_only_metrics_that_exist_and_every_expression_evaluates(app, prometheus):
    # traffic for the panels to show (streams of several tokens: inter-token latency too)
    for i in range(3):
        assert complete(app, [5, 6, i], 8).status_code == 200
    wait_for(
        lambda n: n == 3,
        60,
        value=lambda: value(prometheus, 'vllm:request_success_total{model_name="tiny"}'),
        poll_s=0.5,
    )
    text = httpx.get(f"{app}/metrics").text
    # every sample's name, and every metric's (a labelled one may have no sample yet)
    exported = set(re.findall(r"^([a-z0-9_:]+)\{", text, re.M))
    exported |= set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    core = {"Time To First Token Latency", "Inter Token Latency", "Scheduler State"}
    core |= {"Cache Utilization", "Token Throughput", "E2E Request Latency"}
    seen_core = set()
    for title, expr in dashboard_expressions():
        for name in re.findall(r"\b((?:vllm|pdserve):[a-z0-9_]+)", expr):
            assert name in exported, (title, name)
        promql = expr.replace("$model_name", "tiny").replace("$__rate_interval", "5m")
        result = query(prometheus, promql)  # raises unless Prometheus evaluates it
        if title in core and result:
            seen_core.add(title)
    assert seen_core == core  # vLLM's core panels show data for pdserve, unchanged
