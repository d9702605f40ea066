// The packed-weight matmul `x @ W.T + b`, fp32 on AVX-512 and AVX2 (one source) and bf16 on
// AVX512-BF16.
//
// The weight is packed once into panels of 64 output columns, `[ceil(N / 64), K, 64]`
// (`kernels.linear` does it in torch and keeps the result beside the weight). On AVX-512 a 6 x 64
// tile of the output accumulates in 24 registers while its panel streams through in order: per k,
// 4 loads and up to 6 broadcasts feed 24 FMAs. AVX2 has 16 registers of 8 lanes: a tile is 3 x 32
// (12 accumulators), each panel two tiles wide. The fp32 tile is written once in GCC's vector
// extensions (`vf`, 16 or 8 lanes), as the prompt-attention kernel is. MKL's sgemm, called per
// step, is far from the FMA peak at decode's few rows (most likely it re-packs the weight each
// call): measured on one thread against F.linear, 1.4-3x faster at 4-32 rows and 1.1-1.2x at
// 64-256 (AVX-512). Each output is the same K products summed in k order by fused multiply-adds,
// so the fp32 results are the same bits on AVX-512 and AVX2, and differ from MKL's only by
// summation order.
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "common.h"
#include "kernels.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PDSERVE_GEMM_FP32 1
namespace gemm {
#if defined(__AVX512F__)
constexpr int VL = 16, MAX_ROWS = 6;  // lanes; rows per tile: 24 accumulators of 32 registers
#else
constexpr int VL = 8, MAX_ROWS = 3;  // 12 accumulators of 16 registers
#endif
constexpr int NV = 4;               // vectors per tile row
constexpr int WIDTH = NV * VL;      // columns per tile: 64 or 32
typedef float vf __attribute__((vector_size(VL * 4)));

static inline vf vload(const float* p) {
    vf v;
    std::memcpy(&v, p, sizeof v);
    return v;
}

static inline vf fma(vf a, vf b, vf c) {  // a * b + c, one rounding
#if defined(__AVX512F__)
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#else
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#endif
}

// out[i][0..num_cols) = x[i] . panel[:, c] + bias for MR rows and the WIDTH columns of a panel
// from `panel` (its row stride 64) on
template <int MR>
static inline void tile(const float* x, int64_t K, const float* panel, const float* bias,
                        float* out, int64_t ldo, int64_t num_cols) {
    vf acc[MR][NV];
    for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NV; ++j) acc[i][j] = vf{};
    for (int64_t k = 0; k < K; ++k) {
        const float* p = panel + k * 64;
        vf w[NV];
        for (int j = 0; j < NV; ++j) w[j] = vload(p + VL * j);
        for (int i = 0; i < MR; ++i) {
            const vf xb = vf{} + x[i * K + k];
            for (int j = 0; j < NV; ++j) acc[i][j] = fma(xb, w[j], acc[i][j]);
        }
    }
    for (int i = 0; i < MR; ++i) {
        float sums[WIDTH];
        std::memcpy(sums, acc[i], sizeof sums);
        for (int64_t c = 0; c < std::min<int64_t>(WIDTH, num_cols); ++c)
            out[i * ldo + c] = sums[c] + (bias != nullptr ? bias[c] : 0.f);
    }
}

// a panel's 64 columns as its tiles (one on AVX-512, two on AVX2)
template <int MR>
static inline void panel_tiles(const float* x, int64_t K, const float* panel, const float* bias,
                               float* out, int64_t ldo, int64_t num_cols) {
    for (int64_t c = 0; c < num_cols; c += WIDTH)
        tile<MR>(x, K, panel + c, bias != nullptr ? bias + c : nullptr, out + c, ldo,
                 num_cols - c);
}
}  // namespace gemm
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
#elif defined(PDSERVE_GEMM_FP32)
    return !bf16;
#else
    return false;
#endif
}

// The tiles of one (panel, row block) work item, `rows` at a time.
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

#define PDSERVE_TILE_SWITCH3(fn, r, ...)                                        \
    switch (r) {                                                                \
        case 1: fn<1>(__VA_ARGS__); break;                                      \
        case 2: fn<2>(__VA_ARGS__); break;                                      \
        default: fn<3>(__VA_ARGS__); break;                                     \
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
#if defined(PDSERVE_GEMM_FP32) && !defined(__AVX512F__)
    const int64_t max_rows = bf16 ? 6 : gemm::MAX_ROWS;
#else
    const int64_t max_rows = 6;
#endif
    const int64_t tiles = (M + max_rows - 1) / max_rows,
                  rows = (M + tiles - 1) / tiles;  // rows per tile: even, at most max_rows
    const int64_t block = rows * 8, num_blocks = (M + block - 1) / block;
    at::parallel_for(0, P * num_blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t p = item / num_blocks, first = (item % num_blocks) * block;
            const int64_t last = std::min(M, first + block),
                          num_cols = std::min<int64_t>(64, N - p * 64);
            if (!bf16) {
#if defined(PDSERVE_GEMM_FP32)
                const float* b = bias ? bias->data_ptr<float>() + p * 64 : nullptr;
                gemm_rows(x.data_ptr<float>(), K, packed.data_ptr<float>() + p * K * 64, b,
                          out.data_ptr<float>() + p * 64, N, first, last, rows, num_cols,
                          [&](int64_t r, const float* xs, const float* pan, const float* bb,
                              float* o, int64_t c) {
#if defined(__AVX512F__)
                              PDSERVE_TILE_SWITCH(gemm::panel_tiles, r, xs, K, pan, bb, o, N, c)
#else
                              PDSERVE_TILE_SWITCH3(gemm::panel_tiles, r, xs, K, pan, bb, o, N, c)
#endif
                          });
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
