// The Python module: each kernel's entry point under its own name.
#include <torch/extension.h>

#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("decode_attention", torch::wrap_pybind_function(decode_attention), "decode_attention");
    m.def("prompt_attention", torch::wrap_pybind_function(prompt_attention), "prompt_attention");
    m.def("prompt_attention_available", torch::wrap_pybind_function(prompt_attention_available),
          "prompt_attention_available");
    m.def("add_rms_norm", torch::wrap_pybind_function(add_rms_norm), "add_rms_norm");
    m.def("rope_and_cache", torch::wrap_pybind_function(rope_and_cache), "rope_and_cache");
    m.def("silu_mul", torch::wrap_pybind_function(silu_mul), "silu_mul");
    m.def("packed_linear", torch::wrap_pybind_function(packed_linear), "packed_linear");
    m.def("packed_linear_available", torch::wrap_pybind_function(packed_linear_available),
          "packed_linear_available");
    m.def("amx_bf16", torch::wrap_pybind_function(amx_bf16), "amx_bf16");
    // the 8-bit KV cache (kv8.h)
    m.def("decode_attention_kv8", torch::wrap_pybind_function(decode_attention_kv8),
          "decode_attention_kv8");
    m.def("prompt_attention_kv8", torch::wrap_pybind_function(prompt_attention_kv8),
          "prompt_attention_kv8");
    m.def("rope_and_cache_kv8", torch::wrap_pybind_function(rope_and_cache_kv8),
          "rope_and_cache_kv8");
    m.def("quant_linear", torch::wrap_pybind_function(quant_linear), "quant_linear");
    m.def("quant_linear_isa", torch::wrap_pybind_function(quant_linear_isa), "quant_linear_isa");
    m.def("lora_add", torch::wrap_pybind_function(lora_add), "lora_add");
    // spins until every rank has written: without the GIL, so the process's other threads run
    m.def("shm_all_reduce", &shm_all_reduce, "shm_all_reduce",
          pybind11::call_guard<pybind11::gil_scoped_release>());
}
