"""The KV handoff with the prefill and the decode worker on one simulated node or on two
(docs/BENCHMARKS.md).

    .venv/bin/python -m benchmarks.studies.kv_prefetch one|two REQUESTS PROMPT_LEN

The embedded model, disaggregated, 1 prefill + 1 decode worker of 1 CPU each, requests one at a time
(each its own prompt, so no prefix cache hit), 16 output tokens; prints each request's
`kv_handoff_s` (export of the last piece + import), TTFT and TPOT as one JSON line. On two nodes the
decode worker pulls each piece to its node while the prompt still prefills
(scheduler/cell/handoffs.py).
"""

import json
import sys

import ray
from ray.cluster_utils import Cluster

from deploy.config import EngineConfig
from deploy.driver import RayEngine
from tests.factories import make_requests


def main(split: str, n: int, plen: int) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    try:
        if split == "two":
            cluster.add_node(num_cpus=1, resources={"p": 1})
            cluster.add_node(num_cpus=1, resources={"d": 1})
        else:
            cluster.add_node(num_cpus=2, resources={"p": 1, "d": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        config = EngineConfig(
            mode="disaggregated",
            slots=4,
            max_model_len=4096,
            prefill_resources={"p": 1},
            decode_resources={"d": 1},
        )
        with RayEngine(config) as engine:
            engine.run(make_requests(1, [plen], [4]))
            out = []
            for i in range(n):
                done = next(iter(engine.run([make_requests(i + 2, [plen], [16])[-1]]).values()))
                out.append(
                    {
                        k: done.metrics.get(k)
                        for k in ("kv_handoff_s", "kv_handoff_bytes", "ttft_s", "tpot_s")
                    }
                )
        print(json.dumps({"split": split, "runs": out}))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
