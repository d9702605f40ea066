// Where a row's keys lie in the paged KV cache, and what both attention kernels ask of q, k, v.
#pragma once

#include <torch/types.h>

#include <cstdint>

// Where one (row, KV head)'s keys and values lie: key t at
// `k + table[t / BS] * stride + (t % BS) * D`, k (and v) pointing at the KV head's part of block 0
// and stride the size of a block (KVH BS D).
struct Pages {
    const int64_t* table;  // the row's block table: ceil(len / BS) entries are read
    int64_t stride, BS;
};

// What both attention kernels (decode rows, prompt chunks) ask of their query and paged K and V.
static inline void check_paged_qkv(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v) {
    TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(),
                "contiguous tensors expected");
    TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(),
                "one dtype expected");
    TORCH_CHECK(q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16,
                "float32 or bfloat16 expected");
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() &&
                    k.size(1) == q.size(1) && k.size(3) == q.size(3),
                "q [rows, KVH, G, D], k and v [NB, KVH, BS, D] expected");
}
