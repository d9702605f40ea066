"""The workers' tests' fixtures: `compiled` skips a test where the C++ kernels cannot be built."""

import pytest

from workers import kernels


@pytest.fixture
def compiled():
    if kernels.load_kernels() is None:
        pytest.skip("no C++ compiler here: the kernels cannot be built")
