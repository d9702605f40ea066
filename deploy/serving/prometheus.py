"""`GET /metrics`: every cell's counts summed into vLLM's metric names, in Prometheus' text format.

Each cell's scheduler answers `metrics()` with its stats and its `ServingMetrics` snapshot; the
ingress replica that gets the scrape asks every live cell and sums them: counters and histograms
add up, gauges of requests add up, KV cache usage is blocks in use over all blocks. A cell's
counters outlive it: when a cell is no longer listed (scaled down, or dead and replaced), its
last counts stay in the totals (`CellTotals`), so a counter never goes back because a cell went;
likewise a scheduler that Ray restarted (a new instance under the same name) adds to its
predecessor's last counts.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from scheduler.cell.pools import POOL_CHANGES
from scheduler.request import OPENAI_FINISH_REASON

# (name, labels as sorted pairs): one sample
Key = tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True)
class Metric:
    name: str  # as exported (a counter's with its _total)
    kind: str  # counter, gauge or histogram
    help: str


METRICS: tuple[Metric, ...] = (
    Metric("vllm:num_requests_running", "gauge", "Requests in a worker's batch, every worker."),
    Metric("vllm:num_requests_waiting", "gauge", "Requests waiting for a worker's slot."),
    Metric("vllm:kv_cache_usage_perc", "gauge", "KV blocks in use over all blocks (1 = full)."),
    Metric("vllm:prefix_cache_queries_total", "counter", "Prompt tokens looked up in the cache."),
    Metric("vllm:prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache."),
    Metric("vllm:prompt_tokens_total", "counter", "Prompt tokens of admitted requests."),
    Metric("vllm:generation_tokens_total", "counter", "Tokens generated."),
    Metric("vllm:num_preemptions_total", "counter", "Requests preempted for more urgent ones."),
    Metric("vllm:spec_decode_num_drafts_total", "counter", "Decode chunks that carried drafts."),
    Metric("vllm:spec_decode_num_draft_tokens_total", "counter", "Draft tokens verified."),
    Metric("vllm:spec_decode_num_accepted_tokens_total", "counter", "Draft tokens accepted."),
    Metric(
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "counter",
        "Draft tokens accepted, by position in their draft.",
    ),
    Metric("vllm:request_success_total", "counter", "Finished requests by finished_reason."),
    Metric("vllm:time_to_first_token_seconds", "histogram", "Time to first token."),
    Metric("vllm:inter_token_latency_seconds", "histogram", "Time between successive tokens."),
    Metric("vllm:e2e_request_latency_seconds", "histogram", "Arrival to finish."),
    Metric("vllm:request_queue_time_seconds", "histogram", "Arrival to first slot (WAITING)."),
    Metric("vllm:request_prefill_time_seconds", "histogram", "First slot to first token."),
    Metric("vllm:request_decode_time_seconds", "histogram", "First token to finish."),
    Metric(
        "vllm:lora_requests_info",
        "gauge",
        "LoRA adapters of the running and waiting requests (labels); the value is the time.",
    ),
    Metric("pdserve:num_requests_running", "gauge", "Requests in a batch, per pool."),
    Metric("pdserve:num_requests_waiting", "gauge", "Requests waiting for a slot, per pool."),
    Metric("pdserve:kv_cache_usage_perc", "gauge", "KV blocks in use over all, per pool."),
    Metric("pdserve:workers_alive", "gauge", "Workers up, per pool."),
    Metric("pdserve:cells", "gauge", "Cells (schedulers with their workers) answering."),
    Metric("pdserve:kv_handoffs_total", "counter", "Prompts handed from prefill to decode."),
    Metric("pdserve:kv_handoff_bytes_total", "counter", "KV bytes of those handoffs."),
    Metric("pdserve:kv_handoff_seconds_total", "counter", "Export + import seconds of handoffs."),
    Metric("pdserve:kv_transfer_bytes_total", "counter", "KV bytes fetched, per transport."),
    Metric("pdserve:kv_transfer_seconds_total", "counter", "Seconds fetching KV, per transport."),
    Metric("pdserve:kv_transfer_failures_total", "counter", "Failed KV transfers, per transport."),
    Metric(
        "pdserve:failovers_total",
        "counter",
        "Streams continued on another cell or on their restarted scheduler.",
    ),
    Metric("pdserve:recomputes_total", "counter", "Requests recomputed after a lost cache."),
    Metric(
        "pdserve:pool_changes_total",
        "counter",
        "Pool planner decisions: workers started, released or moved (into the pool they joined).",
    ),
    Metric("pdserve:worker_failures_total", "counter", "Worker actors that stopped answering."),
    Metric("pdserve:scheduler_restarts_total", "counter", "Scheduler actors restarted by Ray."),
    Metric("pdserve:request_timeouts_total", "counter", "Requests ended by a deadline."),
)
_BY_NAME = {m.name: m for m in METRICS}
# shown only where their feature is on (as vLLM's): LoRA adapters served
OPTIONAL = frozenset({"vllm:lora_requests_info"})
# labelled counters whose every label value is known from start-up: each shows at 0 until it
# counts, as vLLM's do, so Prometheus' rate() sees a series' first increment
_KNOWN_LABELS: dict[str, tuple[tuple[str, str], ...]] = {
    "vllm:request_success_total": tuple(
        ("finished_reason", reason) for reason in OPENAI_FINISH_REASON.values()
    ),
}

# the deadline label of pdserve:request_timeouts_total, by the error code the cell gave
_DEADLINES = {"queue_timeout": "queue", "timeout": "request"}


def _key(name: str, **labels: str) -> Key:
    return name, tuple(sorted(labels.items()))


def _workers(stats: dict[str, Any]) -> Iterable[tuple[str, dict[str, Any]]]:
    """(pool, worker line) of a cell's workers: prefill-0 is in the prefill pool."""
    for name, line in stats.get("workers", {}).items():
        yield name.split("-", 1)[0], line


def cell_counters(cell: dict[str, Any]) -> Counter[Key]:
    """A cell's counters (cumulative since it started) from its `metrics()` answer."""
    stats = cell["stats"]
    serving = cell["serving"]
    counts = stats.get("counters", {})
    out: Counter[Key] = Counter()
    own = serving["counters"]
    out[_key("vllm:prompt_tokens_total")] += own.get("prompt_tokens", 0)
    out[_key("vllm:generation_tokens_total")] += own.get("generation_tokens", 0)
    out[_key("pdserve:failovers_total")] += own.get("failovers", 0)
    out[_key("pdserve:kv_handoff_seconds_total")] += own.get("kv_handoff_seconds", 0.0)
    for reason, n in serving["finished"].items():
        out[_key("vllm:request_success_total", finished_reason=reason)] += n
    for code, n in serving["timeouts"].items():
        out[_key("pdserve:request_timeouts_total", deadline=_DEADLINES.get(code, code))] += n
    out[_key("vllm:num_preemptions_total")] += counts.get("preemptions", 0)
    spec = stats.get("spec_decode") or {}
    out[_key("vllm:spec_decode_num_drafts_total")] += spec.get("num_drafts", 0)
    out[_key("vllm:spec_decode_num_draft_tokens_total")] += spec.get("num_draft_tokens", 0)
    out[_key("vllm:spec_decode_num_accepted_tokens_total")] += spec.get("num_accepted_tokens", 0)
    for position, n in enumerate(spec.get("accepted_per_position", [])):
        name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
        out[_key(name, position=str(position))] += n
    out[_key("pdserve:kv_handoffs_total")] += counts.get("handoffs", 0)
    out[_key("pdserve:kv_handoff_bytes_total")] += counts.get("handoff_bytes", 0)
    out[_key("pdserve:recomputes_total")] += counts.get("recomputes", 0)
    out[_key("pdserve:worker_failures_total")] += counts.get("worker_failures", 0)
    pools = stats.get("pools") or {}
    changes = pools.get("changes") or {}
    if pools.get("prefill") or changes:  # disaggregated: each change shows, 0 until it happens
        for change in POOL_CHANGES:
            for pool in ("prefill", "decode"):
                n = changes.get(change, {}).get(pool, 0)
                out[_key("pdserve:pool_changes_total", change=change, pool=pool)] += n
    for _, line in _workers(stats):
        cache = line.get("kv_cache", {})
        out[_key("vllm:prefix_cache_queries_total")] += cache.get("queried_tokens", 0)
        out[_key("vllm:prefix_cache_hits_total")] += cache.get("hit_tokens", 0)
    # per transport, where the cell reports them: {transport: {bytes, seconds, failures}}
    for transport, line in (stats.get("kv_transfer") or {}).items():
        if not isinstance(line, dict):
            continue
        for field, name in (
            ("bytes", "pdserve:kv_transfer_bytes_total"),
            ("seconds", "pdserve:kv_transfer_seconds_total"),
            ("failures", "pdserve:kv_transfer_failures_total"),
        ):
            out[_key(name, transport=str(transport))] += line.get(field, 0)
    for name, hist in serving["histograms"].items():
        full = f"vllm:{name}"
        running = 0
        for bound, n in zip(hist["buckets"], hist["counts"], strict=True):
            running += n
            out[_key(f"{full}_bucket", le=_number(bound))] += running
        out[_key(f"{full}_bucket", le="+Inf")] += hist["count"]
        out[_key(f"{full}_sum")] += hist["sum"]
        out[_key(f"{full}_count")] += hist["count"]
    return out


def cell_gauges(cells: Iterable[dict[str, Any]]) -> Counter[Key]:
    """Requests running and waiting, KV usage and live workers, summed over the live cells."""
    out: Counter[Key] = Counter()
    blocks: Counter[str] = Counter()
    used: Counter[str] = Counter()
    num_cells = 0
    adapters: dict[str, set[Any]] = {"max_lora": set(), "running": set(), "waiting": set()}
    for cell in cells:
        num_cells += 1
        lora = cell["stats"].get("lora") or {}
        if lora.get("max_loras"):
            adapters["max_lora"].add(lora["max_loras"])
            adapters["running"].update(lora.get("running") or {})
            adapters["waiting"].update(lora.get("waiting") or {})
        for pool, line in _workers(cell["stats"]):
            out[_key("pdserve:num_requests_running", pool=pool)] += line.get("running", 0)
            out[_key("pdserve:num_requests_waiting", pool=pool)] += line.get("waiting", 0)
            out[_key("pdserve:workers_alive", pool=pool)] += int(bool(line.get("alive", True)))
            cache = line.get("kv_cache", {})
            blocks[pool] += cache.get("blocks", 0)
            used[pool] += cache.get("blocks_used", 0)
    for pool in blocks:
        out[_key("pdserve:kv_cache_usage_perc", pool=pool)] = used[pool] / max(blocks[pool], 1)
    for which in ("running", "waiting"):
        out[_key(f"vllm:num_requests_{which}")] = sum(
            v for (name, _), v in out.items() if name == f"pdserve:num_requests_{which}"
        )
    out[_key("vllm:kv_cache_usage_perc")] = sum(used.values()) / max(sum(blocks.values()), 1)
    out[_key("pdserve:cells")] = num_cells
    if adapters["max_lora"]:  # as vLLM: one sample, its labels the adapters, its value the time
        labels = {
            "max_lora": str(max(adapters["max_lora"])),
            "running_lora_adapters": ",".join(sorted(adapters["running"])),
            "waiting_lora_adapters": ",".join(sorted(adapters["waiting"])),
        }
        out[_key("vllm:lora_requests_info", **labels)] = time.time()
    return out


class CellTotals:
    """The counters of every cell this ingress replica has seen: the live cells' as they answer,
    and the last answer of each cell that did not answer since (gone, or only slow: when it
    answers again, its new counts replace the old).

    A cell is one scheduler instance: a scheduler that Ray restarted starts its counts at zero
    under the same cell name and a new `instance`, so its predecessor's last answer stays in the
    totals beside it and no counter goes back across a restart."""

    def __init__(self) -> None:
        # every (cell, scheduler instance) seen -> its counters at its last answer
        self.last: dict[tuple[str, str], Counter[Key]] = {}
        # cell -> Ray's count of its scheduler's restarts (a count over instances, not in one)
        self.restarts: dict[str, int] = {}

    def update(self, cells: dict[str, dict[str, Any]]) -> Counter[Key]:
        """Every counter summed over every cell seen, with the gauges of those answering now."""
        for name, cell in cells.items():
            self.last[name, str(cell.get("instance", ""))] = cell_counters(cell)
            restarts = cell["stats"].get("counters", {}).get("scheduler_restarts", 0)
            self.restarts[name] = max(self.restarts.get(name, 0), restarts)
        total: Counter[Key] = Counter()
        for counters in self.last.values():
            total.update(counters)
        total[_key("pdserve:scheduler_restarts_total")] += sum(self.restarts.values())
        total.update(cell_gauges(cells.values()))
        return total


def render(samples: Counter[Key], model_name: str) -> str:
    """Prometheus' text format (0.0.4): every metric of METRICS, each sample with `model_name`;
    a metric no cell has reported yet shows 0 (a histogram: empty buckets are not invented), and
    so does each known label value of a labelled counter (`_KNOWN_LABELS`)."""
    samples = samples.copy()
    for name, labels in _KNOWN_LABELS.items():
        for label in labels:
            samples[_key(name, **dict([label]))] += 0
    by_metric: dict[str, list[tuple[str, tuple[tuple[str, str], ...], float]]] = {}
    for (name, labels), value in samples.items():
        base = name
        for suffix in ("_bucket", "_sum", "_count"):
            if name.endswith(suffix) and name.removesuffix(suffix) in _BY_NAME:
                base = name.removesuffix(suffix)
        by_metric.setdefault(base, []).append((name, labels, value))
    lines = []
    for metric in METRICS:
        lines.append(f"# HELP {metric.name} {metric.help}")
        lines.append(f"# TYPE {metric.name} {metric.kind}")
        rows = sorted(by_metric.get(metric.name, []), key=_order)
        if not rows and metric.kind != "histogram" and not _labelled(metric):
            rows = [(metric.name, (), 0.0)]
        for name, labels, value in rows:
            pairs = (("model_name", model_name), *labels)
            text = ",".join(f'{k}="{_escape(v)}"' for k, v in pairs)
            lines.append(f"{name}{{{text}}} {_number(value)}")
    return "\n".join(lines) + "\n"


def _labelled(metric: Metric) -> bool:
    """Metrics whose samples carry a label of their own (no unlabelled zero is shown for them)."""
    return metric.name in {
        "vllm:request_success_total",
        "vllm:lora_requests_info",
        "pdserve:request_timeouts_total",
        "pdserve:kv_transfer_bytes_total",
        "pdserve:kv_transfer_seconds_total",
        "pdserve:kv_transfer_failures_total",
        "pdserve:num_requests_running",
        "pdserve:num_requests_waiting",
        "pdserve:kv_cache_usage_perc",
        "pdserve:workers_alive",
        "pdserve:pool_changes_total",
    }


def _order(row: tuple[str, tuple[tuple[str, str], ...], float]) -> tuple[Any, ...]:
    """Samples in the order Prometheus' clients write them: labels, then buckets by bound, then
    _sum and _count."""
    name, labels, _ = row
    le = dict(labels).get("le")
    bound = float("inf") if le == "+Inf" else float(le) if le is not None else 0.0
    rank = 0 if name.endswith("_bucket") else 1 if name.endswith("_sum") else 2
    rest = tuple(p for p in labels if p[0] != "le")
    return rest, rank, bound


def _number(value: float) -> str:
    if float(value).is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
