// The fused per-layer elementwise kernels: residual add + RMSNorm, rotary + cache write, SiLU-mul.
//
// The cache write also has an 8-bit form (int8, fp8: kv8.h), which quantizes each K and V row with
// its scale as it writes it.
//
// Each kernel does what the eager torch ops of `workers/kernels.py` do, rounding to the tensor's
// dtype wherever they round (bf16 after every op, as torch does), in one pass over the rows instead
// of several ops of a dozen dispatches and thread forks each. fp32 differs from the eager ops only
// in the order of a row's sum of squares and by about 1 ulp in exp (built with -ffp-contract=off,
// so a*b + c*d is not fused into one rounding).
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "kv8.h"

// exp(x) for any x: exp_nonpositive (the same polynomial holds for x > 0), clamped to +87.
static inline float exp_any(float x) { return exp_nonpositive(x > 87.f ? 87.f : x); }

static int64_t rows_per_task(int64_t row_elems) { return std::max<int64_t>(1, 32768 / row_elems); }

// x: [N, H] becomes x + delta (if given); returns rms_norm(x) * w: [N, H]
template <typename T>
static void add_rms_norm_run(T* x, const T* delta, const T* w, T* out, int64_t N, int64_t H,
                             float eps) {
    at::parallel_for(0, N, rows_per_task(H), [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
            T* xr = x + n * H;
            float ss = 0.f;
            if (delta != nullptr) {
                const T* dr = delta + n * H;
#pragma omp simd reduction(+ : ss)
                for (int64_t h = 0; h < H; ++h) {
                    const float v = rounded<T>(load(xr, h) + load(dr, h));
                    store(xr, h, v);
                    ss += v * v;
                }
            } else {
#pragma omp simd reduction(+ : ss)
                for (int64_t h = 0; h < H; ++h) ss += load(xr, h) * load(xr, h);
            }
            const float r = 1.f / std::sqrt(ss / float(H) + eps);
#pragma omp simd
            for (int64_t h = 0; h < H; ++h)
                store(out + n * H, h, load(w, h) * rounded<T>(load(xr, h) * r));
        }
    });
}

torch::Tensor add_rms_norm(torch::Tensor x, std::optional<torch::Tensor> delta, torch::Tensor w,
                           double eps) {
    TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == w.scalar_type(),
                "bad tensors");
    TORCH_CHECK(!delta || (delta->is_contiguous() && delta->sizes() == x.sizes()), "bad delta");
    auto out = torch::empty_like(x);
    const int64_t H = x.size(-1), N = x.numel() / H;
    if (x.scalar_type() == torch::kFloat)
        add_rms_norm_run<float>(ptr<float>(x), delta ? ptr<float>(*delta) : nullptr, ptr<float>(w),
                                ptr<float>(out), N, H, float(eps));
    else
        add_rms_norm_run<uint16_t>(ptr<uint16_t>(x), delta ? ptr<uint16_t>(*delta) : nullptr,
                                   ptr<uint16_t>(w), ptr<uint16_t>(out), N, H, float(eps));
    return out;
}

// Element d of head `src` rotated: x cos + rotate_half(x) sin, each product rounded to T as torch
// rounds it (the sum is rounded where it is stored).
template <typename T>
static inline float rotated(const T* src, const T* c, const T* s, int64_t d, int64_t half) {
    const float rot = d < half ? -load(src, d + half) : load(src, d - half);
    return rounded<T>(load(src, d) * load(c, d)) + rounded<T>(rot * load(s, d));
}

// qkv: [N, H + 2 KVH, D]; cos, sin: [N, D]; k_cache, v_cache: [S, KVH, C, D]; slots, positions:
// [N]. q and k rotate (x cos + rotate_half(x) sin); k and v go to their cache rows; returns q: [N,
// H, D]
template <typename T>
static void rope_run(const T* qkv, const T* cos, const T* sin, T* q, T* kc, T* vc,
                     const int64_t* slots, const int64_t* positions, int64_t N, int64_t H,
                     int64_t KVH, int64_t C, int64_t D) {
    const int64_t half = D / 2, width = (H + 2 * KVH) * D;
    at::parallel_for(0, N, rows_per_task(width), [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
            const T* c = cos + n * D;
            const T* s = sin + n * D;
            const int64_t cache_row = slots[n] * KVH * C + positions[n]; // (slot, head 0, position)
            for (int64_t head = 0; head < H + 2 * KVH; ++head) {
                const T* src = qkv + n * width + head * D;
                T* dst = head < H ? q + (n * H + head) * D
                         : head < H + KVH ? kc + (cache_row + (head - H) * C) * D
                                          : vc + (cache_row + (head - H - KVH) * C) * D;
                if (head >= H + KVH) {
                    std::copy(src, src + D, dst);
                    continue;
                }
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) store(dst, d, rotated(src, c, s, d, half));
            }
        }
    });
}

torch::Tensor rope_and_cache(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                             torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                             torch::Tensor positions, int64_t H) {
    TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
                    k_cache.is_contiguous() && v_cache.is_contiguous(),
                "contiguous tensors expected");
    TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() &&
                    qkv.scalar_type() == k_cache.scalar_type(),
                "one dtype");
    const int64_t N = qkv.size(0), D = qkv.size(2), KVH = k_cache.size(1), C = k_cache.size(2);
    TORCH_CHECK(qkv.size(1) == H + 2 * KVH && cos.numel() == N * D, "bad shapes");
    auto q = torch::empty({N, H, D}, qkv.options());
    const int64_t* s = slots.data_ptr<int64_t>();
    const int64_t* p = positions.data_ptr<int64_t>();
    if (qkv.scalar_type() == torch::kFloat)
        rope_run<float>(ptr<float>(qkv), ptr<float>(cos), ptr<float>(sin), ptr<float>(q),
                        ptr<float>(k_cache), ptr<float>(v_cache), s, p, N, H, KVH, C, D);
    else
        rope_run<uint16_t>(ptr<uint16_t>(qkv), ptr<uint16_t>(cos), ptr<uint16_t>(sin),
                           ptr<uint16_t>(q), ptr<uint16_t>(k_cache), ptr<uint16_t>(v_cache), s, p,
                           N, H, KVH, C, D);
    return q;
}

// rope_run into an 8-bit cache (E: int8_t or Fp8): each k and v row, as the activations' dtype T
// holds it, quantized with its scale into k_scale, v_scale: [S, KVH, C]
template <typename T, typename E>
static void rope_kv8_run(const T* qkv, const T* cos, const T* sin, T* q, E* kc, E* vc,
                         c10::Half* ks, c10::Half* vs, const int64_t* slots,
                         const int64_t* positions, int64_t N, int64_t H, int64_t KVH, int64_t C,
                         int64_t D) {
    const int64_t half = D / 2, width = (H + 2 * KVH) * D;
    at::parallel_for(0, N, rows_per_task(width), [&](int64_t begin, int64_t end) {
        std::vector<float> row(D);
        for (int64_t n = begin; n < end; ++n) {
            const T* c = cos + n * D;
            const T* s = sin + n * D;
            const int64_t cache_row = slots[n] * KVH * C + positions[n]; // (slot, head 0, position)
            for (int64_t head = 0; head < H; ++head) {
                const T* src = qkv + n * width + head * D;
                T* dst = q + (n * H + head) * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) store(dst, d, rotated(src, c, s, d, half));
            }
            for (int64_t head = 0; head < KVH; ++head) {
                const T* key = qkv + n * width + (H + head) * D;
                const T* value = key + KVH * D;
                const int64_t at = cache_row + head * C;
                for (int64_t d = 0; d < D; ++d) row[d] = rounded<T>(rotated(key, c, s, d, half));
                quantize_row(row.data(), D, kc + at * D, ks + at);
                for (int64_t d = 0; d < D; ++d) row[d] = load(value, d);
                quantize_row(row.data(), D, vc + at * D, vs + at);
            }
        }
    });
}

torch::Tensor rope_and_cache_kv8(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                                 torch::Tensor k_cache, torch::Tensor v_cache,
                                 torch::Tensor k_scale, torch::Tensor v_scale,
                                 torch::Tensor slots, torch::Tensor positions, int64_t H) {
    TORCH_CHECK(qkv.is_contiguous() && cos.is_contiguous() && sin.is_contiguous() &&
                    k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    k_scale.is_contiguous() && v_scale.is_contiguous(),
                "contiguous tensors expected");
    TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() &&
                    (qkv.scalar_type() == torch::kFloat || qkv.scalar_type() == torch::kBFloat16),
                "float32 or bfloat16 activations expected");
    TORCH_CHECK((k_cache.scalar_type() == torch::kChar || k_cache.scalar_type() == torch::kByte) &&
                    k_cache.scalar_type() == v_cache.scalar_type() &&
                    k_scale.scalar_type() == torch::kHalf && v_scale.scalar_type() == torch::kHalf,
                "int8 or uint8 (fp8) caches with float16 scales expected");
    const int64_t N = qkv.size(0), D = qkv.size(2), KVH = k_cache.size(1), C = k_cache.size(2);
    TORCH_CHECK(qkv.size(1) == H + 2 * KVH && cos.numel() == N * D &&
                    k_scale.sizes() == k_cache.sizes().slice(0, 3) &&
                    v_scale.sizes() == k_scale.sizes(),
                "bad shapes");
    auto q = torch::empty({N, H, D}, qkv.options());
    const int64_t* s = slots.data_ptr<int64_t>();
    const int64_t* p = positions.data_ptr<int64_t>();
    with_kv8_types(qkv, k_cache, [&](auto t, auto e) {
        using T = decltype(t);
        using E = decltype(e);
        rope_kv8_run<T, E>(ptr<T>(qkv), ptr<T>(cos), ptr<T>(sin), ptr<T>(q), ptr<E>(k_cache),
                           ptr<E>(v_cache), ptr<c10::Half>(k_scale), ptr<c10::Half>(v_scale), s,
                           p, N, H, KVH, C, D);
    });
    return q;
}

#if defined(__AVX512F__)
static inline void store_rounded16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
static inline void store_rounded16(uint16_t* p, __m512 x) {  // x already a bfloat16 value
    const __m256i top = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), top);
}
#endif

// gate_up: [N, 2 I] -> silu(gate) * up: [N, I]
template <typename T>
static void silu_mul_run(const T* gate_up, T* out, int64_t N, int64_t I) {
    at::parallel_for(0, N, rows_per_task(I), [&](int64_t begin, int64_t end) {
        for (int64_t n = begin; n < end; ++n) {
            const T* g = gate_up + n * 2 * I;
            int64_t i = 0;
#if defined(__AVX512F__)
            const __m512 one = _mm512_set1_ps(1.f);
            for (; i + 16 <= I; i += 16) {
                const __m512 a = load16(g + i);
                const __m512 e = exp16_nonpositive(
                    _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), a), _mm512_set1_ps(87.f)));
                const __m512 silu = rounded16<T>(_mm512_div_ps(a, _mm512_add_ps(one, e)));
                store_rounded16(out + n * I + i,
                                rounded16<T>(_mm512_mul_ps(silu, load16(g + I + i))));
            }
#endif
            for (; i < I; ++i) {
                const float a = load(g, i);
                store(out + n * I, i, rounded<T>(a / (1.f + exp_any(-a))) * load(g + I, i));
            }
        }
    });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
    TORCH_CHECK(gate_up.is_contiguous(), "contiguous tensor expected");
    const int64_t I = gate_up.size(-1) / 2, N = gate_up.numel() / (2 * I);
    auto sizes = gate_up.sizes().vec();
    sizes.back() = I;
    auto out = torch::empty(sizes, gate_up.options());
    if (gate_up.scalar_type() == torch::kFloat)
        silu_mul_run<float>(ptr<float>(gate_up), ptr<float>(out), N, I);
    else
        silu_mul_run<uint16_t>(ptr<uint16_t>(gate_up), ptr<uint16_t>(out), N, I);
    return out;
}
