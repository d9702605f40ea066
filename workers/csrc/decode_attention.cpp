// The ragged decode-attention kernel: each decode row's queries over its keys in the paged cache.
//
// The cache is a pool of blocks of BS tokens, [NB, KVH, BS, D] per layer, and a row's keys are the
// blocks its block table names, in order: the loops over keys walk the table a block at a time (a
// block's BS keys are contiguous, D apart) rather than gathering a row's keys into a copy, which
// would double the memory traffic of a memory-bound loop. Scores, max, exp and sums run over
// t = 0..len-1 in the same order whatever the block size or where the blocks lie, so a row's result
// is bit for bit the one of its keys laid out contiguously. Two paths: AVX-512 intrinsics where the
// build machine has them (-march=native) and the head dim is 16, 32, 64 or 128, and plain loops
// otherwise (other CPUs, other head dims). Both keep scores and sums in fp32 whatever the cache
// dtype. An 8-bit cache (int8, fp8: kv8.h) is the same code instantiated for its element type C:
// its values load as floats, a key's score is its dot product times the key's scale and a value's
// weight its softmax weight times the value's scale (the scales of a row's keys and values
// gathered first, 2 bytes each).
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

#include "common.h"
#include "kernels.h"
#include "kv8.h"
#include "paged_kv.h"

// f(t, row) for t = 0..len-1 in order, row the D elements of key (or value) t of `base`: the table
// is read once per block, and within a block the rows follow each other D apart. With `also` (the
// key pass, given the values), row t of `also` is prefetched into L2 as row t of `base` is read:
// the value pass then finds its rows there, not in memory (most of the 1.03-1.44x this and huge
// pages gave its reads of a 1 GiB pool: docs/BENCHMARKS.md, "Decode rows over their blocks").
template <typename T, typename F>
static inline __attribute__((always_inline)) void for_each_row(const T* base, const Pages& pages,
                                                                 int64_t len, int64_t D, F&& f,
                                                                 const T* also = nullptr) {
    const int64_t bytes = D * int64_t(sizeof(T));
    for (int64_t t0 = 0, blk = 0; t0 < len; t0 += pages.BS, ++blk) {
        const T* block = base + pages.table[blk] * pages.stride;  // [BS, D]
        // Each row also prefetches its twin in the next block: the blocks lie anywhere in the pool,
        // and the hardware prefetcher loses the stream at every jump (about twice the time on
        // shuffled blocks without this). Prefetches change no arithmetic.
        const T* next = t0 + pages.BS < len ? base + pages.table[blk + 1] * pages.stride : nullptr;
        const T* other = also ? also + pages.table[blk] * pages.stride : nullptr;  // [BS, D]
        const int64_t end = std::min(len, t0 + pages.BS);
        for (int64_t t = t0; t < end; ++t) {
            if (next) {
                const char* twin = reinterpret_cast<const char*>(next + (t - t0) * D);  // [D]
                for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(twin + i);
            }
            if (other) {
                const char* row = reinterpret_cast<const char*>(other + (t - t0) * D);  // [D]
                for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch(row + i, 0, 2);
            }
            f(t, block + (t - t0) * D);
        }
    }
}

// One (row, KV head): its G query rows over keys 0..len-1. q, out: [G, D]; k, v: paged as `pages`
// says; scores: G * len; ks, vs: the keys' and values' scales (len each) when C is 8-bit.
template <typename T, typename C = T>
static void attend_scalar(const T* q, const C* k, const C* v, const Pages& pages, int64_t len,
                          int64_t G, int64_t D, float scale, float* scores, T* out,
                          const float* ks = nullptr, const float* vs = nullptr) {
    std::vector<float> qf(G * D), acc(G * D, 0.f), row(D), inv(G);
    for (int64_t i = 0; i < G * D; ++i) qf[i] = load(q, i) * scale;
    for_each_row(k, pages, len, D, [&](int64_t t, const C* key) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) row[d] = load(key, d);
        for (int64_t g = 0; g < G; ++g) {
            float s = 0.f;
#pragma omp simd reduction(+ : s)
            for (int64_t d = 0; d < D; ++d) s += qf[g * D + d] * row[d];
            if constexpr (is_kv8<C>) s *= ks[t];
            scores[g * len + t] = s;
        }
    }, v);
    for (int64_t g = 0; g < G; ++g) {
        float* sg = scores + g * len;
        float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sg[t]);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) { sg[t] = exp_nonpositive(sg[t] - mx); sum += sg[t]; }
        inv[g] = 1.f / sum;
    }
    for_each_row(v, pages, len, D, [&](int64_t t, const C* value) {
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) row[d] = load(value, d);
        for (int64_t g = 0; g < G; ++g) {
            float p = scores[g * len + t];
            if constexpr (is_kv8<C>) p *= vs[t];
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * row[d];
        }
    });
    for (int64_t i = 0; i < G * D; ++i) store(out, i, acc[i] * inv[i / D]);
}

#if defined(__AVX512F__)
// attend_scalar with D = 16 NV: up to GB query rows at a time keep their q and their output
// accumulators in registers (GB * NV <= 16 of the 32), so each key and value row is loaded once per
// group of GB.
template <typename T, int NV, typename C = T>
static void attend_avx512(const T* q, const C* k, const C* v, const Pages& pages, int64_t len,
                          int64_t G, float scale, float* scores, T* out,
                          const float* ks = nullptr, const float* vs = nullptr) {
    constexpr int D = 16 * NV, GB = NV <= 2 ? 8 : 16 / NV;
    for (int64_t g0 = 0; g0 < G; g0 += GB) {
        const int ng = int(std::min<int64_t>(GB, G - g0));
        __m512 qv[GB][NV], acc[GB][NV];
        float inv[GB];
        for (int g = 0; g < GB; ++g)
            for (int i = 0; i < NV; ++i) {
                qv[g][i] =
                    g < ng ? _mm512_mul_ps(load16(q + (g0 + g) * D + 16 * i), _mm512_set1_ps(scale))
                           : _mm512_setzero_ps();
                acc[g][i] = _mm512_setzero_ps();
            }
        for_each_row(k, pages, len, D, [&](int64_t t, const C* key) {
            __m512 kr[NV];
            for (int i = 0; i < NV; ++i) kr[i] = load16(key + 16 * i);
            for (int g = 0; g < GB; ++g) {
                if (g >= ng) break;
                __m512 s = _mm512_mul_ps(qv[g][0], kr[0]);
                for (int i = 1; i < NV; ++i) s = _mm512_fmadd_ps(qv[g][i], kr[i], s);
                if constexpr (is_kv8<C>) {
                    scores[g * len + t] = _mm512_reduce_add_ps(s) * ks[t];
                } else {
                    scores[g * len + t] = _mm512_reduce_add_ps(s);
                }
            }
        }, v);
        for (int g = 0; g < ng; ++g) {
            float* sg = scores + g * len;
            __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
            for (int64_t t = 0; t < len; t += 16)
                mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail(t, len), sg + t));
            const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
            for (int64_t t = 0; t < len; t += 16) {
                const __mmask16 m = tail(t, len);
                const __m512 e =
                    exp16_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + t), top));
                _mm512_mask_storeu_ps(sg + t, m, e);
                sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
            }
            inv[g] = 1.f / _mm512_reduce_add_ps(sum);
        }
        for_each_row(v, pages, len, D, [&](int64_t t, const C* value) {
            __m512 vr[NV];
            for (int i = 0; i < NV; ++i) vr[i] = load16(value + 16 * i);
            for (int g = 0; g < GB; ++g) {
                if (g >= ng) break;
                float weight = scores[g * len + t];
                if constexpr (is_kv8<C>) weight *= vs[t];
                const __m512 p = _mm512_set1_ps(weight);
                for (int i = 0; i < NV; ++i) acc[g][i] = _mm512_fmadd_ps(p, vr[i], acc[g][i]);
            }
        });
        for (int g = 0; g < ng; ++g)
            for (int i = 0; i < NV; ++i)
                store16(out + (g0 + g) * D + 16 * i,
                        _mm512_mul_ps(acc[g][i], _mm512_set1_ps(inv[g])));
    }
}
#endif

template <typename T, typename C = T>
static void attend(const T* q, const C* k, const C* v, const Pages& pages, int64_t len, int64_t G,
                   int64_t D, float scale, float* scores, T* out, const float* ks = nullptr,
                   const float* vs = nullptr) {
#if defined(__AVX512F__)
    switch (D) {
        case 16: return attend_avx512<T, 1, C>(q, k, v, pages, len, G, scale, scores, out, ks, vs);
        case 32: return attend_avx512<T, 2, C>(q, k, v, pages, len, G, scale, scores, out, ks, vs);
        case 64: return attend_avx512<T, 4, C>(q, k, v, pages, len, G, scale, scores, out, ks, vs);
        case 128: return attend_avx512<T, 8, C>(q, k, v, pages, len, G, scale, scores, out, ks, vs);
    }
#endif
    attend_scalar(q, k, v, pages, len, G, D, scale, scores, out, ks, vs);
}

// q, out: [B, KVH, G, D]; k, v: [NB, KVH, BS, D] contiguous; tables: [B, MAXB]; lengths: [B]; an
// 8-bit cache's scales k_scale, v_scale: [NB, KVH, BS]. Each thread takes the next (row, KV head)
// pair, longest rows first, so threads finish together however ragged the rows.
template <typename T, typename C = T>
static void run(const T* q, const C* k, const C* v, const int64_t* tables, const int64_t* lengths,
                T* out, int64_t B, int64_t KVH, int64_t G, int64_t D, int64_t BS, int64_t MAXB,
                float scale, const c10::Half* k_scale = nullptr,
                const c10::Half* v_scale = nullptr) {
    std::vector<int64_t> order(B * KVH);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return lengths[a / KVH] > lengths[b / KVH]; });
    const int64_t longest = B ? *std::max_element(lengths, lengths + B) : 0;
    std::atomic<int64_t> next{0};
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
        std::vector<float> scores(std::max<int64_t>(G, 8) * longest);
        std::vector<float> ks(is_kv8<C> ? longest : 0), vs(is_kv8<C> ? longest : 0);
        for (int64_t i = next++; i < B * KVH; i = next++) {
            const int64_t item = order[i], b = item / KVH, h = item % KVH;
            const Pages pages{tables + b * MAXB, KVH * BS * D, BS};
            if constexpr (is_kv8<C>) {
                gather_scales(k_scale + h * BS, pages.table, KVH * BS, BS, lengths[b], ks.data());
                gather_scales(v_scale + h * BS, pages.table, KVH * BS, BS, lengths[b], vs.data());
            }
            attend(q + item * G * D, k + h * BS * D, v + h * BS * D, pages, lengths[b], G, D, scale,
                   scores.data(), out + item * G * D, ks.data(), vs.data());
        }
    });
}

// B * MAXB integers against a loop over every key: a bad table fails here, not as a stray read
static void check_rows(const torch::Tensor& q, const torch::Tensor& k,
                       const torch::Tensor& block_tables, const torch::Tensor& lengths) {
    const int64_t B = q.size(0), NB = k.size(0), BS = k.size(2);
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B &&
                    block_tables.is_contiguous() && lengths.numel() == B && lengths.is_contiguous(),
                "block_tables [B, MAXB] and lengths [B] contiguous expected");
    const int64_t MAXB = block_tables.size(1);
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* l = lengths.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
        TORCH_CHECK(l[b] >= 0 && l[b] <= MAXB * BS, "length ", l[b], " of row ", b,
                    " does not fit its block table");
        for (int64_t i = 0; i * BS < l[b]; ++i)
            TORCH_CHECK(tables[b * MAXB + i] >= 0 && tables[b * MAXB + i] < NB, "block ",
                        tables[b * MAXB + i], " of row ", b, " outside the pool of ", NB);
    }
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor block_tables, torch::Tensor lengths, double scale) {
    check_paged_qkv(q, k, v);
    check_rows(q, k, block_tables, lengths);
    const int64_t B = q.size(0), KVH = q.size(1), G = q.size(2), D = q.size(3);
    const int64_t BS = k.size(2), MAXB = block_tables.size(1);
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* l = lengths.data_ptr<int64_t>();
    auto out = torch::empty_like(q);
    if (q.scalar_type() == torch::kFloat) {
        run<float>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), tables, l,
                   out.data_ptr<float>(), B, KVH, G, D, BS, MAXB, float(scale));
    } else {
        run<uint16_t>(ptr<uint16_t>(q), ptr<uint16_t>(k), ptr<uint16_t>(v), tables, l,
                      ptr<uint16_t>(out), B, KVH, G, D, BS, MAXB, float(scale));
    }
    return out;
}

torch::Tensor decode_attention_kv8(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                   torch::Tensor k_scale, torch::Tensor v_scale,
                                   torch::Tensor block_tables, torch::Tensor lengths,
                                   double scale) {
    check_paged_kv8(q, k, v, k_scale, v_scale);
    check_rows(q, k, block_tables, lengths);
    const int64_t B = q.size(0), KVH = q.size(1), G = q.size(2), D = q.size(3);
    const int64_t BS = k.size(2), MAXB = block_tables.size(1);
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* l = lengths.data_ptr<int64_t>();
    auto out = torch::empty_like(q);
    with_kv8_types(q, k, [&](auto t, auto c) {
        using T = decltype(t);
        using C = decltype(c);
        run<T, C>(ptr<T>(q), ptr<C>(k), ptr<C>(v), tables, l, ptr<T>(out), B, KVH, G, D, BS, MAXB,
                  float(scale), ptr<c10::Half>(k_scale), ptr<c10::Half>(v_scale));
    });
    return out;
}
