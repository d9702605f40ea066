"""The kernels' build from workers/csrc/: a compiler error names the real file and line, and the
build key follows every file, headers included."""

import shutil
from pathlib import Path

import pytest
import torch

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


@pytest.mark.slow
@pytest.mark.parametrize(("isa", "flags"), [("avx2", ["-mno-avx512f"]), ("scalar", ["-mno-avx2"])])
def test_the_matmuls_other_paths_give_the_same_bits(tmp_path, isa, flags):
    """`quant_linear.cpp` and `gemm.cpp` built as for a CPU without AVX-512 or without AVX2 give
    the bits this CPU's build gives. Quantized, every format (VPMADDUBSW on AVX2, plain loops
    without): the integer sums are exact and the float steps the same fused multiply-adds in the
    same order. Packed fp32 (the same vector source at 8 lanes on AVX2): each output the same
    fused multiply-adds in k order, for row counts that fill and split its tiles and columns that
    end mid-panel; without AVX2 there is none (torch's matmul serves)."""
    from torch.utils.cpp_extension import load

    from tests.workers.quant_cases import packed
    from workers.quantized import FORMATS

    native = kernels.load_kernels()
    if native is None or " avx2" not in Path("/proc/cpuinfo").read_text():
        pytest.skip("no C++ compiler here, or a CPU without AVX2")
    module = load(
        name=f"pdserve_matmuls_{isa}",
        sources=[
            str(kernels.CSRC / "quant_linear.cpp"),
            str(kernels.CSRC / "gemm.cpp"),
            str(Path(__file__).with_name("isa_module.cpp")),
        ],
        extra_include_paths=[str(kernels.CSRC)],
        extra_cflags=[*kernels.CFLAGS, *flags],
        extra_ldflags=["-fopenmp"],
        build_directory=str(tmp_path),
    )
    assert module.quant_linear_isa() == isa
    bias = torch.randn(33)
    for fmt, number in FORMATS.items():
        k = 768 if fmt in ("q4_k", "q6_k") else 160  # whole super-blocks of 256
        w = packed(fmt, 33, k)
        x = torch.randn(37, k)
        args = (x, w.qs, w.scales, w.mins, bias, number, 33)
        assert torch.equal(module.quant_linear(*args), native.quant_linear(*args)), fmt
    assert module.packed_linear_available(False) == (isa == "avx2")
    assert not module.packed_linear_available(True)  # bf16: AVX512-BF16 only
    if isa == "scalar" or not native.packed_linear_available(False):
        return
    n, k = 100, 37  # a panel and a bit; K odd
    weight = torch.randn(n, k)
    panels = torch.nn.functional.pad(weight, (0, 0, 0, -n % 64)).view(-1, 64, k)
    panels = panels.transpose(1, 2).contiguous()  # [P, K, 64], as kernels.linear packs it
    for rows in (1, 2, 3, 4, 5, 7, 13, 64):
        x = torch.randn(rows, k)
        for b in (bias.new_zeros(0), torch.randn(n)):
            b = b if len(b) else None
            got = module.packed_linear(x, panels, b, n)
            assert torch.equal(got, native.packed_linear(x, panels, b, n)), rows
