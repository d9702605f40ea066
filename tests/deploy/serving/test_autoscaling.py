"""The cells' autoscaling: the Cell deployment's options, and the policy on the open requests the
cells report."""

from types import SimpleNamespace

from ray.serve.config import AutoscalingConfig

from deploy.config import ServiceConfig
from deploy.serving.autoscaling import open_requests


def context(config, per_cell, running=2, target=2):
    return SimpleNamespace(
        aggregated_metrics=per_cell,
        current_num_replicas=running,
        target_num_replicas=target,
        config=config,
    )


def test_cells_autoscale_on_the_open_requests_they_report_over_the_target():
    options = ServiceConfig(
        model="m",
        cells=1,
        max_cells=4,
        target_requests_per_cell=8,
        cells_autoscaling={"downscale_delay_s": 2.0},
    ).cell_options()["autoscaling_config"]
    assert options["policy"] == {"policy_function": "deploy.serving.autoscaling:open_requests"}
    config = AutoscalingConfig(**options)  # what Serve builds from them (it checks the fields)
    assert (config.min_replicas, config.max_replicas, config.downscale_delay_s) == (1, 4, 2.0)
    # 20 open requests over two cells, 8 wanted per cell: 2.5 cells (Serve rounds, delays and bounds
    # it)
    assert open_requests(context(config, {"open_requests": {"a": 12.0, "b": 8.0}}))[0] == 2.5
    assert open_requests(context(config, {"open_requests": {"a": 0.0, "b": 0.0}}))[0] == 0.0
    # nothing reported yet (cells starting): keep what is wanted
    assert open_requests(context(config, {}, target=3))[0] == 3
    assert open_requests(context(config, None, running=0, target=1))[0] == 1


def test_a_fixed_number_of_cells_has_no_autoscaling():
    assert ServiceConfig(model="m", cells=3).cell_options() == {"num_replicas": 3}
