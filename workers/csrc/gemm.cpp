// The packed-weight matmul `x @ W.T + b`, fp32 on AVX-512 and bf16 on AVX512-BF16.
//
// The weight is packed once into panels of 64 output columns, `[ceil(N / 64), K, 64]`
// (`kernels.linear` does it in torch and keeps the result beside the weight), so a 6 x 64 tile of
// the output accumulates in 24 registers while its panel streams through in order: per k, 4 loads
// and up to 6 broadcasts feed 24 FMAs. MKL's sgemm, called per step, is far from the FMA peak at
// decode's few rows (most likely it re-packs the weight each call): measured on one thread against
// F.linear, 1.4-3x faster at 4-32 rows and 1.1-1.2x at 64-256. Each output is the same K products
// summed in k order, so fp32 results differ from MKL's only by summation order.
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#include "common.h"
#include "kernels.h"

#if defined(__AVX512F__)
template <int MR>
static inline void gemm_tile(const float* x, int64_t K, const float* panel, const float* bias,
                             float* out, int64_t ldo, int64_t num_cols) {
    __m512 acc[MR][4];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const float* p = panel + k * 64;
        const __m512 w0 = _mm512_loadu_ps(p), w1 = _mm512_loadu_ps(p + 16);
        const __m512 w2 = _mm512_loadu_ps(p + 32), w3 = _mm512_loadu_ps(p + 48);
        for (int i = 0; i < MR; ++i) {
            const __m512 xb = _mm512_set1_ps(x[i * K + k]);
            acc[i][0] = _mm512_fmadd_ps(xb, w0, acc[i][0]);
            acc[i][1] = _mm512_fmadd_ps(xb, w1, acc[i][1]);
            acc[i][2] = _mm512_fmadd_ps(xb, w2, acc[i][2]);
            acc[i][3] = _mm512_fmadd_ps(xb, w3, acc[i][3]);
        }
    }
    for (int j = 0; j < 4 && 16 * j < num_cols; ++j) {
        const __mmask16 m = tail(16 * j, num_cols);
        const __m512 b =
            bias != nullptr ? _mm512_maskz_loadu_ps(m, bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < MR; ++i)
            _mm512_mask_storeu_ps(out + i * ldo + 16 * j, m, _mm512_add_ps(acc[i][j], b));
    }
}
#endif

#if defined(__AVX512BF16__)
// gemm_tile for bf16: the panel is [K / 2, 64, 2] (k pairs side by side), each VDPBF16PS multiplies
// 16 columns by a pair of k at once into fp32 sums, as oneDNN's bf16 matmul does on this ISA; the
// output rounds to bf16.
template <int MR>
static inline void gemm_tile_bf16(const uint16_t* x, int64_t K, const uint16_t* panel,
                                  const uint16_t* bias, uint16_t* out, int64_t ldo,
                                  int64_t num_cols) {
    __m512 acc[MR][4];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < 4; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2) {
        const uint16_t* p = panel + k * 64;
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(p),
                       w1 = (__m512bh)_mm512_loadu_si512(p + 32);
        const __m512bh w2 = (__m512bh)_mm512_loadu_si512(p + 64),
                       w3 = (__m512bh)_mm512_loadu_si512(p + 96);
        for (int i = 0; i < MR; ++i) {
            uint32_t pair;
            std::memcpy(&pair, x + i * K + k, 4);
            const __m512bh xb = (__m512bh)_mm512_set1_epi32(int(pair));
            acc[i][0] = _mm512_dpbf16_ps(acc[i][0], xb, w0);
            acc[i][1] = _mm512_dpbf16_ps(acc[i][1], xb, w1);
            acc[i][2] = _mm512_dpbf16_ps(acc[i][2], xb, w2);
            acc[i][3] = _mm512_dpbf16_ps(acc[i][3], xb, w3);
        }
    }
    for (int j = 0; j < 4 && 16 * j < num_cols; ++j) {
        const __mmask16 m = tail(16 * j, num_cols);
        const __m512i bias_bits =
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(bias ? m : 0, bias + 16 * j));
        const __m512 b = _mm512_castsi512_ps(_mm512_slli_epi32(bias_bits, 16));  // 0 without a bias
        for (int i = 0; i < MR; ++i) {
            const __m512 sum = rounded16<uint16_t>(_mm512_add_ps(acc[i][j], b));
            const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(sum), 16);
            _mm256_mask_storeu_epi16(out + i * ldo + 16 * j, m, _mm512_cvtepi32_epi16(top));
        }
    }
}
#endif

// AMX tiles on this CPU: torch's bf16 matmul (oneDNN) multiplies 4-7x faster than the packed one
bool amx_bf16() {
#if defined(__AMX_BF16__)
    return true;
#else
    return false;
#endif
}

bool packed_linear_available(bool bf16) {
#if defined(__AVX512BF16__)
    return true;
#elif defined(__AVX512F__)
    return !bf16;
#else
    return false;
#endif
}

// The tiles of one (panel, row block) work item, `rows` at a time (at most 6).
template <typename T, typename Tile>
static void gemm_rows(const T* x, int64_t K, const T* panel, const T* bias, T* out, int64_t N,
                      int64_t first, int64_t last, int64_t rows, int64_t num_cols, Tile tile) {
    for (int64_t m = first; m < last; m += rows)
        tile(std::min(rows, last - m), x + m * K, panel, bias, out + m * N, num_cols);
}

#define PDSERVE_TILE_SWITCH(fn, r, ...)                                         \
    switch (r) {                                                                \
        case 1: fn<1>(__VA_ARGS__); break;                                      \
        case 2: fn<2>(__VA_ARGS__); break;                                      \
        case 3: fn<3>(__VA_ARGS__); break;                                      \
        case 4: fn<4>(__VA_ARGS__); break;                                      \
        case 5: fn<5>(__VA_ARGS__); break;                                      \
        default: fn<6>(__VA_ARGS__); break;                                     \
    }

// x: [M, K] contiguous, fp32 or bf16; packed: the weight in 64-column panels, K * 64 values each
// (fp32: [P, K, 64]; bf16: [P, K / 2, 64, 2]); bias: [N] or none -> [M, N] in x's dtype. Work items
// are (panel, block of up to 48 rows), panel-major, so a thread keeps a panel in its L2 across the
// row blocks it takes.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed,
                            std::optional<torch::Tensor> bias, int64_t N) {
    const bool bf16 = x.scalar_type() == torch::kBFloat16;
    TORCH_CHECK(packed_linear_available(bf16), "no packed_linear for this dtype on this CPU");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous(),
                "contiguous [M, K] input expected");
    TORCH_CHECK(packed.scalar_type() == x.scalar_type() &&
                    (bf16 || x.scalar_type() == torch::kFloat),
                "dtypes");
    const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
    TORCH_CHECK(packed.numel() == P * K * 64 && P * 64 >= N && (!bf16 || K % 2 == 0),
                "packed weight does not fit");
    auto out = torch::empty({M, N}, x.options());
    if (M == 0) return out;
    const int64_t tiles = (M + 5) / 6,
                  rows = (M + tiles - 1) / tiles; // rows per tile: even, at most 6
    const int64_t block = rows * 8, num_blocks = (M + block - 1) / block;
    at::parallel_for(0, P * num_blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t p = item / num_blocks, first = (item % num_blocks) * block;
            const int64_t last = std::min(M, first + block),
                          num_cols = std::min<int64_t>(64, N - p * 64);
            if (!bf16) {
#if defined(__AVX512F__)
                const float* b = bias ? bias->data_ptr<float>() + p * 64 : nullptr;
                gemm_rows(
                    x.data_ptr<float>(), K, packed.data_ptr<float>() + p * K * 64, b,
                    out.data_ptr<float>() + p * 64, N, first, last, rows, num_cols,
                    [&](int64_t r, const float* xs, const float* pan, const float* bb, float* o,
                        int64_t c) { PDSERVE_TILE_SWITCH(gemm_tile, r, xs, K, pan, bb, o, N, c) });
#endif
            } else {
#if defined(__AVX512BF16__)
                const uint16_t* b = bias ? ptr<uint16_t>(*bias) + p * 64 : nullptr;
                gemm_rows(ptr<uint16_t>(x), K, ptr<uint16_t>(packed) + p * K * 64, b,
                          ptr<uint16_t>(out) + p * 64, N, first, last, rows, num_cols,
                          [&](int64_t r, const uint16_t* xs, const uint16_t* pan,
                              const uint16_t* bb, uint16_t* o, int64_t c) {
                              PDSERVE_TILE_SWITCH(gemm_tile_bf16, r, xs, K, pan, bb, o, N, c)
                          });
#endif
            }
        }
    });
    return out;
}
