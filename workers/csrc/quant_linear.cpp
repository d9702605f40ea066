// The matmul `x @ W.T + b` over packed quantized weights: GGUF Q8_0, Q4_0, Q4_1, Q4_K, Q6_K and
// per-channel int8.
//
// As llama.cpp does it: each activation row is quantized per block of 32 to int8 with an fp32
// scale (its Q8_0 activations), each block's dot product is taken in integers and multiplied by
// the two scales. The weight (`workers/quantized.py` packs it once at load) lies in panels of 16
// output rows, `[P, K / 32, chunks, 16, 4]`: a chunk is 64 bytes, 4 consecutive k of each of the
// 16 rows (Q4: 8 k, the low nibbles k 0-3, the high ones k 4-7), so one 64-byte load feeds one
// VPDPBUSD per activation row with a broadcast of that row's 4 (or 8) k, and 16 int32 sums, one per
// weight row, come out with no horizontal add; each block's scales are 16 fp16 in a row. VPDPBUSD
// multiplies unsigned by signed bytes, so Q8_0 and int8 weights flip their sign bit (w + 128) and
// Q4_0 keeps its nibble (q, not q - 8): the block's sum of activation quants times 128 (or 8)
// starts the int32 sum negative instead. AVX2 takes 8 rows per register with VPMADDUBSW +
// VPMADDWD (a signed weight through VPSIGNB, as llama.cpp: VPMADDUBSW's int16 pairs overflow on a
// weight of 255); without AVX2, plain loops. The integer sums are exact and the float steps are the
// same fused multiply-adds in the same order on every path, so every path gives the same bits.
//
// The K-quants come re-laid as the formats above with fp32 scales (`workers/quantized.py`): Q4_K
// as Q4_1's nibbles with each block of 32's scale d * sc and min -dmin * m (exact in fp32), Q6_K as
// bytes q (0-63, for q - 32) with a scale d * sc per half block of 16: its two halves are summed
// apart, each starting from -32 times its half of the activations' block sum.
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>

#include "common.h"
#include "kernels.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define PDSERVE_QUANT_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PDSERVE_QUANT_AVX2 1
#endif

namespace {

// the weight formats, as `workers/quantized.py` numbers them
enum Format : int64_t { Q8_0 = 0, Q4_0 = 1, Q4_1 = 2, INT8 = 3, Q4_K = 4, Q6_K = 5 };
constexpr int64_t kBlock = 32;  // k per block (GGUF's, and the activations')
constexpr int64_t kPanel = 16;  // weight rows per panel

constexpr bool nibbles(int64_t f) { return f == Q4_0 || f == Q4_1 || f == Q4_K; }
// block scales in fp32 (the K-quants'), not fp16
constexpr bool fp32_scales(int64_t f) { return f == Q4_K || f == Q6_K; }
// a min added per block (q * d + m)
constexpr bool has_min(int64_t f) { return f == Q4_1 || f == Q4_K; }
// integer sums per block: Q6_K's two halves of 16 k, each with its own scale
constexpr int halves(int64_t f) { return f == Q6_K ? 2 : 1; }
// bytes of one panel's block: 16 rows x 32 k, one byte each or two nibbles to a byte
constexpr int64_t panel_block_bytes(int64_t f) { return nibbles(f) ? 256 : 512; }

// The activations as int8 blocks: x[m, k] ~ d[m, k / 32] * q[m, k]; sum: each block's sum of q;
// half: each half block's (16 k).
struct QuantRows {
    const int8_t* q;      // [M, K]
    const float* d;       // [M, K / 32]
    const int32_t* sum;   // [M, K / 32]
    const int32_t* half;  // [M, K / 16]
    int64_t K;
};

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* q, float* d, int32_t* sum,
                   int32_t* half) {
    const int64_t blocks = K / kBlock;
    at::parallel_for(0, M * blocks, 256, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const int64_t offset = (i / blocks) * K + (i % blocks) * kBlock;
            float amax = 0.f;
            for (int64_t j = 0; j < kBlock; ++j)
                amax = std::max(amax, std::fabs(load(x, offset + j)));
            const float inverse = amax > 0.f ? 127.f / amax : 0.f;
            int32_t halves[2] = {0, 0};
            for (int64_t j = 0; j < kBlock; ++j) {
                const float scaled = std::nearbyint(load(x, offset + j) * inverse);
                const int32_t v = int32_t(std::clamp(scaled, -127.f, 127.f));
                q[offset + j] = int8_t(v);
                halves[j / 16] += v;
            }
            d[i] = amax / 127.f;
            sum[i] = halves[0] + halves[1];
            half[2 * i] = halves[0];
            half[2 * i + 1] = halves[1];
        }
    });
}

inline float half_to_float(uint16_t bits) {
    return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline int32_t four_bytes(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// The weight of one call: panels of qs, block scales (and mins), or int8's per-row fp32 scales.
struct Panels {
    const uint8_t* qs;
    const uint16_t* scales;  // [P, KB, 16] fp16 bits (Q8_0, Q4_0, Q4_1)
    const uint16_t* mins;    // [P, KB, 16] fp16 bits (Q4_1)
    const float* row_scales; // [P, 16] (INT8)
    const float* fscales;    // [P, KB, 16] fp32 (Q4_K), [P, KB, 2, 16] (Q6_K)
    const float* fmins;      // [P, KB, 16] fp32 (Q4_K)
    int64_t blocks;          // KB
};

// The integer dot products' start: VPDPBUSD's unsigned weights carry +128 (Q8_0, int8), +8 (Q4_0,
// a nibble q for q - 8) or +32 (Q6_K) over the signed value, times the activations' block sum.
template <int64_t F>
constexpr int32_t unsigned_offset(bool sign_flipped) {
    if constexpr (F == Q4_0) return 8;
    if constexpr (F == Q6_K) return 32;
    if constexpr (F == Q4_1 || F == Q4_K) return 0;
    return sign_flipped ? 128 : 0;
}

// The start of half h's integer dot (the whole block's where a block has one sum).
template <int64_t F>
inline int32_t block_start(const QuantRows& a, int64_t row, int h, bool sign_flipped) {
    const int32_t sum = halves(F) == 2 ? a.half[2 * row + h] : a.sum[row];
    return -unsigned_offset<F>(sign_flipped) * sum;
}

// The float steps after each block's integer dot, the same on every path.
template <int64_t F>
inline float block_step(float acc, int32_t dot, float dw, float dx, float min, int32_t sum) {
    acc = std::fma(float(dot), F == INT8 ? dx : dw * dx, acc);
    if (has_min(F)) acc = std::fma(min, dx * float(sum), acc);
    return acc;
}

#if defined(PDSERVE_QUANT_VNNI)
constexpr int kRows = 4;    // activation rows per tile
constexpr int kPanels = 2;  // panels per tile

// out[i][16 p + r] for rows m0.. (MR of them) and panels p0.. (NP of them) of the weight
template <int64_t F, int MR, int NP>
void tile(const QuantRows& a, int64_t m0, const Panels& w, int64_t p0,
          float (*out)[kPanels * 16]) {
    constexpr int64_t bytes = panel_block_bytes(F);
    constexpr int H = halves(F);
    constexpr int chunks = 8 / H;  // byte formats: 64-byte chunks of 4 k per half
    const int64_t KB = w.blocks;
    __m512 acc[MR][NP];
    for (int i = 0; i < MR; ++i)
        for (int p = 0; p < NP; ++p) acc[i][p] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8(char(0x80));
    for (int64_t b = 0; b < KB; ++b) {
        const int8_t* x[MR];
        for (int i = 0; i < MR; ++i) x[i] = a.q + (m0 + i) * a.K + b * kBlock;
        const uint8_t* qs[NP];
        for (int p = 0; p < NP; ++p) qs[p] = w.qs + ((p0 + p) * KB + b) * bytes;
        for (int h = 0; h < H; ++h) {
            __m512i dot[MR][NP];
            for (int i = 0; i < MR; ++i) {
                const int64_t row = (m0 + i) * KB + b;
                const __m512i start = _mm512_set1_epi32(block_start<F>(a, row, h, true));
                for (int p = 0; p < NP; ++p) dot[i][p] = start;
            }
            if constexpr (nibbles(F)) {
                for (int c = 0; c < 4; ++c) {
                    __m512i lo[NP], hi[NP];
                    for (int p = 0; p < NP; ++p) {
                        const __m512i raw = _mm512_loadu_si512(qs[p] + 64 * c);
                        lo[p] = _mm512_and_si512(raw, low);
                        hi[p] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
                    }
                    for (int i = 0; i < MR; ++i) {
                        const __m512i x0 = _mm512_set1_epi32(four_bytes(x[i] + 8 * c));
                        const __m512i x1 = _mm512_set1_epi32(four_bytes(x[i] + 8 * c + 4));
                        for (int p = 0; p < NP; ++p) {
                            dot[i][p] = _mm512_dpbusd_epi32(dot[i][p], lo[p], x0);
                            dot[i][p] = _mm512_dpbusd_epi32(dot[i][p], hi[p], x1);
                        }
                    }
                }
            } else {
                for (int c = h * chunks; c < (h + 1) * chunks; ++c) {
                    __m512i q[NP];
                    for (int p = 0; p < NP; ++p) {
                        q[p] = _mm512_loadu_si512(qs[p] + 64 * c);
                        if constexpr (F != Q6_K) q[p] = _mm512_xor_si512(q[p], flip);
                    }
                    for (int i = 0; i < MR; ++i) {
                        const __m512i xb = _mm512_set1_epi32(four_bytes(x[i] + 4 * c));
                        for (int p = 0; p < NP; ++p)
                            dot[i][p] = _mm512_dpbusd_epi32(dot[i][p], q[p], xb);
                    }
                }
            }
            __m512 dw[NP], mins[NP];
            for (int p = 0; p < NP; ++p) {
                const int64_t at = ((p0 + p) * KB + b) * 16;
                if constexpr (fp32_scales(F)) {
                    dw[p] = _mm512_loadu_ps(w.fscales + (((p0 + p) * KB + b) * H + h) * 16);
                    if constexpr (has_min(F)) mins[p] = _mm512_loadu_ps(w.fmins + at);
                } else if constexpr (F != INT8) {
                    const auto* scales = (const __m256i*)(w.scales + at);
                    dw[p] = _mm512_cvtph_ps(_mm256_loadu_si256(scales));
                    if constexpr (has_min(F)) {
                        const auto* mins_at = (const __m256i*)(w.mins + at);
                        mins[p] = _mm512_cvtph_ps(_mm256_loadu_si256(mins_at));
                    }
                }
            }
            for (int i = 0; i < MR; ++i) {
                const int64_t row = (m0 + i) * KB + b;
                const float d = a.d[row];
                const __m512 dx = _mm512_set1_ps(d);
                for (int p = 0; p < NP; ++p) {
                    const __m512 scale = F == INT8 ? dx : _mm512_mul_ps(dw[p], dx);
                    acc[i][p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i][p]), scale, acc[i][p]);
                    if constexpr (has_min(F))
                        acc[i][p] = _mm512_fmadd_ps(
                            mins[p], _mm512_set1_ps(d * float(a.sum[row])), acc[i][p]);
                }
            }
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int p = 0; p < NP; ++p) {
            __m512 v = acc[i][p];
            if constexpr (F == INT8)
                v = _mm512_mul_ps(v, _mm512_loadu_ps(w.row_scales + (p0 + p) * 16));
            _mm512_storeu_ps(out[i] + 16 * p, v);
        }
}
#elif defined(PDSERVE_QUANT_AVX2)
constexpr int kRows = 2;
constexpr int kPanels = 1;

inline __m256i dot_u8s8(__m256i acc, __m256i w, __m256i x) {
    const __m256i pairs = _mm256_maddubs_epi16(w, x);
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

// A 64-byte chunk is two registers: rows 0-7 (h = 0) and rows 8-15 (h = 1).
template <int64_t F, int MR, int NP>
void tile(const QuantRows& a, int64_t m0, const Panels& w, int64_t p0,
          float (*out)[kPanels * 16]) {
    static_assert(NP == 1, "one panel per tile");
    constexpr int64_t bytes = panel_block_bytes(F);
    constexpr int H = halves(F);
    constexpr int chunks = 8 / H;  // byte formats: 64-byte chunks of 4 k per half block
    const int64_t KB = w.blocks;
    __m256 acc[MR][2];
    for (int i = 0; i < MR; ++i)
        for (int h = 0; h < 2; ++h) acc[i][h] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int64_t b = 0; b < KB; ++b) {
        const int8_t* x[MR];
        for (int i = 0; i < MR; ++i) x[i] = a.q + (m0 + i) * a.K + b * kBlock;
        const uint8_t* qs = w.qs + (p0 * KB + b) * bytes;
        for (int part = 0; part < H; ++part) {
            __m256i dot[MR][2];
            for (int i = 0; i < MR; ++i) {
                const int64_t row = (m0 + i) * KB + b;
                dot[i][0] = dot[i][1] = _mm256_set1_epi32(block_start<F>(a, row, part, false));
            }
            if constexpr (nibbles(F)) {
                for (int c = 0; c < 4; ++c) {
                    __m256i lo[2], hi[2];
                    for (int h = 0; h < 2; ++h) {
                        const auto* at = (const __m256i*)(qs + 64 * c + 32 * h);
                        const __m256i raw = _mm256_loadu_si256(at);
                        lo[h] = _mm256_and_si256(raw, low);
                        hi[h] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
                    }
                    for (int i = 0; i < MR; ++i) {
                        const __m256i x0 = _mm256_set1_epi32(four_bytes(x[i] + 8 * c));
                        const __m256i x1 = _mm256_set1_epi32(four_bytes(x[i] + 8 * c + 4));
                        for (int h = 0; h < 2; ++h) {
                            dot[i][h] = dot_u8s8(dot[i][h], lo[h], x0);
                            dot[i][h] = dot_u8s8(dot[i][h], hi[h], x1);
                        }
                    }
                }
            } else if constexpr (F == Q6_K) {
                // q 0-63 unsigned: VPMADDUBSW's pairs stay within int16 (2 x 63 x 127)
                for (int c = part * chunks; c < (part + 1) * chunks; ++c) {
                    __m256i q[2];
                    for (int h = 0; h < 2; ++h)
                        q[h] = _mm256_loadu_si256((const __m256i*)(qs + 64 * c + 32 * h));
                    for (int i = 0; i < MR; ++i) {
                        const __m256i xb = _mm256_set1_epi32(four_bytes(x[i] + 4 * c));
                        for (int h = 0; h < 2; ++h) dot[i][h] = dot_u8s8(dot[i][h], q[h], xb);
                    }
                }
            } else {
                for (int c = 0; c < 8; ++c) {
                    __m256i q[2], magnitude[2];
                    for (int h = 0; h < 2; ++h) {
                        q[h] = _mm256_loadu_si256((const __m256i*)(qs + 64 * c + 32 * h));
                        magnitude[h] = _mm256_sign_epi8(q[h], q[h]);
                    }
                    for (int i = 0; i < MR; ++i) {
                        const __m256i xb = _mm256_set1_epi32(four_bytes(x[i] + 4 * c));
                        for (int h = 0; h < 2; ++h) {
                            const __m256i signed_x = _mm256_sign_epi8(xb, q[h]);
                            dot[i][h] = dot_u8s8(dot[i][h], magnitude[h], signed_x);
                        }
                    }
                }
            }
            __m256 dw[2], mins[2];
            for (int h = 0; h < 2; ++h) {
                const int64_t at = (p0 * KB + b) * 16 + 8 * h;
                if constexpr (fp32_scales(F)) {
                    dw[h] = _mm256_loadu_ps(w.fscales + ((p0 * KB + b) * H + part) * 16 + 8 * h);
                    if constexpr (has_min(F)) mins[h] = _mm256_loadu_ps(w.fmins + at);
                } else if constexpr (F != INT8) {
                    dw[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.scales + at)));
                    if constexpr (has_min(F))
                        mins[h] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(w.mins + at)));
                }
            }
            for (int i = 0; i < MR; ++i) {
                const int64_t row = (m0 + i) * KB + b;
                const float d = a.d[row];
                const __m256 dx = _mm256_set1_ps(d);
                for (int h = 0; h < 2; ++h) {
                    const __m256 scale = F == INT8 ? dx : _mm256_mul_ps(dw[h], dx);
                    acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][h]), scale, acc[i][h]);
                    if constexpr (has_min(F))
                        acc[i][h] = _mm256_fmadd_ps(
                            mins[h], _mm256_set1_ps(d * float(a.sum[row])), acc[i][h]);
                }
            }
        }
    }
    for (int i = 0; i < MR; ++i)
        for (int h = 0; h < 2; ++h) {
            __m256 v = acc[i][h];
            if constexpr (F == INT8)
                v = _mm256_mul_ps(v, _mm256_loadu_ps(w.row_scales + p0 * 16 + 8 * h));
            _mm256_storeu_ps(out[i] + 8 * h, v);
        }
}
#else
constexpr int kRows = 1;
constexpr int kPanels = 1;

// The weight's value of (panel row r, k) as VPDPBUSD reads it: Q8_0 and int8 signed, a nibble q,
// Q6_K's byte q unsigned.
template <int64_t F>
int32_t weight_quant(const uint8_t* block, int64_t r, int64_t k) {
    if constexpr (nibbles(F)) {
        const uint8_t byte = block[(k / 8) * 64 + r * 4 + k % 4];
        return (k % 8) < 4 ? byte & 0x0F : byte >> 4;
    } else if constexpr (F == Q6_K) {
        return block[(k / 4) * 64 + r * 4 + k % 4];
    } else {
        return int8_t(block[(k / 4) * 64 + r * 4 + k % 4]);
    }
}

template <int64_t F, int MR, int NP>
void tile(const QuantRows& a, int64_t m0, const Panels& w, int64_t p0,
          float (*out)[kPanels * 16]) {
    constexpr int64_t bytes = panel_block_bytes(F);
    constexpr int H = halves(F);
    const int64_t KB = w.blocks;
    for (int64_t r = 0; r < kPanel; ++r) {
        float acc = 0.f;
        for (int64_t b = 0; b < KB; ++b) {
            const int64_t row = m0 * KB + b;
            const uint8_t* block = w.qs + (p0 * KB + b) * bytes;
            const int8_t* x = a.q + m0 * a.K + b * kBlock;
            for (int part = 0; part < H; ++part) {
                int32_t dot = block_start<F>(a, row, part, false);
                for (int64_t k = part * kBlock / H; k < (part + 1) * kBlock / H; ++k)
                    dot += weight_quant<F>(block, r, k) * x[k];
                const int64_t at = (p0 * KB + b) * 16 + r;
                float dw = 0.f, min = 0.f;
                if constexpr (fp32_scales(F)) {
                    dw = w.fscales[((p0 * KB + b) * H + part) * 16 + r];
                    if constexpr (has_min(F)) min = w.fmins[at];
                } else if constexpr (F != INT8) {
                    dw = half_to_float(w.scales[at]);
                    if constexpr (has_min(F)) min = half_to_float(w.mins[at]);
                }
                acc = block_step<F>(acc, dot, dw, a.d[row], min, a.sum[row]);
            }
        }
        if (F == INT8) acc *= w.row_scales[p0 * 16 + r];
        out[0][r] = acc;
    }
}
#endif

#define PDSERVE_QUANT_TILE(F, MR, NP) tile<F, MR, NP>(a, m, w, p, results)

template <int64_t F>
void run_tile(int rows, int panels, const QuantRows& a, int64_t m, const Panels& w, int64_t p,
              float (*results)[kPanels * 16]) {
    const int shape = (rows - 1) * 2 + (panels - 1);
    switch (shape) {
        case 0: PDSERVE_QUANT_TILE(F, 1, 1); break;
#if defined(PDSERVE_QUANT_VNNI)
        case 1: PDSERVE_QUANT_TILE(F, 1, 2); break;
        case 2: PDSERVE_QUANT_TILE(F, 2, 1); break;
        case 3: PDSERVE_QUANT_TILE(F, 2, 2); break;
        case 4: PDSERVE_QUANT_TILE(F, 3, 1); break;
        case 5: PDSERVE_QUANT_TILE(F, 3, 2); break;
        case 6: PDSERVE_QUANT_TILE(F, 4, 1); break;
        default: PDSERVE_QUANT_TILE(F, 4, 2); break;
#elif defined(PDSERVE_QUANT_AVX2)
        default: PDSERVE_QUANT_TILE(F, 2, 1); break;
#else
        default: break;
#endif
    }
}

// One work item: panels p_first.. (up to kPanels) for rows m_first..m_last, tile by tile, each
// tile's results (plus the bias) stored in the output's dtype.
template <int64_t F, typename T>
void run_item(const QuantRows& a, const Panels& w, const T* bias, T* out, int64_t N,
              int64_t m_first, int64_t m_last, int64_t p_first, int64_t P) {
    const int panels = int(std::min<int64_t>(kPanels, P - p_first));
    float results[kRows][kPanels * 16];
    for (int64_t m = m_first; m < m_last; m += kRows) {
        const int rows = int(std::min<int64_t>(kRows, m_last - m));
        run_tile<F>(rows, panels, a, m, w, p_first, results);
        const int64_t first_col = p_first * kPanel;
        const int64_t num_cols = std::min<int64_t>(panels * kPanel, N - first_col);
        for (int i = 0; i < rows; ++i)
            for (int64_t j = 0; j < num_cols; ++j) {
                const float b = bias != nullptr ? load(bias, first_col + j) : 0.f;
                store(out + (m + i) * N + first_col, j, results[i][j] + b);
            }
    }
}

template <int64_t F, typename T>
void run(const QuantRows& a, const Panels& w, const T* bias, T* out, int64_t M, int64_t N,
         int64_t P) {
    // Work items: (group of kPanels panels, block of up to 16 rows), panel-major, so that a thread
    // keeps its panels in cache across the row blocks it takes
    const int64_t groups = (P + kPanels - 1) / kPanels;
    const int64_t block = 16, num_blocks = (M + block - 1) / block;
    at::parallel_for(0, groups * num_blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t first = (item % num_blocks) * block;
            const int64_t last = std::min(M, first + block);
            run_item<F, T>(a, w, bias, out, N, first, last, (item / num_blocks) * kPanels, P);
        }
    });
}

template <typename T>
void dispatch(int64_t format, const QuantRows& a, const Panels& w, const T* bias, T* out,
              int64_t M, int64_t N, int64_t P) {
    switch (format) {
        case Q8_0: run<Q8_0, T>(a, w, bias, out, M, N, P); break;
        case Q4_0: run<Q4_0, T>(a, w, bias, out, M, N, P); break;
        case Q4_1: run<Q4_1, T>(a, w, bias, out, M, N, P); break;
        case Q4_K: run<Q4_K, T>(a, w, bias, out, M, N, P); break;
        case Q6_K: run<Q6_K, T>(a, w, bias, out, M, N, P); break;
        default: run<INT8, T>(a, w, bias, out, M, N, P); break;
    }
}

}  // namespace

std::string quant_linear_isa() {
#if defined(PDSERVE_QUANT_VNNI)
    return "avx512_vnni";
#elif defined(PDSERVE_QUANT_AVX2)
    return "avx2";
#else
    return "scalar";
#endif
}

// x: [M, K] contiguous fp32 or bf16, K a multiple of 32; qs: the packed weight, [P, K / 32, ...]
// of `panel_block_bytes` per panel and block; scales: [P, K / 32, 16] fp16 (Q8_0, Q4_0, Q4_1),
// [P, 16] fp32 (int8), [P, K / 32, 16] fp32 (Q4_K) or [P, K / 32, 2, 16] fp32 (Q6_K); mins: shaped
// as the scales, fp16 (Q4_1) or fp32 (Q4_K); bias: [N] in x's dtype, or none. Returns [M, N] in x's
// dtype.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor scales,
                           std::optional<torch::Tensor> mins, std::optional<torch::Tensor> bias,
                           int64_t format, int64_t N) {
    TORCH_CHECK(format >= Q8_0 && format <= Q6_K, "unknown packed format ", format);
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "contiguous [M, K] input expected");
    const bool bf16 = x.scalar_type() == torch::kBFloat16;
    TORCH_CHECK(bf16 || x.scalar_type() == torch::kFloat, "fp32 or bf16 input expected");
    const int64_t M = x.size(0), K = x.size(1), KB = K / kBlock, P = qs.size(0);
    TORCH_CHECK(K % kBlock == 0, "K must be a multiple of 32, got ", K);
    TORCH_CHECK(qs.is_contiguous() && qs.element_size() == 1 &&
                    qs.numel() == P * KB * panel_block_bytes(format) && P * kPanel >= N,
                "packed weight does not fit the input");
    TORCH_CHECK(scales.is_contiguous(), "contiguous scales expected");
    const bool rows_scaled = format == INT8, fp32 = fp32_scales(format);
    const int64_t scale_count = rows_scaled ? P * kPanel : P * KB * kPanel * halves(format);
    const auto scale_type = rows_scaled || fp32 ? torch::kFloat : torch::kHalf;
    TORCH_CHECK(scales.scalar_type() == scale_type && scales.numel() == scale_count,
                "scales: ", scale_count, " of ", scale_type, " expected for format ", format);
    TORCH_CHECK(!has_min(format) || (mins && mins->is_contiguous() &&
                                     mins->scalar_type() == scale_type &&
                                     mins->numel() == scales.numel()),
                "Q4_1 and Q4_K take mins shaped as their scales");
    TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == N &&
                          bias->scalar_type() == x.scalar_type()),
                "bias: [N] in x's dtype");
    auto out = torch::empty({M, N}, x.options());
    if (M == 0 || N == 0) return out;
    auto q = torch::empty({M, K}, x.options().dtype(torch::kChar));
    auto d = torch::empty({M, KB}, x.options().dtype(torch::kFloat));
    auto sum = torch::empty({M, KB}, x.options().dtype(torch::kInt));
    auto half = torch::empty({M, 2 * KB}, x.options().dtype(torch::kInt));
    int8_t* q_ptr = ptr<int8_t>(q);
    float* d_ptr = ptr<float>(d);
    int32_t *sum_ptr = ptr<int32_t>(sum), *half_ptr = ptr<int32_t>(half);
    if (bf16)
        quantize_rows(ptr<uint16_t>(x), M, K, q_ptr, d_ptr, sum_ptr, half_ptr);
    else
        quantize_rows(ptr<float>(x), M, K, q_ptr, d_ptr, sum_ptr, half_ptr);
    const QuantRows a{q_ptr, d_ptr, sum_ptr, half_ptr, K};
    const bool fp16 = !rows_scaled && !fp32;
    const Panels w{ptr<uint8_t>(qs),
                   fp16 ? ptr<uint16_t>(scales) : nullptr,
                   fp16 && has_min(format) ? ptr<uint16_t>(*mins) : nullptr,
                   rows_scaled ? ptr<float>(scales) : nullptr,
                   fp32 ? ptr<float>(scales) : nullptr,
                   fp32 && has_min(format) ? ptr<float>(*mins) : nullptr,
                   KB};
    if (bf16)
        dispatch<uint16_t>(format, a, w, bias ? ptr<uint16_t>(*bias) : nullptr,
                           ptr<uint16_t>(out), M, N, P);
    else
        dispatch<float>(format, a, w, bias ? ptr<float>(*bias) : nullptr, ptr<float>(out), M, N,
                        P);
    return out;
}
