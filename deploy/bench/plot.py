"""Draws the benchmarks' figures as PNGs: `pdserve bench`'s sweeps (slots, token budget, rate),
the interference scenario, and the GPU-cost simulation's pools against the load.

Panels: output tokens/s and mean TPOT against slots (with the serial and static `generate` baselines
when measured); p50 and p99 TTFT and p99 inter-token latency against the token budget (runs under
Poisson load: what a bigger budget buys and what it costs); and, when several rates were run,
p50/p99 TTFT and goodput against the arrival rate. A panel whose sweep was not run shows the points
there are and says so.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

_FIXED = ("mode", "slots", "token_budget", "rate", "priorities")


def _label(settings: dict[str, Any]) -> str:
    parts = [str(settings["mode"])] if settings.get("mode") else []
    parts += [
        f"{k}={v:g}"
        for k, v in settings.items()
        if k not in ("mode", "priorities") and v is not None
    ]
    return ", ".join(parts + (["no priorities"] if settings.get("priorities") is False else []))


def _series(
    lines: list[dict[str, Any]], x: str, where: Any = None
) -> dict[str, list[dict[str, Any]]]:
    """Lines grouped by every setting except `x`, each group sorted by `x`; keyed by a legend
    label."""
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    for line in lines:
        # lines of different workloads (runs, files) never share a series
        if where is None or where(line):
            workload = (line.get("requests"), line.get("output_tokens"), line.get("seed"))
            groups[(_label({k: line.get(k) for k in _FIXED if k != x}), workload)].append(line)
    labels = [label for label, _ in groups]
    return {
        (
            label if labels.count(label) == 1 else f"{label}, {workload[0]} req / {workload[1]} tok"
        ): sorted(members, key=lambda line: line[x])
        for (label, workload), members in groups.items()
    }


def _log2_ticks(ax: Any, values: list[int]) -> None:
    """A base-2 log axis labelled with the values that were run."""
    ax.set_xscale("log", base=2)
    if values:
        ax.set_xticks(sorted(set(values)), [str(v) for v in sorted(set(values))])
        ax.minorticks_off()


def _ttft_with(
    ax: Any,
    series: dict[str, list[dict[str, Any]]],
    x: str,
    other: str,
    other_label: str,
    other_style: str,
) -> None:
    """TTFT p50 (solid) and p99 (dashed) of each series against `x`, and one more figure on a right
    axis."""
    right = ax.twinx()
    for label, group in series.items():
        xs = [line[x] for line in group]
        (handle,) = ax.plot(
            xs, [line["ttft_ms_p50"] for line in group], "o-", label=f"TTFT p50: {label}"
        )
        ax.plot(
            xs,
            [line["ttft_ms_p99"] for line in group],
            "^--",
            color=handle.get_color(),
            label=f"TTFT p99: {label}",
        )
        right.plot(
            xs, [line[other] for line in group], other_style, color=handle.get_color(), alpha=0.7
        )
    right.set_ylabel(other_label)


def plot_bench(summaries: list[dict[str, Any]], path: str) -> dict[str, dict[str, list[float]]]:
    """Draw the figure to `path`; return what each panel plots: title -> line label -> its y
    values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # a rate panel only for settings run at several rates (files of other workloads may sit at rate
    # 0)
    by_rate = {
        label: group for label, group in _series(summaries, "rate").items() if len(group) > 1
    }
    panels = 3 if by_rate else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.2 * panels, 4.6), constrained_layout=True)

    ax = axes[0]
    tpot_ax = ax.twinx()
    # throughput is a closed-loop figure: under Poisson arrivals it only shows the offered rate
    saturated = [line for line in summaries if not line.get("rate")] or summaries
    by_slots = _series(saturated, "slots", lambda line: line.get("slots") is not None)
    for label, group in by_slots.items():
        xs = [line["slots"] for line in group]
        (handle,) = ax.plot(
            xs, [line["output_tok_s"] for line in group], "o-", label=f"tok/s: {label}"
        )
        tpot_ax.plot(
            xs,
            [line["tpot_ms_mean"] for line in group],
            "s--",
            color=handle.get_color(),
            alpha=0.6,
            label=f"TPOT: {label}",
        )
    first = summaries[0] if summaries else {}
    static = (
        f"static generate, batch {first['static_batch']}"
        if "static_batch" in first
        else "static generate"
    )
    for key, name, style in (
        ("static_tok_s", static, ":"),
        ("serial_tok_s", "serial generate", "-."),
    ):
        if key in first:
            ax.axhline(first[key], color="grey", linestyle=style, label=name)
    _log2_ticks(ax, [line["slots"] for group in by_slots.values() for line in group])
    ax.set_xlabel("slots (requests decoding at once)")
    ax.set_ylabel("output tokens/s (solid)")
    tpot_ax.set_ylabel("mean TPOT, ms (dashed)")
    ax.set_title(
        "Throughput and TPOT vs slots"
        + ("" if any(len(g) > 1 for g in by_slots.values()) else " (no slots sweep in this run)")
    )
    if by_slots:
        ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)

    ax = axes[1]
    poisson = [line for line in summaries if line.get("rate", 0.0) > 0]
    by_budget = _series(poisson, "token_budget", lambda line: line.get("token_budget") is not None)
    _ttft_with(
        ax, by_budget, "token_budget", "itl_ms_p99", "inter-token latency p99, ms (dotted x)", "x:"
    )
    _log2_ticks(ax, [line["token_budget"] for group in by_budget.values() for line in group])
    ax.set_xlabel("token budget (tokens per step)")
    ax.set_ylabel("TTFT, ms")
    note = (
        ""
        if any(len(g) > 1 for g in by_budget.values())
        else (" (no Poisson runs)" if not poisson else " (no budget sweep in this run)")
    )
    ax.set_title("TTFT and ITL vs token budget, Poisson load" + note)
    if by_budget:
        ax.legend(fontsize=7)
    ax.grid(alpha=0.3)

    if panels == 3:
        ax = axes[2]
        _ttft_with(ax, by_rate, "rate", "goodput_req_s", "goodput, requests/s (dotted)", "s:")
        ax.set_xlabel("arrival rate, requests/s (0: all at once)")
        ax.set_ylabel("TTFT, ms")
        ax.set_title("TTFT and goodput vs arrival rate")
        ax.legend(fontsize=7, loc="upper left")
        ax.grid(alpha=0.3)

    model = summaries[0].get("served_model") or summaries[0].get("model") if summaries else ""
    fig.suptitle(f"pdserve bench: {model}", fontsize=10)
    fig.savefig(path, dpi=110)
    drawn = {
        panel.get_title(): {
            line.get_label(): [float(y) for y in line.get_ydata()]
            for twin in fig.axes
            if twin.bbox.bounds == panel.bbox.bounds
            for line in twin.get_lines()
        }
        for panel in axes
    }
    plt.close(fig)
    return drawn


def plot_interference(series: dict[str, dict[str, list]], path: str) -> dict[str, int]:
    """The interference scenario, one panel per run: each steady stream's inter-token latency over
    time (dots) with the long prompts' arrivals marked (vertical lines), on one y scale. `series`
    maps a run's label to {"itl": [(seconds, ms), ...], "arrivals": [seconds, ...]}. Returns the
    points drawn per panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(series),
        1,
        figsize=(11, 3.2 * len(series)),
        sharex=True,
        sharey=True,
        constrained_layout=True,
        squeeze=False,
    )
    drawn = {}
    for ax, (label, points) in zip(axes[:, 0], series.items(), strict=True):
        for t in points["arrivals"]:
            ax.axvline(t, color="tab:red", alpha=0.35, linewidth=1)
        ax.plot([t for t, _ in points["itl"]], [ms for _, ms in points["itl"]], ".", markersize=2)
        ax.set_yscale("log")
        ax.set_ylabel("steady streams' ITL, ms")
        ax.set_title(
            f"{label}: inter-token latency of the steady streams (red: a long prompt arrives)"
        )
        ax.grid(alpha=0.3)
        drawn[label] = len(points["itl"])
    axes[-1, 0].set_xlabel("seconds since the start")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn


def plot_pools(summaries: list[dict[str, Any]], load: dict[str, Any], path: str) -> dict[str, int]:
    """The GPU-cost simulation's runs: on top, the offered load per window (prompt and output
    tokens/s); below, one panel per run with its goodput per window (bars) and the prefill and
    decode pools' sizes over time (steps). `load` holds `window_s`, `prompt_tok_s` and
    `output_tok_s`. Returns the windows drawn per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(summaries) + 1,
        1,
        figsize=(11, 2.4 * (len(summaries) + 1)),
        sharex=True,
        constrained_layout=True,
        squeeze=False,
    )
    window = load["window_s"]
    top = axes[0, 0]
    starts = [i * window for i in range(len(load["prompt_tok_s"]))]
    top.step(starts, load["prompt_tok_s"], where="post", label="prompt tokens/s")
    top.step(starts, load["output_tok_s"], where="post", label="output tokens/s")
    top.set_ylabel("offered load")
    top.set_title("the trace: tokens arriving per second, by window")
    top.legend(loc="upper right")
    top.grid(alpha=0.3)
    drawn = {}
    for ax, line in zip(axes[1:, 0], summaries, strict=True):
        goodput = line["goodput_per_window"]
        label = ("planner, " if line["planner"] else "fixed ") + line["split"]
        ax.bar(
            [i * window for i in range(len(goodput))],
            goodput,
            width=window,
            align="edge",
            color="0.8",
            label="goodput, req/s",
        )
        ax.set_ylabel("goodput, req/s")
        pools = ax.twinx()
        times = [p["at_s"] for p in line["pools"]]
        for kind, color in (("prefill", "tab:blue"), ("decode", "tab:orange")):
            sizes = [p[kind] for p in line["pools"]]
            pools.step(times, sizes, where="post", color=color, label=f"{kind} workers")
        most = max([4] + [p["prefill"] + p["decode"] for p in line["pools"]])
        pools.set_ylim(0, most + 0.5)
        pools.set_ylabel("workers")
        pools.legend(loc="upper right")
        moves = [(line["role_changes"], "role change")]
        if "up to" in line["split"]:  # pools that scale: their workers' starts and releases
            decisions = line.get("decisions", [])
            # (a started worker is named for the pool it joins; one changing roles, for its old)
            starts = sum(d["worker"].startswith(f"{d['to']}-") for d in decisions)
            releases = sum(d["to"] == "release" for d in decisions)
            moves += [(starts, "start"), (releases, "release")]
        counted = ", ".join(f"{n} {word}{'' if n == 1 else 's'}" for n, word in moves)
        ax.set_title(
            f"{label}: goodput {line['goodput_req_s']} req/s, {counted}, "
            f"{line['worker_seconds']:,.0f} worker-s"
        )
        drawn[label] = len(goodput)
    axes[-1, 0].set_xlabel("seconds of GPU time since the start")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn
