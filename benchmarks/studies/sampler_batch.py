"""The sampler on a CPU, a step's rows in one call (`workers.sampling.sample`: tensor ops over the
batch, one host read) against the same rows one call each (a read per row, as a row-by-row
sampler makes): 64 rows of the embedded model's 49,152 logits, all greedy, and a mix of every
option (greedy, penalties, logit_bias with min_tokens, temperature, top-k, top-p, min-p, and
top-k + top-p with penalties). Milliseconds per step, the median of 9 after a warm-up:

    .venv/bin/python -m benchmarks.studies.sampler_batch [THREADS]
"""

import statistics
import sys
import time

import torch

from scheduler.request import SamplingParams
from workers.request_state import RequestState
from workers.sampling import sample

VOCAB = 49152
ROWS = 64
REPEATS = 9


def mixed_rows() -> list[SamplingParams]:
    """16 greedy, 8 greedy with penalties, 8 with logit_bias and min_tokens, 16 temperature, 4 each
    of top-k, top-p and min-p, 4 with top-k, top-p and penalties (64 in all)."""
    penalties = dict(repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2)
    bias = dict(logit_bias=((5, 2.0), (17, -3.0)), min_tokens=8, suppress_ids=frozenset({0}))
    hot = dict(temperature=0.8)
    groups = [
        (16, {}),
        (8, penalties),
        (8, bias),
        (16, hot),
        (4, hot | dict(top_k=50)),
        (4, hot | dict(top_p=0.9)),
        (4, hot | dict(min_p=0.05)),
        (4, hot | dict(top_k=40, top_p=0.95) | penalties),
    ]
    return [
        SamplingParams(seed=i, **options)
        for i, options in enumerate(o for count, o in groups for _ in range(count))
    ]


def states_of(params: list[SamplingParams]) -> list[RequestState | None]:
    """A state with 500 prompt and 100 output tokens for each row that needs one."""
    g = torch.Generator().manual_seed(0)
    states = []
    for p in params:
        if not p.needs_history:
            states.append(None)
            continue
        prompt = torch.randint(0, VOCAB, (500,), generator=g).tolist()
        output = torch.randint(0, VOCAB, (100,), generator=g).tolist()
        states.append(RequestState(p, tuple(prompt), tuple(output), None))
    return states


def step_ms(logits: torch.Tensor, params: list[SamplingParams], per_row: bool) -> float:
    states = states_of(params)
    indices = [3] * len(params)

    def step() -> None:
        if not per_row:
            sample(logits, params, indices, states)
            return
        for i in range(len(params)):
            sample(logits[i : i + 1], params[i : i + 1], indices[i : i + 1], states[i : i + 1])

    step()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads())
    logits = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(1)) * 3
    print(f"{ROWS} rows x {VOCAB} logits, {torch.get_num_threads()} threads, ms per step")
    print(f"{'rows':>8} {'dtype':>9} {'one call':>9} {'a call each':>12}")
    for name, params in (("greedy", [SamplingParams()] * ROWS), ("mixed", mixed_rows())):
        for dtype in (torch.float32, torch.bfloat16):
            rows = logits.to(dtype)
            batched = step_ms(rows, params, per_row=False)
            each = step_ms(rows, params, per_row=True)
            print(f"{name:>8} {str(dtype)[6:]:>9} {batched:9.1f} {each:12.1f}")


if __name__ == "__main__":
    main()
