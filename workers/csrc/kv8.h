// 8-bit KV rows (int8, fp8 e4m3) with an fp16 scale each: loads as floats, and quantizing a row.
//
// A row is one token's K (or V) of one KV head: D values and a scale, absmax / 127 (int8) or
// absmax / 448 (fp8) rounded to fp16. `quantize_row` is workers/kv_quant.py's `quantize` step for
// step (fp32 division, ties to even, the same fp16 and e4m3 conversions as torch's), so the C++
// writer and the torch one give the same bytes. The attention kernels read a row's values as
// floats and apply its scale to what they sum (a score, a softmax weight): dequantized in
// registers, never copied out.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common.h"

// an fp8 value as the cache stores it (torch.float8_e4m3fn's byte, in a uint8 tensor)
struct Fp8 {
    uint8_t bits;
};

// whether a cache element is 8-bit (its rows have scales beside them)
template <typename C>
constexpr bool is_kv8 = std::is_same_v<C, int8_t> || std::is_same_v<C, Fp8>;

// the largest magnitude each 8-bit format stores: a row's absmax maps to it
template <typename C> constexpr float kv8_max = 127.f;
template <> constexpr float kv8_max<Fp8> = 448.f;

// every e4m3 byte's value: the plain loops look values up (a vector path converts 16 at a time)
struct Fp8Table {
    float value[256];
    Fp8Table() {
        for (int i = 0; i < 256; ++i)
            value[i] = float(c10::Float8_e4m3fn(uint8_t(i), c10::Float8_e4m3fn::from_bits()));
    }
};
static const Fp8Table FP8_TABLE;

static inline float load(const int8_t* p, int64_t i) { return float(p[i]); }
static inline float load(const Fp8* p, int64_t i) { return FP8_TABLE.value[p[i].bits]; }
static inline float load(const c10::Half* p, int64_t i) { return float(p[i]); }

#if defined(__AVX512F__)
static inline __m512 load16(const int8_t* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
// e4m3's exponent and mantissa bits placed in an fp16's (sign kept) are the value times 2^-8,
// subnormals included: converted as fp16, then times 256 (exact)
static inline __m512 load16(const Fp8* p) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m256i wide = _mm256_cvtepu8_epi16(bytes);
    const __m256i sign = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x80)), 8);
    const __m256i rest = _mm256_slli_epi16(_mm256_and_si256(wide, _mm256_set1_epi16(0x7F)), 7);
    const __m512 half = _mm512_cvtph_ps(_mm256_or_si256(sign, rest));
    return _mm512_mul_ps(half, _mm512_set1_ps(256.f));
}
#endif

// x: D floats -> out: D 8-bit values and *scale, as workers/kv_quant.py's `quantize`
template <typename C>
static inline void quantize_row(const float* x, int64_t D, C* out, c10::Half* scale) {
    float absmax = 0.f;
    for (int64_t d = 0; d < D; ++d) absmax = std::max(absmax, std::fabs(x[d]));
    constexpr float top = kv8_max<C>;
    *scale = c10::Half(absmax / top);  // to nearest (ties to even), as torch's .to(float16)
    const float stored = float(*scale);
    const float divisor = stored > 0.f ? stored : 1.f;
    for (int64_t d = 0; d < D; ++d) {
        const float y = std::min(std::max(x[d] / divisor, -top), top);
        if constexpr (std::is_same_v<C, int8_t>) {
            out[d] = int8_t(std::nearbyint(y));  // ties to even, as torch.round
        } else {
            out[d].bits = c10::Float8_e4m3fn(y).x;
        }
    }
}

// a (row, KV head)'s scales of keys 0..len-1 as floats: key t's at
// `base + table[t / BS] * stride + t % BS` (stride: KVH BS, base at the KV head's part of block 0)
static inline void gather_scales(const c10::Half* base, const int64_t* table, int64_t stride,
                                 int64_t BS, int64_t len, float* out) {
    for (int64_t t0 = 0, blk = 0; t0 < len; t0 += BS, ++blk) {
        const c10::Half* block = base + table[blk] * stride;
        const int64_t end = std::min(len, t0 + BS);
        for (int64_t t = t0; t < end; ++t) out[t] = float(block[t - t0]);
    }
}

// What both attention kernels ask of their query and 8-bit paged K and V with their scales.
static inline void check_paged_kv8(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const torch::Tensor& k_scale,
                                   const torch::Tensor& v_scale) {
    TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous() &&
                    k_scale.is_contiguous() && v_scale.is_contiguous(),
                "contiguous tensors expected");
    TORCH_CHECK(q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16,
                "float32 or bfloat16 queries expected");
    TORCH_CHECK((k.scalar_type() == torch::kChar || k.scalar_type() == torch::kByte) &&
                    k.scalar_type() == v.scalar_type(),
                "int8, or uint8 (fp8 e4m3 bytes), K and V expected");
    TORCH_CHECK(k_scale.scalar_type() == torch::kHalf && v_scale.scalar_type() == torch::kHalf,
                "float16 scales expected");
    TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() &&
                    k.size(1) == q.size(1) && k.size(3) == q.size(3) &&
                    k_scale.sizes() == k.sizes().slice(0, 3) && v_scale.sizes() == k_scale.sizes(),
                "q [rows, KVH, G, D], k and v [NB, KVH, BS, D], scales [NB, KVH, BS] expected");
}

// f(T{}, C{}): the query's element type (float, or uint16_t for bf16) and the cache's (int8_t, Fp8)
template <typename F>
static inline void with_kv8_types(const torch::Tensor& q, const torch::Tensor& k, F&& f) {
    const bool fp8 = k.scalar_type() == torch::kByte;
    if (q.scalar_type() == torch::kFloat) {
        if (fp8) return f(float{}, Fp8{});
        return f(float{}, int8_t{});
    }
    if (fp8) return f(uint16_t{}, Fp8{});
    f(uint16_t{}, int8_t{});
}
