"""`pdserve bench --repeat N`: every configuration run N times, alternating the order, with medians
and paired ratios, so a comparison on a noisy machine can be read from one command.

Round r runs the configurations in order when r is even and in reverse when it is odd (A B, B A,
...), so a machine that slows down or speeds up over the command weighs on every configuration
alike. Each summary line carries its `round`; after the last round one `repeat` line per
configuration gives the median, lowest and highest of its figures, and, where the same configuration
ran in `local` mode, its output tokens/s over local's run of the same round (close in time, so
paired) and the ratio of the medians.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

# what identifies one configuration across rounds (the mode aside, for pairing with local)
SETTINGS = ("slots", "token_budget", "rate", "priorities", "prefix_cache", "cache_routing")
# the figures a repeat line summarizes, those a run reported (the interference workload adds its
# own)
FIGURES = (
    "output_tok_s",
    "ttft_ms_p50",
    "tpot_ms_mean",
    "itl_ms_p50",
    "itl_ms_p99",
    "goodput_req_s",
    "handoff_gap_ms_p50",
    "steady_itl_ms_p50",
    "steady_itl_ms_p99",
    "long_ttft_ms_p50",
    "long_handoff_gap_ms_p50",
)


def rounds(runs: Sequence[T], repeat: int) -> Iterator[tuple[int, T]]:
    """(round, run) for `repeat` rounds, every odd round in reverse order."""
    if repeat < 1:
        raise ValueError("--repeat must be at least 1")
    for r in range(repeat):
        for run in runs if r % 2 == 0 else list(reversed(runs)):
            yield r, run


def _key(line: dict[str, Any]) -> tuple[Any, ...]:
    return (line["mode"], *(line.get(k) for k in SETTINGS))


def _groups(summaries: list[dict[str, Any]]) -> dict[tuple[Any, ...], list[dict[str, Any]]]:
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for line in summaries:
        groups.setdefault(_key(line), []).append(line)
    return groups


def median_lines(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per configuration, its round of median output tokens/s (the lower middle of an even count):
    what the figure draws when rounds repeat."""
    picked = []
    for group in _groups(summaries).values():
        ordered = sorted(group, key=lambda line: line["output_tok_s"])
        picked.append(ordered[(len(ordered) - 1) // 2])
    return picked


def repeat_lines(summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per configuration: median, lowest and highest of each figure over the rounds, and
    its output tokens/s over local's (per round, and of the medians) where local ran the same
    settings."""
    groups = _groups(summaries)
    out = []
    for key, group in groups.items():
        line: dict[str, Any] = {
            "repeat": key[0],
            **dict(zip(SETTINGS, key[1:], strict=True)),
            "rounds": len(group),
        }
        for figure in FIGURES:
            values = [g[figure] for g in group if g.get(figure) is not None]
            if values:
                line[figure] = {
                    "median": round(statistics.median(values), 3),
                    "min": round(min(values), 3),
                    "max": round(max(values), 3),
                }
        local = groups.get(("local", *key[1:]))
        if key[0] != "local" and local:
            by_round = {g["round"]: g["output_tok_s"] for g in local}
            line["output_tok_s_over_local"] = [
                round(g["output_tok_s"] / by_round[g["round"]], 3)
                for g in group
                if by_round.get(g["round"])
            ]
            line["median_over_median_local"] = round(
                statistics.median(g["output_tok_s"] for g in group)
                / statistics.median(g["output_tok_s"] for g in local),
                3,
            )
        out.append(line)
    return out
