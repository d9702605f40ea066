// The paged prompt-attention kernel: a step's prompt chunks over their blocks where they lie.
//
// Until this kernel, a prompt chunk gathered its request's blocks into one contiguous copy per
// layer and called SDPA: 30-50% of the chunk's attention for a short chunk over a long context (a
// conversation's next turn), 2-11% for 128-256 tokens (a microbenchmark over the embedded model's
// heads, one thread).
//
// One work item is (chunk, KV head, tile of the chunk's tokens): its rows are the tile's tokens
// times the G query heads sharing that KV head, at most 128 (about 96 by default). It walks the
// request's blocks in table order, flash-attention style: per block, scores for every row, a
// running max and sum per row, and the output accumulators rescaled when the max grows. Scores
// and the outputs are both computed across rows, the rows a vector's lanes: the queries and the
// accumulators are kept transposed ([D][rows]), so a key's (or a value's) element is broadcast
// against a vector of rows, with no horizontal sums, and the rescaling and softmax run on whole
// vectors. Row r of token t sees keys 0..start+t (causal within the chunk). Written with GCC's
// vector extensions: 16 lanes where the CPU has AVX-512, 8 elsewhere (AVX2), the same source; D
// must be a multiple of 4, elsewhere `prompt_attention_available` says no and the gather + SDPA
// path runs. An 8-bit cache (int8, fp8: kv8.h) runs the same loops over its element type C: a
// block's scores are multiplied by their keys' scales, and the softmax weights by their values'
// scales before the value loop.
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "common.h"
#include "kernels.h"
#include "kv8.h"
#include "paged_kv.h"

namespace prompt {

// lanes; row vectors per pass of the score loop (two keys each) and of the value loop (DB
// elements each): the accumulators take 16 of AVX-512's 32 registers, 12 of AVX2's 16
#if defined(__AVX512F__)
constexpr int VL = 16, SCORE_ROWS = 8, VALUE_ROWS = 4;
#else
constexpr int VL = 8, SCORE_ROWS = 4, VALUE_ROWS = 3;
#endif
constexpr int DB = 4;  // head-dim elements per pass of the value loop
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static inline vf vload(const float* p) {
    vf x;
    std::memcpy(&x, p, sizeof x);
    return x;
}
static inline void vstore(float* p, vf x) { std::memcpy(p, &x, sizeof x); }
static inline vf splat(float x) { return vf{} + x; }

static inline vf fma(vf a, vf b, vf c) {  // a * b + c, one rounding where the CPU has FMA
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__FMA__)
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    return a * b + c;
#endif
}

// exp_nonpositive over the lanes
static inline vf vexp(vf x) {
    x = x < -87.f ? splat(-87.f) : x;
    const vf y = x * 1.44269504088896341f + 0.5f;
    vf n = __builtin_convertvector(__builtin_convertvector(y, vi), vf);
    n = n > y ? n - 1.f : n;  // floor (the conversion truncates toward 0)
    vf r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    vf p = splat(1.9875691500e-4f);
    p = fma(p, r, splat(1.3981999507e-3f));
    p = fma(p, r, splat(8.3334519073e-3f));
    p = fma(p, r, splat(4.1665795894e-2f));
    p = fma(p, r, splat(1.6666665459e-1f));
    p = fma(p, r, splat(5.0000001201e-1f));
    p = fma(p, r * r, r + 1.f);
    const vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)bits;
}

// f(std::integral_constant<int, n>) for 0 < n <= MAX: the row vectors left after the full passes
// go through in one pass too (the default 96 rows are 6 vectors of 16: one at a time, a pass's few
// accumulators leave the FMA units waiting on each other). Each row's sums are the same whichever
// pass it is in.
template <int MAX, typename F>
static inline void with_rows(int64_t n, F&& f) {
    if constexpr (MAX > 0) {
        if (n == MAX) return f(std::integral_constant<int, MAX>{});
        with_rows<MAX - 1>(n, f);
    }
}

// Scores of keys j and j + 1 (each query load serves both) for NG row vectors from g0:
// st[j][rows] = sum_d qt[d][rows] * key_j[d]. qt: [D][W]; st: [keys][W].
template <int NG, typename T>
static inline void score_pair(const float* qt, int64_t W, int64_t g0, const T* k0, const T* k1,
                              int64_t D, float* s0, float* s1) {
    vf a[NG], b[NG];
    for (int g = 0; g < NG; ++g) a[g] = b[g] = vf{};
    for (int64_t d = 0; d < D; ++d) {
        const vf x0 = splat(load(k0, d)), x1 = splat(load(k1, d));
        for (int g = 0; g < NG; ++g) {
            const vf q = vload(qt + d * W + (g0 + g) * VL);
            a[g] = fma(q, x0, a[g]);
            b[g] = fma(q, x1, b[g]);
        }
    }
    for (int g = 0; g < NG; ++g) {
        vstore(s0 + (g0 + g) * VL, a[g]);
        vstore(s1 + (g0 + g) * VL, b[g]);
    }
}

template <typename T>
static void block_scores(const float* qt, int64_t W, const T* block, int64_t nk, int64_t D,
                         float* st, float* spare) {
    const int64_t ng = W / VL;
    for (int64_t j = 0; j < nk; j += 2) {
        const T* k0 = block + j * D;
        const bool pair = j + 1 < nk;  // (an odd last key is scored twice, kept once)
        const T* k1 = pair ? k0 + D : k0;
        float* s0 = st + j * W;
        float* s1 = pair ? s0 + W : spare;
        int64_t g0 = 0;
        for (; g0 + SCORE_ROWS <= ng; g0 += SCORE_ROWS)
            score_pair<SCORE_ROWS>(qt, W, g0, k0, k1, D, s0, s1);
        with_rows<SCORE_ROWS - 1>(ng - g0, [&](auto rows) {
            score_pair<decltype(rows)::value>(qt, W, g0, k0, k1, D, s0, s1);
        });
    }
}

// acct[d][rows] = acct[d][rows] * alpha[rows] + sum_j p[j][rows] * value_j[d] for DB elements
// of d and NG row vectors at a time: their accumulators stay in registers over the keys.
template <int NG, typename T>
static inline void value_pass(const float* p, int64_t W, int64_t g0, const T* block, int64_t nk,
                              int64_t D, int64_t d0, const float* alpha, float* acct) {
    vf a[DB][NG];
    for (int g = 0; g < NG; ++g) {
        const vf scale = vload(alpha + (g0 + g) * VL);
        for (int e = 0; e < DB; ++e) a[e][g] = vload(acct + (d0 + e) * W + (g0 + g) * VL) * scale;
    }
    for (int64_t j = 0; j < nk; ++j) {
        vf w[NG];
        for (int g = 0; g < NG; ++g) w[g] = vload(p + j * W + (g0 + g) * VL);
        for (int e = 0; e < DB; ++e) {
            const vf x = splat(load(block + j * D, d0 + e));
            for (int g = 0; g < NG; ++g) a[e][g] = fma(w[g], x, a[e][g]);
        }
    }
    for (int e = 0; e < DB; ++e)
        for (int g = 0; g < NG; ++g) vstore(acct + (d0 + e) * W + (g0 + g) * VL, a[e][g]);
}

template <typename T>
static void block_values(const float* p, int64_t W, const T* block, int64_t nk, int64_t D,
                         const float* alpha, float* acct) {
    const int64_t ng = W / VL;
    for (int64_t d0 = 0; d0 < D; d0 += DB) {
        int64_t g0 = 0;
        for (; g0 + VALUE_ROWS <= ng; g0 += VALUE_ROWS)
            value_pass<VALUE_ROWS>(p, W, g0, block, nk, D, d0, alpha, acct);
        with_rows<VALUE_ROWS - 1>(ng - g0, [&](auto rows) {
            value_pass<decltype(rows)::value>(p, W, g0, block, nk, D, d0, alpha, acct);
        });
    }
}

struct Buffers {
    std::vector<float> qt, st, acct, m, l, alpha, spare;
    std::vector<int32_t> limit;
};

// One item: tokens t0..t0+nt-1 of a chunk whose first token is at position `start`, KV head h.
// q, out: the chunk's first token's [KVH, G, D]; k, v: KV head h's part of block 0; for an 8-bit
// C, ks, vs: KV head h's scales in block 0 (a block's are KVH BS apart).
template <typename T, typename C = T>
static void attend_tile(const T* q, const C* k, const C* v, const Pages& pages, int64_t start,
                        int64_t t0, int64_t nt, int64_t KVH, int64_t G, int64_t D, int64_t h,
                        float scale, Buffers& buf, T* out, const c10::Half* ks = nullptr,
                        const c10::Half* vs = nullptr) {
    const int64_t R = nt * G, W = (R + VL - 1) / VL * VL, BS = pages.BS;
    buf.qt.assign(D * W, 0.f);
    buf.acct.assign(D * W, 0.f);
    buf.st.resize(BS * W);
    buf.spare.resize(W);
    buf.m.assign(W, -INFINITY);
    buf.l.assign(W, 0.f);
    buf.alpha.resize(W);
    buf.limit.assign(W, 0);
    for (int64_t r = 0; r < R; ++r) {
        const int64_t t = t0 + r / G, g = r % G;
        const T* row = q + (t * KVH + h) * G * D + g * D;
        for (int64_t d = 0; d < D; ++d) buf.qt[d * W + r] = load(row, d) * scale;
        buf.limit[r] = int32_t(start + t + 1);  // keys it sees
    }
    const int64_t end = start + t0 + nt;  // keys the last row sees
    for (int64_t kb = 0, b = 0; kb < end; kb += BS, ++b) {
        const int64_t nk = std::min(BS, end - kb);
        const C* kblk = k + pages.table[b] * pages.stride;
        const C* vblk = v + pages.table[b] * pages.stride;
        block_scores(buf.qt.data(), W, kblk, nk, D, buf.st.data(), buf.spare.data());
        const c10::Half* vscales = nullptr;  // the block's values' scales (8-bit)
        if constexpr (is_kv8<C>) {
            const c10::Half* kscales = ks + pages.table[b] * KVH * BS;
            vscales = vs + pages.table[b] * KVH * BS;
            for (int64_t j = 0; j < nk; ++j) {
                const vf key_scale = splat(load(kscales, j));
                for (int64_t g = 0; g < W; g += VL) {
                    float* s = buf.st.data() + j * W + g;
                    vstore(s, vload(s) * key_scale);
                }
            }
        }
        for (int64_t g = 0; g < W; g += VL) {
            vi limit;
            std::memcpy(&limit, buf.limit.data() + g, sizeof limit);
            const vf old = vload(buf.m.data() + g);
            vf top = old;
            for (int64_t j = 0; j < nk; ++j) {  // a row sees key kb + j if kb + j < its limit
                const vf s = vload(buf.st.data() + j * W + g);
                top = ((limit > int32_t(kb + j)) & (s > top)) ? s : top;
            }
            // (a row with no key yet has old = -inf: alpha is about 0, as its sums are)
            const vf alpha = vexp(old - top);
            vf sum = vload(buf.l.data() + g) * alpha;
            for (int64_t j = 0; j < nk; ++j) {
                float* s = buf.st.data() + j * W + g;
                const vf e = vexp(vload(s) - top);
                const vf p = limit > int32_t(kb + j) ? e : vf{};
                if constexpr (is_kv8<C>) {
                    vstore(s, p * load(vscales, j));  // the value loop weighs value * scale
                } else {
                    vstore(s, p);
                }
                sum += p;
            }
            vstore(buf.m.data() + g, top);
            vstore(buf.l.data() + g, sum);
            vstore(buf.alpha.data() + g, alpha);
        }
        block_values(buf.st.data(), W, vblk, nk, D, buf.alpha.data(), buf.acct.data());
    }
    for (int64_t r = 0; r < R; ++r) {
        const int64_t t = t0 + r / G, g = r % G;
        T* row = out + (t * KVH + h) * G * D + g * D;
        const float inv = 1.f / buf.l[r];
        for (int64_t d = 0; d < D; ++d) store(row, d, buf.acct[d * W + r] * inv);
    }
}

// q, out: [N, KVH, G, D], the chunks' tokens one after another; k, v: [NB, KVH, BS, D] (of
// element E: T, or 8-bit with scales k_scale, v_scale [NB, KVH, BS]); tables: [C, MAXB]; starts,
// firsts, counts: [C] (a chunk's first position, its first row of q, its tokens). Items are
// (chunk, KV head, tile of about 96 rows), the costliest first, each taken by the next free thread.
template <typename T, typename E = T>
static void run(const T* q, const E* k, const E* v, const int64_t* tables, const int64_t* starts,
                const int64_t* firsts, const int64_t* counts, T* out, int64_t C, int64_t KVH,
                int64_t G, int64_t D, int64_t BS, int64_t MAXB, float scale,
                const c10::Half* k_scale = nullptr, const c10::Half* v_scale = nullptr) {
    const int64_t tile = std::max<int64_t>(1, 96 / G);
    struct Item {
        int64_t chunk, head, t0, nt, cost;
    };
    std::vector<Item> items;
    for (int64_t c = 0; c < C; ++c)
        for (int64_t t0 = 0; t0 < counts[c]; t0 += tile)
            for (int64_t h = 0; h < KVH; ++h) {
                const int64_t nt = std::min(tile, counts[c] - t0);
                items.push_back({c, h, t0, nt, nt * (starts[c] + t0 + nt)});
            }
    std::stable_sort(items.begin(), items.end(),
                     [](const Item& a, const Item& b) { return a.cost > b.cost; });
    std::atomic<int64_t> next{0};
    const int64_t n = int64_t(items.size());
    at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
        Buffers buf;
        for (int64_t i = next++; i < n; i = next++) {
            const Item& it = items[i];
            const Pages pages{tables + it.chunk * MAXB, KVH * BS * D, BS};
            const int64_t first = firsts[it.chunk] * KVH * G * D;
            const int64_t head = it.head * BS;  // KV head h's part of block 0: its scales
            attend_tile(q + first, k + head * D, v + head * D, pages, starts[it.chunk], it.t0,
                        it.nt, KVH, G, D, it.head, scale, buf, out + first,
                        k_scale ? k_scale + head : nullptr, v_scale ? v_scale + head : nullptr);
        }
    });
}

}  // namespace prompt

bool prompt_attention_available(int64_t head_dim) { return head_dim % prompt::DB == 0; }

// a bad table or span fails here, not as a stray read
static void check_chunks(const torch::Tensor& q, const torch::Tensor& k,
                         const torch::Tensor& block_tables, const torch::Tensor& starts,
                         const torch::Tensor& firsts, const torch::Tensor& counts) {
    const int64_t N = q.size(0), D = q.size(3);
    const int64_t NB = k.size(0), BS = k.size(2);
    TORCH_CHECK(prompt_attention_available(D), "no prompt-attention kernel for head dim ", D);
    const int64_t C = starts.numel();
    TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == C &&
                    block_tables.is_contiguous() && starts.is_contiguous() &&
                    firsts.is_contiguous() && counts.is_contiguous() && firsts.numel() == C &&
                    counts.numel() == C,
                "block_tables [C, MAXB], starts, firsts and counts [C] contiguous expected");
    const int64_t MAXB = block_tables.size(1);
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* s = starts.data_ptr<int64_t>();
    const int64_t* f = firsts.data_ptr<int64_t>();
    const int64_t* n = counts.data_ptr<int64_t>();
    for (int64_t c = 0; c < C; ++c) {
        TORCH_CHECK(s[c] >= 0 && n[c] >= 0 && f[c] >= 0 && f[c] + n[c] <= N &&
                        s[c] + n[c] <= MAXB * BS,
                    "chunk ", c, " does not fit its block table or the batch");
        for (int64_t i = 0; i * BS < s[c] + n[c]; ++i)
            TORCH_CHECK(tables[c * MAXB + i] >= 0 && tables[c * MAXB + i] < NB, "block ",
                        tables[c * MAXB + i], " of chunk ", c, " outside the pool of ", NB);
    }
}

torch::Tensor prompt_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                               torch::Tensor block_tables, torch::Tensor starts,
                               torch::Tensor firsts, torch::Tensor counts, double scale) {
    check_paged_qkv(q, k, v);
    check_chunks(q, k, block_tables, starts, firsts, counts);
    const int64_t KVH = q.size(1), G = q.size(2), D = q.size(3);
    const int64_t BS = k.size(2), C = starts.numel(), MAXB = block_tables.size(1);
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* s = starts.data_ptr<int64_t>();
    const int64_t* f = firsts.data_ptr<int64_t>();
    const int64_t* n = counts.data_ptr<int64_t>();
    auto out = torch::empty_like(q);
    if (q.scalar_type() == torch::kFloat) {
        prompt::run<float>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), tables,
                           s, f, n, out.data_ptr<float>(), C, KVH, G, D, BS, MAXB, float(scale));
    } else {
        prompt::run<uint16_t>(ptr<uint16_t>(q), ptr<uint16_t>(k), ptr<uint16_t>(v), tables, s, f,
                              n, ptr<uint16_t>(out), C, KVH, G, D, BS, MAXB, float(scale));
    }
    return out;
}

torch::Tensor prompt_attention_kv8(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                   torch::Tensor k_scale, torch::Tensor v_scale,
                                   torch::Tensor block_tables, torch::Tensor starts,
                                   torch::Tensor firsts, torch::Tensor counts, double scale) {
    check_paged_kv8(q, k, v, k_scale, v_scale);
    check_chunks(q, k, block_tables, starts, firsts, counts);
    const int64_t KVH = q.size(1), G = q.size(2), D = q.size(3);
    const int64_t BS = k.size(2), C = starts.numel(), MAXB = block_tables.size(1);
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t* s = starts.data_ptr<int64_t>();
    const int64_t* f = firsts.data_ptr<int64_t>();
    const int64_t* n = counts.data_ptr<int64_t>();
    auto out = torch::empty_like(q);
    with_kv8_types(q, k, [&](auto t, auto e) {
        using T = decltype(t);
        using E = decltype(e);
        prompt::run<T, E>(ptr<T>(q), ptr<E>(k), ptr<E>(v), tables, s, f, n, ptr<T>(out), C, KVH,
                          G, D, BS, MAXB, float(scale), ptr<c10::Half>(k_scale),
                          ptr<c10::Half>(v_scale));
    });
    return out;
}
