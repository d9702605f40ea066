// A step's LoRA updates of one fused projection: every token's low-rank update by its adapter's
// slot, added to the projection's output in one call.
//
// The torch form (`LoraBatch.add` in workers/lora.py) is a dozen ops a projection: a grid of the
// step's tokens by slot, two batched matmuls, a gather and a scatter; with 30 layers of 4
// projections, a decode step spent more in dispatches and thread forks than in the adapters'
// bytes. Here one parallel loop computes each token's `low = A x` over its slot's bands, a second
// adds `B low` to its output, reading a slot's A rows and B columns once for all of its tokens,
// and only each module's own rank (an adapter's rank below the slots' width, or a module it does
// not adapt, reads nothing). Each token's sums run in an order that depends on it alone, with fused
// multiply-adds (the rest of the kernels round as the eager ops do; an adapter's update has no
// eager twin to match bit for bit).
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common.h"
#include "kernels.h"

// the dots of 4 rows of a (row r at a + r * lda) with x[0..n), in fp32 into out[0..4): each row's
// 16 partial sums (one vector), added in a fixed order; x read once for the 4
template <typename W, typename T>
static inline void dot4(const W* a, int64_t lda, const T* x, int64_t n, float* out) {
    float acc[4][16] = {};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
        float xs[16];
#pragma omp simd
        for (int l = 0; l < 16; ++l) xs[l] = load(x, i + l);
        for (int r = 0; r < 4; ++r) {
            const W* row = a + r * lda + i;
#pragma omp simd
            for (int l = 0; l < 16; ++l)
                acc[r][l] = __builtin_fmaf(load(row, l), xs[l], acc[r][l]);
        }
    }
    for (int r = 0; r < 4; ++r) {
        float sum = 0.f;
        for (int l = 0; l < 16; ++l) sum += acc[r][l];
        for (int64_t j = i; j < n; ++j) sum += load(a + r * lda, j) * load(x, j);
        out[r] = sum;
    }
}

// one row's dot, in the same order as dot4's
template <typename W, typename T> static inline float dot(const W* a, const T* x, int64_t n) {
    float acc[16] = {0.f};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
#pragma omp simd
        for (int l = 0; l < 16; ++l)
            acc[l] = __builtin_fmaf(load(a, i + l), load(x, i + l), acc[l]);
    }
    float sum = 0.f;
    for (int l = 0; l < 16; ++l) sum += acc[l];
    for (; i < n; ++i) sum += load(a, i) * load(x, i);
    return sum;
}

// out [N, O] += each token's update: token n of slot s = slot_of[n] (-1: none) gains, for each
// module m (output columns firsts[m]..firsts[m+1]), B[s, :r, cols] . (A[s, m R : m R + r] x[n]),
// r = ranks[s, m]. a [S, M R, I], b [S, R, O]: the activations' dtype (T), or another (W: fp32
// adapters on a bf16 model, bf16 adapters on an fp32 one).
template <typename T, typename W>
static void lora_add_run(T* out, const T* x, const W* a, const W* b, const int64_t* slot_of,
                         const int64_t* ranks, const int64_t* firsts, int64_t N, int64_t I,
                         int64_t O, int64_t S, int64_t M, int64_t R) {
    std::vector<std::vector<int64_t>> tokens(S);  // each slot's tokens
    for (int64_t n = 0; n < N; ++n) {
        const int64_t s = slot_of[n];
        TORCH_CHECK(s < S, "LoRA slot ", s, " of ", S);
        if (s >= 0) tokens[s].push_back(n);
    }
    std::vector<int64_t> live;  // the slots with tokens
    for (int64_t s = 0; s < S; ++s)
        if (!tokens[s].empty()) live.push_back(s);
    const int64_t MR = M * R;
    std::vector<float> low(N * MR, 0.f);  // [N, M R]

    // low = A x: a task is (slot, module, 4 of its rank's rows), for all of the slot's tokens
    constexpr int64_t ROWS = 4;
    const int64_t row_blocks = (R + ROWS - 1) / ROWS;
    const int64_t num_low = int64_t(live.size()) * M * row_blocks;
    at::parallel_for(0, num_low, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t s = live[task / (M * row_blocks)];
            const int64_t m = task / row_blocks % M;
            const int64_t k0 = task % row_blocks * ROWS;
            const int64_t k1 = std::min(k0 + ROWS, ranks[s * M + m]);
            if (k1 <= k0) continue;
            const W* rows = a + (s * MR + m * R + k0) * I;
            for (const int64_t n : tokens[s]) {
                float* into = low.data() + n * MR + m * R;
                if (k0 + ROWS <= R) {  // (rows past the rank are zeros: computed, not kept)
                    float dots[ROWS];
                    dot4(rows, I, x + n * I, I, dots);
                    for (int64_t k = k0; k < k1; ++k) into[k] = dots[k - k0];
                } else {
                    for (int64_t k = k0; k < k1; ++k)
                        into[k] = dot(rows + (k - k0) * I, x + n * I, I);
                }
            }
        }
    });

    // out += B low: a task is (slot, up to 64 columns of one module), for all of the slot's tokens
    constexpr int64_t COLS = 64;
    std::vector<int64_t> chunk_starts, chunk_modules;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t c = firsts[m]; c < firsts[m + 1]; c += COLS) {
            chunk_starts.push_back(c);
            chunk_modules.push_back(m);
        }
    const int64_t num_chunks = int64_t(chunk_starts.size());
    at::parallel_for(0, int64_t(live.size()) * num_chunks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t s = live[task / num_chunks];
            const int64_t m = chunk_modules[task % num_chunks];
            const int64_t c0 = chunk_starts[task % num_chunks];
            const int64_t width = std::min(COLS, firsts[m + 1] - c0);
            const int64_t r = ranks[s * M + m];
            if (r == 0) continue;
            for (const int64_t n : tokens[s]) {
                float update[COLS] = {0.f};
                for (int64_t k = 0; k < r; ++k) {
                    const float l = low[n * MR + m * R + k];
                    const W* row = b + (s * R + k) * O + c0;
#pragma omp simd
                    for (int64_t c = 0; c < width; ++c)
                        update[c] = __builtin_fmaf(l, load(row, c), update[c]);
                }
                T* o = out + n * O + c0;
#pragma omp simd
                for (int64_t c = 0; c < width; ++c) store(o, c, load(o, c) + update[c]);
            }
        }
    });
}

template <typename T>
static void lora_add_as(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor b,
                        const int64_t* slot_of, const int64_t* ranks, const int64_t* firsts,
                        int64_t S, int64_t M, int64_t R) {
    const int64_t N = x.size(0), I = x.size(1), O = out.size(1);
    if (a.scalar_type() == torch::kFloat32)
        lora_add_run(ptr<T>(out), ptr<T>(x), ptr<float>(a), ptr<float>(b), slot_of, ranks, firsts,
                     N, I, O, S, M, R);
    else
        lora_add_run(ptr<T>(out), ptr<T>(x), ptr<uint16_t>(a), ptr<uint16_t>(b), slot_of, ranks,
                     firsts, N, I, O, S, M, R);
}

void lora_add(torch::Tensor out, torch::Tensor x, torch::Tensor a, torch::Tensor b,
              torch::Tensor slot_of, torch::Tensor ranks, torch::Tensor firsts) {
    TORCH_CHECK(out.is_contiguous() && x.is_contiguous() && a.is_contiguous() &&
                    b.is_contiguous() && slot_of.is_contiguous() && ranks.is_contiguous() &&
                    firsts.is_contiguous(),
                "lora_add: tensors must be contiguous");
    const auto floats = [](const torch::Tensor& t) {
        return t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16;
    };
    TORCH_CHECK(out.scalar_type() == x.scalar_type() && a.scalar_type() == b.scalar_type() &&
                    floats(x) && floats(a),
                "lora_add: activations and adapters each in fp32 or bf16");
    TORCH_CHECK(slot_of.scalar_type() == torch::kInt64 && ranks.scalar_type() == torch::kInt64 &&
                    firsts.scalar_type() == torch::kInt64,
                "lora_add: int64 indices");
    const int64_t N = x.size(0), I = x.size(1), O = out.size(1);
    const int64_t S = a.size(0), M = ranks.size(1), R = b.size(1);
    TORCH_CHECK(out.size(0) == N && slot_of.size(0) == N && a.size(1) == M * R &&
                    a.size(2) == I && b.size(0) == S && b.size(2) == O && ranks.size(0) == S &&
                    firsts.size(0) == M + 1 && ptr<int64_t>(firsts)[M] == O,
                "lora_add: shapes disagree");
    const int64_t* rk = ptr<int64_t>(ranks);
    for (int64_t i = 0; i < S * M; ++i) TORCH_CHECK(rk[i] >= 0 && rk[i] <= R, "lora_add: rank");
    if (x.scalar_type() == torch::kFloat32)
        lora_add_as<float>(out, x, a, b, ptr<int64_t>(slot_of), rk, ptr<int64_t>(firsts), S, M, R);
    else
        lora_add_as<uint16_t>(out, x, a, b, ptr<int64_t>(slot_of), rk, ptr<int64_t>(firsts), S, M,
                              R);
}
