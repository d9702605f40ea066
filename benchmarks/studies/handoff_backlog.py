"""Measures the handoff backlog under an overload: prompts whose KV waits in the object store for a
decode slot.

Runs the disaggregated engine (1 prefill + 1 decode worker) on N requests sent at once, samples the
scheduler's `live_handoffs` (handed off, not yet imported) every 20 ms, and prints one JSON line:
the peak and mean backlog, output tok/s and the decode worker's steps per call. docs/BENCHMARKS.md
has the runs. Usage:

    .venv/bin/python -m benchmarks.studies.handoff_backlog \
        CHECKPOINT REQUESTS PROMPT_LEN OUTPUT_LEN SLOTS
"""

import json
import sys
import threading
import time

import numpy as np

from deploy.config import EngineConfig
from deploy.driver import RayEngine
from scheduler.request import Request


def main(model: str, n: int, prompt_len: int, output_len: int, slots: int) -> None:
    config = EngineConfig(
        model=model, mode="disaggregated", slots=slots, max_model_len=prompt_len + output_len + 8
    )
    engine = RayEngine(config)
    rng = np.random.default_rng(0)
    vocab = min(len(engine.tokenizer), 32_000)

    def requests(tag: str, count: int) -> list[Request]:
        return [
            Request(
                req_id=f"{tag}{i}",
                prompt_ids=rng.integers(10, vocab, prompt_len).tolist(),
                max_tokens=output_len,
            )
            for i in range(count)
        ]

    try:
        engine.run(requests("warm", 4))
        samples: list[int] = []
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                samples.append(engine.stats()["live_handoffs"])
                time.sleep(0.02)

        watcher = threading.Thread(target=watch)
        watcher.start()
        start = time.perf_counter()
        completions = engine.run(requests("r", n))
        seconds = time.perf_counter() - start
        done.set()
        watcher.join()
        timeline = engine.stats()["timeline"]
        print(
            json.dumps(
                {
                    "requests": n,
                    "prompt_len": prompt_len,
                    "output_len": output_len,
                    "slots": slots,
                    "prefill_slots": config.prefill_slots,
                    "peak_waiting_handoffs": max(samples),
                    "mean_waiting_handoffs": round(float(np.mean(samples)), 1),
                    "output_tok_s": round(
                        sum(len(c.token_ids) for c in completions.values()) / seconds
                    ),
                    "decode_steps_per_call": round(timeline["decode"]["steps_per_call"], 2),
                }
            )
        )
    finally:
        engine.close()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:6]))
