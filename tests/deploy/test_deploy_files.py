"""serve_config.yaml passes Serve's own schema and our config checks; cluster.yaml passes Ray's."""

import copy
import re
from pathlib import Path

import pytest
import yaml

from deploy.config import ServiceConfig
from deploy.serving.app import build_app

ROOT = Path(__file__).resolve().parents[2]


def test_serve_config_loads_through_serves_schema_and_builds():
    from ray.serve.schema import ServeDeploySchema

    raw = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    schema = (
        ServeDeploySchema.model_validate(raw)
        if hasattr(ServeDeploySchema, "model_validate")
        else ServeDeploySchema.parse_obj(raw)
    )
    app = schema.applications[0]
    assert app.import_path == "deploy.serving.app:build_app"
    assert raw["http_options"]["host"] == "127.0.0.1"
    config = ServiceConfig(**app.args)
    assert (
        config.mode == "disaggregated"
        and config.prefill_workers == 1
        and config.decode_workers == 1
    )
    build_app(app.args)  # composes without starting anything


def test_the_options_commented_out_in_serve_config_yaml_build_when_uncommented():
    raw = yaml.safe_load((ROOT / "deploy" / "serve_config.yaml").read_text())
    args = dict(raw["applications"][0]["args"])
    commented = {}
    for line in (ROOT / "deploy" / "serve_config.yaml").read_text().splitlines():
        # "      # name: value   # what it does": an option a user uncomments
        option = line.strip().removeprefix("# ").split("  #")[0].strip()
        value = r"(\d+|true|false|\{.*\})"  # (not "cells: each is one scheduler...")
        if line.strip().startswith("# ") and re.fullmatch(r"[a-z_]+: " + value, option):
            commented |= yaml.safe_load(option)
    assert {"max_cells", "prefill_resources", "pool_planner", "planner_period_s"} <= set(commented)
    config = ServiceConfig(**(args | commented))
    assert config.pool_planner and config.max_prefill_workers == 3
    build_app(args | commented)


@pytest.mark.parametrize(
    "args, message",
    [
        ({"slots": 0}, "slots"),
        ({"prefill_chunk": 512, "token_budget": 256}, "must not exceed token_budget"),
        ({"mode": "local"}, "cannot be served"),
        ({"colour": "red"}, "colour"),
        ({"pool_planner": True, "planner_period_s": 86400}, "max_prefill_workers"),
    ],
)
def test_bad_service_args_are_rejected_with_a_clear_message(args, message):
    with pytest.raises(ValueError, match=message):
        build_app(args)


def test_cluster_yaml_passes_rays_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = yaml.safe_load((ROOT / "cluster.yaml").read_text())
    validate_config(prepare_config(copy.deepcopy(config)))
    types = config["available_node_types"]
    assert types["prefill_gpu"]["resources"] == {"prefill_node": 1}
    assert types["decode_gpu"]["resources"] == {"decode_node": 1}
    assert any("pip install" in c and "pdserve" in c for c in config["setup_commands"])
    broken = copy.deepcopy(config)
    broken["available_node_types"]["head"]["unknown_field"] = 1
    with pytest.raises(Exception, match="unknown_field"):
        validate_config(prepare_config(broken))
