"""Shared fixtures: one local Ray for the whole session (started on first use) and a tiny
checkpoint.

Every Ray the tests start authenticates with a token of this test session's own, passed in the
environment: a fresh machine needs no `~/.ray/auth_token`, and the tests never write one.
"""

import os
import secrets

import pytest

from tests.factories import save_tiny_checkpoint

os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
os.environ.pop("RAY_AUTH_TOKEN_PATH", None)


@pytest.fixture(scope="session")
def decode_kernel():
    """Build the CPU kernels (decode attention, packed matmuls, fused elementwise ops) once, up
    front (about 40 s on a fresh machine), before any worker actor or Serve replica needs them: a
    build inside one would count against its start-up. In-process tests build them on first use."""
    from workers.kernels import load_kernels

    return load_kernels()


@pytest.fixture(autouse=True)
def kernels_before_actors(request):
    """Tests of the slow and ray tiers start actors, replicas or jobs: the kernels come first."""
    if request.node.get_closest_marker("slow") or request.node.get_closest_marker("ray"):
        request.getfixturevalue("decode_kernel")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that start Ray (through `ray_session`) are in the `ray` tier: `make test-fast`
    leaves them out."""
    for item in items:
        if "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    return str(save_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def uneven_checkpoint(tmp_path_factory):
    """A tiny checkpoint whose 9 query heads on 3 KV heads split 2 groups and 1 at TP-2."""
    from tests.workers.tp_ranks import save_uneven_checkpoint

    return str(save_uneven_checkpoint(tmp_path_factory.mktemp("uneven-9-on-3")))


@pytest.fixture(scope="session")
def qwen3_tp_checkpoint(tmp_path_factory):
    """A tiny Qwen3 checkpoint whose TP-2 slices are whole int8 blocks of 32 (4 heads of 32 on 2
    KV heads, 128 MLP columns)."""
    from tests.workers.tp_ranks import save_uneven_checkpoint

    path = tmp_path_factory.mktemp("qwen3-4-on-2")
    return str(save_uneven_checkpoint(path, "qwen3-4-on-2"))


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray with more logical CPUs than cores, so 2 prefill + 2 decode workers fit on 2
    cores."""
    import ray

    from tests.factories import free_port

    metrics_port = free_port()
    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        log_to_driver=False,
        _metrics_export_port=metrics_port,
    )
    ray.metrics_port = metrics_port  # for the test that scrapes Ray's Prometheus endpoint
    yield ray
    ray.shutdown()
