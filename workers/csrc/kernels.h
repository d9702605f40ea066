// The entry points bindings.cpp hands to Python, one kernel file defining each.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>

// decode_attention.cpp
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor block_tables, torch::Tensor lengths, double scale);
torch::Tensor decode_attention_kv8(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                   torch::Tensor k_scale, torch::Tensor v_scale,
                                   torch::Tensor block_tables, torch::Tensor lengths,
                                   double scale);

// prompt_attention.cpp
bool prompt_attention_available(int64_t head_dim);
torch::Tensor prompt_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor block_tables, torch::Tensor starts,
                               torch::Tensor firsts, torch::Tensor counts, double scale);
torch::Tensor prompt_attention_kv8(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                   torch::Tensor k_scale, torch::Tensor v_scale,
                                   torch::Tensor block_tables, torch::Tensor starts,
                                   torch::Tensor firsts, torch::Tensor counts, double scale);

// elementwise.cpp
torch::Tensor add_rms_norm(torch::Tensor x, std::optional<torch::Tensor> delta, torch::Tensor w,
                           double eps);
torch::Tensor rope_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                             torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                             torch::Tensor positions, int64_t H);
torch::Tensor rope_and_cache_kv8(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                 torch::Tensor k_cache, torch::Tensor v_cache,
                                 torch::Tensor k_scale, torch::Tensor v_scale,
                                 torch::Tensor slots, torch::Tensor positions, int64_t H);
torch::Tensor silu_mul(torch::Tensor gate_up);

// gemm.cpp
bool amx_bf16();
bool packed_linear_available(bool bf16);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed,
                            std::optional<torch::Tensor> bias, int64_t N);

// quant_linear.cpp
std::string quant_linear_isa();
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor scales,
                           std::optional<torch::Tensor> mins, std::optional<torch::Tensor> bias,
                           int64_t format, int64_t N);

// lora.cpp
void lora_add(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor b,
              torch::Tensor slot_of, torch::Tensor ranks, torch::Tensor firsts);

// shm_reduce.cpp
void shm_all_reduce(torch::Tensor x, torch::Tensor region, torch::Tensor pids, int64_t rank,
                    int64_t seq, double timeout_s);
