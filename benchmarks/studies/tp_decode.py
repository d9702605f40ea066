"""Decode steps of the embedded model (fp32, 16 running requests) on a tensor-parallel worker of two
ranks with one thread each, against one rank with one thread and with two (equal compute).

    .venv/bin/python -m benchmarks.studies.tp_decode [ROUNDS]

The three engines are `local` mode's (the TP-2 one's rank 1 a Ray actor), all started first, then
run in turn, round after round, on the same 16 requests (32-token prompts, 64 tokens out each): a
busy shared machine slows the rounds of all three alike. Prints each round's milliseconds per
decode step and, at the end, each one's median and its output tokens per second of decode steps.
"""

import statistics
import sys

import torch

from deploy.config import EngineConfig
from deploy.driver import InProcessEngine
from scheduler.request import Request

NUM_REQUESTS, PROMPT_LEN, MAX_TOKENS = 16, 32, 64
# name -> (tensor parallel size, torch threads of rank 0)
VARIANTS = {"tp1-1thread": (1, 1), "tp1-2threads": (1, 2), "tp2-1thread-per-rank": (2, 1)}


def requests(round_: int) -> list[Request]:
    g = torch.Generator().manual_seed(round_)
    return [
        Request(
            req_id=f"{round_}-{i}",
            prompt_ids=torch.randint(100, 40000, (PROMPT_LEN,), generator=g).tolist(),
            max_tokens=MAX_TOKENS,
        )
        for i in range(NUM_REQUESTS)
    ]


def main(rounds: int) -> None:
    engines = {}
    for name, (tp, threads) in VARIANTS.items():
        torch.set_num_threads(threads)
        config = EngineConfig(
            dtype="float32",
            device="cpu",
            slots=NUM_REQUESTS,
            max_model_len=256,
            tensor_parallel_size=tp,
        )
        engines[name] = InProcessEngine(config)
    step_ms: dict[str, list[float]] = {name: [] for name in VARIANTS}
    tokens: dict[str, list[list[int]]] = {}
    try:
        for round_ in range(rounds):
            for name, engine in engines.items():
                torch.set_num_threads(VARIANTS[name][1])
                engine.reset_profile()
                done = engine.run(requests(round_))
                tokens[name] = [done[r.req_id].token_ids for r in requests(round_)]
                ms = engine.profile()["decode_step_ms"]
                step_ms[name].append(ms)
                print(f"round {round_} {name}: {ms:.1f} ms per decode step", flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    same = tokens["tp2-1thread-per-rank"] == tokens["tp1-1thread"]
    print(f"TP-2's greedy tokens equal TP-1's: {same}")
    for name, values in step_ms.items():
        median = statistics.median(values)
        print(f"{name}: median {median:.1f} ms per step, {NUM_REQUESTS * 1000 / median:.0f} tok/s")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
