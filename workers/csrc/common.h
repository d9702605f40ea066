// The numeric helpers the kernel files share: fp32/bf16 loads and stores, rounding, exp.
#pragma once

#include <torch/types.h>

#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline float load(const float* p, int64_t i) { return p[i]; }
static inline float load(const uint16_t* p, int64_t i) {
    return __builtin_bit_cast(float, uint32_t(p[i]) << 16);  // bfloat16 is the top half of a float
}
static inline void store(float* p, int64_t i, float x) { p[i] = x; }
static inline void store(uint16_t* p, int64_t i, float x) {
    uint32_t bits = __builtin_bit_cast(uint32_t, x);
    bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even, as torch's conversion does
    p[i] = uint16_t(bits >> 16);
}

template <typename T> static inline float rounded(float x);
template <> inline float rounded<float>(float x) { return x; }
template <> inline float rounded<uint16_t>(float x) {  // to the nearest bfloat16, as a float
    uint32_t bits = __builtin_bit_cast(uint32_t, x);
    bits += 0x7FFF + ((bits >> 16) & 1);
    return __builtin_bit_cast(float, bits & 0xFFFF0000u);
}

// a tensor's elements as the kernels read them (uint16_t: a bf16 tensor's 16-bit words)
template <typename T> static T* ptr(const torch::Tensor& t) {
    return reinterpret_cast<T*>(t.data_ptr());
}

// exp(x) for x <= 0 (scores minus their max): x = n ln2 + r, exp(r) by Cephes' degree-6 polynomial,
// 2^n in the exponent bits. About 1 ulp; below -87 it returns about 1e-38, which a softmax sum
// cannot tell from 0.
static inline float exp_nonpositive(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = __builtin_floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    return p * __builtin_bit_cast(float, (int32_t(n) + 127) << 23);
}

#if defined(__AVX512F__)
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}
static inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
static inline void store16(uint16_t* p, __m512 x) {
    alignas(64) float tmp[16];
    _mm512_store_ps(tmp, x);
    for (int i = 0; i < 16; ++i) store(p, i, tmp[i]);
}

template <typename T> static inline __m512 rounded16(__m512 x);
template <> inline __m512 rounded16<float>(__m512 x) { return x; }
template <> inline __m512 rounded16<uint16_t>(__m512 x) {  // rounded<uint16_t>, 16 lanes at a time
    const __m512i bits = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
    return _mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(int(0xFFFF0000u))));
}

static inline __m512 exp16_nonpositive(__m512 x) {  // exp_nonpositive, 16 lanes at a time
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
    const __m512 half_up =
        _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    const __m512 n = _mm512_roundscale_ps(half_up, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    const __m512i bits =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

// lanes t..t+15 of a loop over len elements that are in range
static inline __mmask16 tail(int64_t t, int64_t len) {
    return len - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (len - t)) - 1);
}
#endif
