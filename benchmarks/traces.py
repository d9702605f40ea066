"""The GPU-cost simulation's traces: Poisson arrivals whose mix and rate move through phases
(`shifting`: the mix moves at a steady load; `daily`: the load also rises and falls), repeated for
days, and the tokens they bring per second."""

from __future__ import annotations

import random
from typing import Any


def shifting_trace(
    minutes: float,
    seed: int,
    phases: list[tuple[tuple[float, float], tuple[int, int], tuple[int, int]]],
) -> list[tuple[float, int, int]]:
    """(arrival s, prompt tokens, output tokens) of Poisson arrivals whose mix moves through
    `phases` of equal length: ((requests/s at its start, at its end), prompt range, output range)
    each; the rate moves linearly within a phase (arrivals drawn at the phase's highest rate, each
    kept with the probability rate at its time / that rate)."""
    rng = random.Random(seed)
    length = minutes * 60 / len(phases)
    trace = []
    for number, ((first, last), prompt, output) in enumerate(phases):
        start = number * length
        t = start
        while True:
            t += rng.expovariate(max(first, last))
            if t >= start + length:
                break
            rate = first + (last - first) * (t - start) / length
            # (a steady phase draws nothing more: its trace is the one it always was)
            if first == last or rng.random() * max(first, last) < rate:
                trace.append((t, rng.randint(*prompt), rng.randint(*output)))
    return trace


PROMPT_HEAVY = ((2000, 4000), (16, 64))  # RAG: long prompts, short answers
OUTPUT_HEAVY = ((100, 300), (300, 700))  # chat: short prompts, long answers

# prompt-heavy, output-heavy, prompt-heavy again. Each phase's rate loads four A10s near 75% with
# its own split and overloads the other phase's split, under the A10 cost model (cost_model.py): a
# 2,000-4,000-token prompt takes 0.75 s on a prefill worker, so 3 req/s keeps three at 75% and
# would hold two at 112%; a decode worker stays under the 60 ms ITL SLO up to about 60 running
# answers, about 1,100 tokens/s, so 2.75 req/s of 500-token answers (1,375 tokens/s) keeps two at
# 62% and would hold one at 125%.
SHIFTING_PHASES = [
    ((3.0, 3.0), *PROMPT_HEAVY),
    ((2.75, 2.75), *OUTPUT_HEAVY),
    ((3.0, 3.0), *PROMPT_HEAVY),
]
# The same mixes and peaks on a day's shape: the load rises from a quarter or a third of the peak
# to it and falls back, twice prompt-heavy and once output-heavy between. The peaks need 3:1 and
# 1:2 as above (a fixed deployment sized for both: 3:2); at the troughs one worker of each kind
# suffices.
DAILY_PHASES = [
    ((0.75, 3.0), *PROMPT_HEAVY),
    ((3.0, 1.0), *PROMPT_HEAVY),
    ((1.0, 2.75), *OUTPUT_HEAVY),
    ((2.75, 1.0), *OUTPUT_HEAVY),
    ((1.0, 3.0), *PROMPT_HEAVY),
    ((3.0, 0.75), *PROMPT_HEAVY),
]
TRACES = {"shifting": SHIFTING_PHASES, "daily": DAILY_PHASES}


def days_trace(
    minutes: float, seed: int, phases: list[Any], days: int
) -> list[tuple[float, int, int]]:
    """`days` periods of the trace one after the other, day k drawn with seed + k (so one day
    with seed s + k replays day k of a longer run)."""
    period_s = minutes * 60
    return [
        (day * period_s + t, prompt, output)
        for day in range(days)
        for t, prompt, output in shifting_trace(minutes, seed + day, phases)
    ]


def offered_load(
    trace: list[tuple[float, int, int]], minutes: float, window_s: float
) -> dict[str, Any]:
    """The trace's prompt and output tokens arriving per second, window by window."""
    windows = int(minutes * 60 // window_s) + 1
    prompt = [0.0] * windows
    output = [0.0] * windows
    for arrival, prompt_tokens, output_tokens in trace:
        prompt[int(arrival // window_s)] += prompt_tokens / window_s
        output[int(arrival // window_s)] += output_tokens / window_s
    return {"window_s": window_s, "prompt_tok_s": prompt, "output_tok_s": output}
