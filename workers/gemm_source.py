"""C++ source of the fp32 packed-weight matmul (`x @ W.T + b`) that `workers.kernels` builds, AVX-512 only."""

# The weight is packed once into panels of 64 output columns, `[ceil(N / 64), K, 64]` (`kernels.linear`
# does it in torch and keeps the result beside the weight), so a 6 x 64 tile of the output accumulates in
# 24 registers while its panel streams through in order: per k, 4 loads and up to 6 broadcasts feed 24
# FMAs. MKL's sgemm packs the weight again on every call, which at decode's few rows costs as much as the
# multiply: measured on one thread against F.linear, 1.4-3x faster at 4-32 rows and 1.1-1.2x at 64-256.
# Each output is the same K products summed in k order, so fp32 results differ from MKL's only by
# summation order.
GEMM = r"""
#if defined(__AVX512F__)
template <int MR>
static inline void gemm_tile(const float* x, int64_t K, const float* panel, const float* bias, float* out,
                             int64_t ldo, int64_t num_cols) {
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
        const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(m, bias + 16 * j) : _mm512_setzero_ps();
        for (int i = 0; i < MR; ++i) _mm512_mask_storeu_ps(out + i * ldo + 16 * j, m, _mm512_add_ps(acc[i][j], b));
    }
}
#endif

bool packed_linear_available() {
#if defined(__AVX512F__)
    return true;
#else
    return false;
#endif
}

// x: [M, K] fp32 contiguous; packed: [P, K, 64]; bias: [N] or none -> [M, N]. Work items are (panel, block of
// up to 48 rows), panel-major, so a thread keeps a panel in its L2 across the row blocks it takes.
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed, std::optional<torch::Tensor> bias, int64_t N) {
    TORCH_CHECK(packed_linear_available(), "packed_linear needs AVX-512");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && packed.is_contiguous(), "contiguous [M, K] input expected");
    TORCH_CHECK(x.scalar_type() == torch::kFloat && packed.scalar_type() == torch::kFloat, "float32 expected");
    const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
    TORCH_CHECK(packed.size(1) == K && packed.size(2) == 64 && P * 64 >= N, "packed weight does not fit");
    auto out = torch::empty({M, N}, x.options());
    if (M == 0) return out;
#if defined(__AVX512F__)
    const float* xp = x.data_ptr<float>();
    const float* pp = packed.data_ptr<float>();
    const float* bp = bias ? bias->data_ptr<float>() : nullptr;
    float* op = out.data_ptr<float>();
    const int64_t tiles = (M + 5) / 6, rows = (M + tiles - 1) / tiles;  // rows per tile: even, at most 6
    const int64_t block = rows * 8, num_blocks = (M + block - 1) / block;
    at::parallel_for(0, P * num_blocks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t p = item / num_blocks, first = (item % num_blocks) * block;
            const int64_t num_cols = std::min<int64_t>(64, N - p * 64);
            const float* panel = pp + p * K * 64;
            const float* b = bp != nullptr ? bp + p * 64 : nullptr;
            for (int64_t m = first; m < std::min(M, first + block); m += rows) {
                const float* xs = xp + m * K;
                float* o = op + m * N + p * 64;
                switch (std::min(rows, M - m)) {
                    case 1: gemm_tile<1>(xs, K, panel, b, o, N, num_cols); break;
                    case 2: gemm_tile<2>(xs, K, panel, b, o, N, num_cols); break;
                    case 3: gemm_tile<3>(xs, K, panel, b, o, N, num_cols); break;
                    case 4: gemm_tile<4>(xs, K, panel, b, o, N, num_cols); break;
                    case 5: gemm_tile<5>(xs, K, panel, b, o, N, num_cols); break;
                    default: gemm_tile<6>(xs, K, panel, b, o, N, num_cols); break;
                }
            }
        }
    });
#endif
    return out;
}
"""
