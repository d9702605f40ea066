"""The GPU cost model's fit: least squares recovers known constants, drops a negative term, and a
model fitted by `gpu-bench --fit-cost-model` is what `gpu_sim --model FILE` replays."""

import json

import pytest

from benchmarks.gpu_sim import main as gpu_sim
from deploy.bench.cost_model import A10_LLAMA_8B, _fit, load_cost_model
from deploy.bench.gpu import main as gpu_bench


def _points(a: float, b: float, c: float, shapes: list[tuple[float, float]]) -> list[dict]:
    return [{"terms": [1.0, x, y], "s": a + b * x + c * y} for x, y in shapes]


def test_the_fit_recovers_the_constants_that_made_the_times():
    shapes = [(64, 2048), (256, 32768), (1024, 524288), (4096, 8.4e6), (1024, 2.6e6)]
    a, b, c = _fit(_points(0.02, 3e-5, 2e-9, shapes))
    assert a == pytest.approx(0.02, rel=1e-6)
    assert b == pytest.approx(3e-5, rel=1e-6)
    assert c == pytest.approx(2e-9, rel=1e-6)


def test_a_term_that_would_come_out_negative_is_dropped_and_the_rest_refitted():
    # times that fall slightly with the second term: no step gets faster with more work
    points = [{"terms": [1.0, x, 0.0], "s": 0.04 - 1e-7 * x} for x in (1, 16, 64, 256)]
    a, b, c = _fit(points)
    assert b == 0.0 and c == 0.0
    assert 0.039 < a < 0.04
    # the same with a third term that does grow: it keeps its share once the second is dropped
    shapes = [(1, 4e4), (16, 1e4), (64, 9e4), (256, 2e4)]
    points = [{"terms": [1.0, x, y], "s": 0.04 - 1e-7 * x + 1e-8 * y} for x, y in shapes]
    a, b, c = _fit(points)
    assert b == 0.0 and 0.5e-8 < c < 2e-8 and 0.035 < a < 0.045


def test_a_named_model_or_a_missing_file_is_told_apart(tmp_path):
    assert load_cost_model(A10_LLAMA_8B.name) is A10_LLAMA_8B
    with pytest.raises(ValueError, match="neither"):
        load_cost_model(str(tmp_path / "missing.json"))


def test_gpu_bench_fits_a_cost_model_that_the_simulation_loads(tmp_path, capsys):
    path = tmp_path / "cpu-tiny.json"
    argv = ["--preset", "tiny", "--device", "cpu", "--output", "", "--workdir", str(tmp_path)]
    assert gpu_bench([*argv, "--fit-cost-model", str(path), "--startup-s", "12"]) == 0
    written = json.loads(path.read_text())
    assert {p["kind"] for p in written["points"]} == {"prefill", "decode"}
    assert all(p["s"] > 0 and p["fit_s"] >= 0 for p in written["points"])
    cost = load_cost_model(str(path))
    assert cost.startup_s == 12 and cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert cost.decode_fixed_s + cost.decode_per_seq_s > 0
    capsys.readouterr()
    assert gpu_sim(["--model", str(path), "--splits", "", "--minutes", "1"]) == 0
    first = json.loads(capsys.readouterr().out.splitlines()[0])
    assert first["model"]["name"] == cost.name
