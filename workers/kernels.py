"""A ragged decode-attention kernel for CPU, compiled on first use, with SDPA as the fallback.

Why a kernel: a decode step's attention reads each row's keys up to its own length. Torch offers two
ways on CPU, both measured slower: one SDPA call per row (a thread-pool fork and join per row per
layer) or one call over the slot span padded to the longest row (reads up to twice the keys, and
torch's flash kernel for three query rows per KV head is compute-bound in bf16: it costs as much as
in fp32). This kernel runs every (row, KV head) pair in one parallel loop on torch's own thread pool,
reads exactly each row's keys and values once, and keeps scores in fp32 whatever the cache dtype.

It is built with `torch.utils.cpp_extension.load_inline` (a C++ compiler, as `torch.compile` on CPU
needs too) into torch's extension cache, once per machine type (about 35 s); where building fails, or
`PDSERVE_KERNELS=0` is set, `decode_attention` returns None and the caller uses SDPA. It is compiled
with -fopenmp because `at::parallel_for` is an OpenMP pragma in a header: without it the loop runs on
one thread. The library it names, libgomp.so.1, is the one torch has already loaded, so there is one
thread pool. Measured at 64 rows of contexts 16-380 (one layer): 1.6-1.9 ms against 3.1-3.6 ms for the
span SDPA call in fp32, and 1.6 against 3.6 ms in bf16.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

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

// exp(x) for x <= 0 (scores minus their max), written so that the compiler vectorizes it (a libm call
// per score would not be): x = n ln2 + r, exp(r) by Cephes' degree-6 polynomial, 2^n in the exponent
// bits. About 1 ulp; below -87 it returns about 1e-38, which the softmax's sum cannot tell from 0.
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

// q, out: [B, KVH, G, D]; k, v: [S, KVH, C, D] contiguous; slots, lengths: [B] int64
template <typename T>
static void run(const T* q, const T* k, const T* v, const int64_t* slots, const int64_t* lengths, T* out,
                int64_t B, int64_t KVH, int64_t G, int64_t C, int64_t D, float scale) {
    at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> qf(G * D), acc(G * D), row(D), scores;
        for (int64_t item = begin; item < end; ++item) {
            const int64_t b = item / KVH, h = item % KVH, len = lengths[b];
            const int64_t base = (slots[b] * KVH + h) * C * D;
            const T* qp = q + item * G * D;
            for (int64_t i = 0; i < G * D; ++i) qf[i] = load(qp, i) * scale;
            scores.resize(G * len);
            for (int64_t t = 0; t < len; ++t) {
                const T* kp = k + base + t * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) row[d] = load(kp, d);
                for (int64_t g = 0; g < G; ++g) {
                    const float* qg = qf.data() + g * D;
                    float s = 0.f;
#pragma omp simd reduction(+ : s)
                    for (int64_t d = 0; d < D; ++d) s += qg[d] * row[d];
                    scores[g * len + t] = s;
                }
            }
            for (int64_t g = 0; g < G; ++g) {
                float* sg = scores.data() + g * len;
                float mx = -INFINITY, sum = 0.f;
#pragma omp simd reduction(max : mx)
                for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sg[t]);
#pragma omp simd reduction(+ : sum)
                for (int64_t t = 0; t < len; ++t) { sg[t] = exp_nonpositive(sg[t] - mx); sum += sg[t]; }
                const float inv = 1.f / sum;
#pragma omp simd
                for (int64_t t = 0; t < len; ++t) sg[t] *= inv;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t t = 0; t < len; ++t) {
                const T* vp = v + base + t * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) row[d] = load(vp, d);
                for (int64_t g = 0; g < G; ++g) {
                    const float p = scores[g * len + t];
                    float* ag = acc.data() + g * D;
#pragma omp simd
                    for (int64_t d = 0; d < D; ++d) ag[d] += p * row[d];
                }
            }
            T* op = out + item * G * D;
            for (int64_t i = 0; i < G * D; ++i) store(op, i, acc[i]);
        }
    });
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                               torch::Tensor lengths, double scale) {
    TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), "contiguous tensors expected");
    TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "one dtype expected");
    auto out = torch::empty_like(q);
    const int64_t B = q.size(0), KVH = q.size(1), G = q.size(2), D = q.size(3), C = k.size(2);
    const int64_t* s = slots.data_ptr<int64_t>();
    const int64_t* l = lengths.data_ptr<int64_t>();
    if (q.scalar_type() == torch::kFloat) {
        run<float>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), s, l, out.data_ptr<float>(),
                   B, KVH, G, C, D, float(scale));
    } else {
        TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "float32 or bfloat16 expected");
        auto bits = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
        run<uint16_t>(bits(q), bits(k), bits(v), s, l, bits(out), B, KVH, G, C, D, float(scale));
    }
    return out;
}
"""

_lock = threading.Lock()
_module: Any = None
_tried = False


def _machine_tag() -> str:
    """Built with -march=native, so one build per CPU type (a shared home directory must not mix them)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha1((flags + torch.__version__).encode()).hexdigest()[:10]


def load_kernels() -> Any:
    """The compiled module, building it on first call; None where it cannot be built or is disabled."""
    global _module, _tried
    with _lock:
        if not _tried:
            _tried = True
            if os.environ.get("PDSERVE_KERNELS", "1") != "0":
                try:
                    from torch.utils.cpp_extension import load_inline

                    _module = load_inline(name=f"pdserve_kernels_{_machine_tag()}", cpp_sources=_SOURCE,
                                          functions=["decode_attention"],
                                          extra_cflags=["-O3", "-march=native", "-fopenmp"],
                                          extra_ldflags=["-fopenmp"])
                except Exception as error:  # no compiler, no headers, an unknown CPU: SDPA does the work
                    log.warning("decode-attention kernel unavailable (%s); using SDPA", error)
        return _module


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                     lengths: torch.Tensor) -> torch.Tensor | None:
    """Attention of `query [B, KVH, G, D]` (a decode row's query heads grouped by KV head) over keys
    0..lengths[b]-1 of cache row slots[b] in `k_cache`/`v_cache [S, KVH, C, D]`. Returns `[B, KVH, G, D]`,
    or None when the kernel does not apply (not CPU, another dtype, no compiler)."""
    if query.device.type != "cpu" or query.dtype not in (torch.float32, torch.bfloat16):
        return None
    module = load_kernels()
    if module is None:
        return None
    return module.decode_attention(query.contiguous(), k_cache, v_cache, slots, lengths,
                                   query.shape[-1] ** -0.5)  # [B, KVH, G, D]
