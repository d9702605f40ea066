"""Run by test_cluster_placement in its own process: three simulated nodes, fake GPUs, custom
resources.

Prints one JSON line: where each worker ran and whether disaggregated outputs equal local mode's.
"""

import json
import sys

import ray
from ray.cluster_utils import Cluster

from deploy.config import EngineConfig
from deploy.driver import RayEngine, open_engine
from tests.factories import make_requests


def main(checkpoint: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1, num_gpus=1, resources={"prefill_node": 1})
        cluster.add_node(num_cpus=1, num_gpus=1, resources={"decode_node": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        config = EngineConfig(
            model=checkpoint,
            mode="disaggregated",
            slots=3,
            max_model_len=128,
            token_budget=16,
            prefill_chunk=8,
            prefill_resources={"prefill_node": 1},
            decode_resources={"decode_node": 1},
        )
        requests = lambda: make_requests(8, [5, 31, 12, 47], [17, 6, 25, 9])  # noqa: E731
        with open_engine(config.model_copy(update={"mode": "local"})) as engine:
            local = {k: c.token_ids for k, c in engine.run(requests()).items()}
        with RayEngine(config) as engine:
            placement = ray.get(engine.handle.ready.remote())
            results = engine.run(requests())
        print(
            json.dumps(
                {
                    "head": ray.get_runtime_context().get_node_id(),
                    "prefill_node": placement["prefill-0"]["node_id"],
                    "decode_node": placement["decode-0"]["node_id"],
                    "equal": all(results[k].token_ids == v for k, v in local.items()),
                    "handoff_bytes": sum(c.metrics["kv_handoff_bytes"] for c in results.values()),
                }
            )
        )
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
