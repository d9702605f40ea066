"""The scheduler-ceiling benchmark (stub workers) drives one cell or several through one
consumer."""

import pytest

from benchmarks.ceiling import measure

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("cells", [1, 2])
def test_every_request_finishes_whole_through_the_cells(ray_session, cells):
    line = measure(
        "disaggregated", slots=4, num_requests=8, prompt_len=16, output_len=10, cells=cells
    )
    assert line["cells"] == cells and line["output_tokens"] == 8 * 10
    assert line["decode_steps_per_s"] > 0 and line["polls"] > 0
