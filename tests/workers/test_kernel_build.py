"""The kernels' build from workers/csrc/: a compiler error names the real file and line, and the
build key follows every file, headers included."""

import shutil
from pathlib import Path

import pytest

from workers import kernels


def break_line(path: Path, marker: str, broken: str) -> int:
    """Replace the first line of `path` that holds `marker` by `broken`; its 1-based number."""
    lines = path.read_text().splitlines(keepends=True)
    index = next(i for i, line in enumerate(lines) if marker in line)
    lines[index] = broken + "\n"
    path.write_text("".join(lines))
    return index + 1


def test_editing_a_header_changes_the_build_key(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(kernels.CSRC, csrc)
    assert kernels._machine_tag(csrc) == kernels._machine_tag()
    with (csrc / "common.h").open("a") as header:
        header.write("// one more line\n")
    assert kernels._machine_tag(csrc) != kernels._machine_tag()


def test_a_compiler_error_names_the_real_file_and_line(tmp_path):
    """One kernel file and the headers only: its compile fails in seconds, where the whole
    module's build takes about 40 s."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler here")
    csrc = tmp_path / "csrc"
    csrc.mkdir()
    for header in kernels.CSRC.glob("*.h"):
        shutil.copy(header, csrc)
    shutil.copy(kernels.CSRC / "elementwise.cpp", csrc)
    source_line = break_line(
        csrc / "elementwise.cpp",
        "static int64_t rows_per_task(",
        "static int64_t rows_per_task(int64_t row_elems) { return no_such_name; }",
    )
    header_line = break_line(
        csrc / "common.h",
        "return p * __builtin_bit_cast(float",
        "    return p * no_such_scale;",
    )
    with pytest.raises(RuntimeError) as error:
        kernels.build(csrc, name="pdserve_broken_kernels", build_directory=tmp_path)
    assert f"{csrc / 'elementwise.cpp'}:{source_line}:" in str(error.value)
    assert f"{csrc / 'common.h'}:{header_line}:" in str(error.value)
