"""Draws docs/bench-runtime.png: pdserve against vLLM's CPU backend, from the runs in BENCHMARKS.md.

The figures are the `output_tok_s` lines of the runs listed in docs/BENCHMARKS.md ("Against vLLM's
CPU backend"), measured on the 2-core development machine on 2026-11-30; where a setting was run
twice, both runs are drawn. Run: `.venv/bin/python -m benchmarks.studies.runtime_figure`.
"""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RUNS = {  # (server, dtype) -> output tok/s of each run
    ("vLLM 0.32 CPU", "fp32"): [100.3, 101.0, 102.3],
    ("pdserve local", "fp32"): [187.2, 179.2],
    ("pdserve Serve app", "fp32"): [158.9],
    ("vLLM 0.32 CPU", "bf16"): [172.8, 168.0, 169.3],
    ("pdserve local", "bf16"): [292.7, 290.0],
    ("pdserve Serve app", "bf16"): [219.5],
}


def main() -> None:
    servers = ["vLLM 0.32 CPU", "pdserve local", "pdserve Serve app"]
    colors = ["#999999", "#1f77b4", "#2ca02c"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for d, dtype in enumerate(["fp32", "bf16"]):
        for s, server in enumerate(servers):
            runs = RUNS[(server, dtype)]
            x = d * 4 + s
            ax.bar(x, sum(runs) / len(runs), color=colors[s], label=server if d == 0 else None)
            ax.plot([x] * len(runs), runs, "k.", markersize=4)
    ax.set_xticks([1, 5], ["fp32", "bf16"])
    ax.set_ylabel("output tokens/s")
    ax.set_title("SmolLM2-135M, 64 requests (prompts 16-512, outputs 16-256), 2 CPU cores")
    ax.legend(frameon=False, fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(__file__).resolve().parents[3] / "docs" / "bench-runtime.png", dpi=110)


if __name__ == "__main__":
    main()
