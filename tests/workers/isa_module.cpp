// The matmuls alone (quantized and packed fp32) as a Python module: tests build their other ISA
// paths with it.
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("quant_linear", torch::wrap_pybind_function(quant_linear), "quant_linear");
    m.def("quant_linear_isa", torch::wrap_pybind_function(quant_linear_isa), "quant_linear_isa");
    m.def("packed_linear", torch::wrap_pybind_function(packed_linear), "packed_linear");
    m.def("packed_linear_available", torch::wrap_pybind_function(packed_linear_available),
          "packed_linear_available");
}
