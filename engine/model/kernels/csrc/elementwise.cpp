// The decoder's elementwise steps, fused: residual add + RMSNorm, SiLU(gate) x up, and RoPE with the KV cache
// write (engine/model/fused_ops.py).
//
// Why: on a decode step each of these is a handful of tiny torch ops (cast, square, mean, add, rsqrt, mul,
// cast, mul; exp, add, div, cast, mul), and with ~1,600 ops per step their dispatch, not their arithmetic,
// was a third of the step. One call per layer per kind replaces them.
//
// Numerics follow transformers' op order, with the model dtype's roundings where it rounds:
//   add_rms_norm: h = round(h + delta); v = sum(h^2) / n (float32); y = round(h * (1 / sqrt(v + eps)));
//                 out = round(weight * y)
//   silu_mul:     s = round(g / (1 + exp(-g))) (float32 inside); out = round(s * up)
//   rope_write:   (x1 c - x2 s, x2 c + x1 s), each product and sum rounded: bit for bit transformers' RoPE;
//                 K and V copied to their cache slots
// (round: to the model dtype, nearest even; the identity for float32). Two places differ from torch in the
// last float32 bits: the sum of squares runs in 16 lanes, then a fixed tree (torch's mean sums in its own
// vector order), and exp is this file's polynomial (torch's is Sleef's). Both are the same on every row and
// every call, whatever the batch or the thread count: each row is computed alone, by one thread, and the
// last partial vector of a row goes through the same vector code with a mask, never a scalar loop.
//
// Tiers: the AVX512 code below is the reference; every other build (AVX2, the portable one) runs the scalar
// code after it, which does the same IEEE operations lane by lane in the same order (16 lanes of squares, the
// same tree, the same exp with exact scalar forms of roundscale and scalef: exp1), so its bits are the AVX512
// code's. (That code is scalar but for SiLU on AVX2, which runs 8 lanes of the same operations.)

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtypes.h"
#include "entry_points.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define BRINE_ELEMENTWISE_AVX512 1
#include <immintrin.h>
#else
#define BRINE_ELEMENTWISE_AVX512 0
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#endif

using brine::kDtypeBF16;
using brine::kDtypeF32;

#if BRINE_ELEMENTWISE_AVX512
using brine::exp_poly16;

namespace {

// Load 16 (or fewer, masked: the rest read as 0) values of the model dtype as float32.
template <int DT>
inline __m512 load16(const void* p, int64_t i, __mmask16 mask) {
    if constexpr (DT == kDtypeF32) {
        return _mm512_maskz_loadu_ps(mask, static_cast<const float*>(p) + i);
    } else {
        const __m256i h = _mm256_maskz_loadu_epi16(mask, static_cast<const uint16_t*>(p) + i);
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
}

// float32 -> bfloat16 bits, round to nearest even (NaN kept quiet), as torch's .to(torch.bfloat16).
inline __m256i to_bf16(__m512 v) {
    const __m512i u = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    return _mm512_cvtepi32_epi16(r);
}

// The model dtype's rounding of float32 values (identity for float32).
template <int DT>
inline __m512 round_dtype(__m512 v) {
    if constexpr (DT == kDtypeF32) {
        return v;
    } else {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
    }
}

template <int DT>
inline void store16(void* p, int64_t i, __m512 v, __mmask16 mask) {
    if constexpr (DT == kDtypeF32) {
        _mm512_mask_storeu_ps(static_cast<float*>(p) + i, mask, v);
    } else {
        _mm256_mask_storeu_epi16(static_cast<uint16_t*>(p) + i, mask, to_bf16(v));
    }
}

inline __mmask16 tail_mask(int64_t n, int64_t i) {
    const int64_t left = n - i;
    return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// exp(x) for float32: x = k ln2 + r (Cody-Waite, two constants), a degree-6 polynomial in r (cephes' expf
// coefficients), times 2^k; inputs are clamped to where float32 neither overflows nor goes subnormal.
inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.7f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = exp_poly16(r);
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, k);
}

template <int DT>
void add_rms_norm(const void* h, const void* delta, void* h_sum, const void* weight, void* out, int64_t rows,
                  int64_t n, float eps, int threads) {
    const void* src = delta != nullptr ? h_sum : h;  // the norm's input, once the sum is written
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t t = 0; t < rows; ++t) {
        const int64_t base = t * n;
        __m512 sq = _mm512_setzero_ps();
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = tail_mask(n, i);
            __m512 v = load16<DT>(h, base + i, m);
            if (delta != nullptr) {
                v = round_dtype<DT>(_mm512_add_ps(v, load16<DT>(delta, base + i, m)));
                store16<DT>(h_sum, base + i, v, m);
            }
            sq = _mm512_fmadd_ps(v, v, sq);
        }
        // the 16 lanes by a fixed halving tree
        alignas(64) float lanes[16];
        _mm512_store_ps(lanes, sq);
        for (int w = 8; w >= 1; w /= 2)
            for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
        const float inv = 1.0f / std::sqrt(lanes[0] / static_cast<float>(n) + eps);
        const __m512 r = _mm512_set1_ps(inv);
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = tail_mask(n, i);
            const __m512 y = round_dtype<DT>(_mm512_mul_ps(load16<DT>(src, base + i, m), r));
            store16<DT>(out, base + i, _mm512_mul_ps(load16<DT>(weight, i, m), y), m);
        }
    }
}

template <int DT>
void silu_mul(const void* gate_up, void* out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t t = 0; t < rows; ++t) {
        for (int64_t i = 0; i < n; i += 16) {
            const __mmask16 m = tail_mask(n, i);
            const __m512 g = load16<DT>(gate_up, t * 2 * n + i, m);
            const __m512 up = load16<DT>(gate_up, t * 2 * n + n + i, m);
            const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            const __m512 s = round_dtype<DT>(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
            store16<DT>(out, t * n + i, _mm512_mul_ps(s, up), m);
        }
    }
}

// One head of one token: y = (x1 c - x2 s, x2 c + x1 s) with every product and sum rounded to the model
// dtype, as transformers' apply_rotary_pos_emb computes it in that dtype (x1, x2: the halves of x).
template <int DT>
void rope_head(const void* x, int64_t xi, const void* cos, const void* sin, int64_t ci, void* y, int64_t yi,
               int64_t half) {
    for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = tail_mask(half, i);
        const __m512 x1 = load16<DT>(x, xi + i, m), x2 = load16<DT>(x, xi + half + i, m);
        const __m512 c = load16<DT>(cos, ci + i, m), s = load16<DT>(sin, ci + i, m);
        const __m512 y1 = _mm512_sub_ps(round_dtype<DT>(_mm512_mul_ps(x1, c)), round_dtype<DT>(_mm512_mul_ps(x2, s)));
        const __m512 y2 = _mm512_add_ps(round_dtype<DT>(_mm512_mul_ps(x2, c)), round_dtype<DT>(_mm512_mul_ps(x1, s)));
        store16<DT>(y, yi + i, y1, m);
        store16<DT>(y, yi + half + i, y2, m);
    }
}

template <int DT>
void rope_write(const void* qkv, int64_t qkv_stride, const void* cos, const void* sin, const int64_t* slots,
                void* k_cache, void* v_cache, void* q_out, int64_t tokens, int heads, int kv_heads, int dim,
                int threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t row = t * qkv_stride, slot = slots[t];
        for (int j = 0; j < heads; ++j) rope_head<DT>(qkv, row + j * dim, cos, sin, t * half, q_out, (t * heads + j) * dim, half);
        for (int j = 0; j < kv_heads; ++j)
            rope_head<DT>(qkv, row + (heads + j) * dim, cos, sin, t * half, k_cache, (slot * kv_heads + j) * dim, half);
        const size_t bytes = static_cast<size_t>(kv_heads) * dim * (DT == kDtypeF32 ? 4 : 2);
        const int64_t v0 = row + static_cast<int64_t>(heads + kv_heads) * dim;
        std::memcpy(static_cast<char*>(v_cache) + slot * bytes, static_cast<const char*>(qkv) + v0 * (DT == kDtypeF32 ? 4 : 2), bytes);
    }
}

}  // namespace
#else  // the scalar code of every other tier: the same arithmetic, lane by lane
namespace {

using brine::bf16_to_f32;
using brine::exp_poly;
using brine::f32_to_bf16;

template <int DT>
inline float load1(const void* p, int64_t i) {
    if constexpr (DT == kDtypeF32) return static_cast<const float*>(p)[i];
    else return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

template <int DT>
inline float round_dtype(float v) {
    if constexpr (DT == kDtypeF32) return v;
    else return bf16_to_f32(f32_to_bf16(v));
}

template <int DT>
inline void store1(void* p, int64_t i, float v) {
    if constexpr (DT == kDtypeF32) static_cast<float*>(p)[i] = v;
    else static_cast<uint16_t*>(p)[i] = f32_to_bf16(v);
}

inline float pow2(int k) {  // 2^k for -126 <= k <= 127, from its exponent bits
    const uint32_t u = static_cast<uint32_t>(k + 127) << 23;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

// exp16's arithmetic on one lane, without libm calls (they made SiLU ~70x slower than the AVX512 code):
// roundscale to nearest is the 1.5 * 2^23 trick (exact for |x| < 2^22: here |x log2 e| <= 128), and scalef by
// an integral k is two multiplications by powers of two (the first exact, the second rounding once, as scalef
// does, where the result is subnormal), so that 2^128 for x near 88.7 needs no infinity.
inline float exp1(float x) {
    x = x > -87.3f ? x : -87.3f;  // maxps(x, c): c where x is NaN, as here
    x = x < 88.7f ? x : 88.7f;
    const float magic = 12582912.0f;
    const float k = (x * 1.44269504088896341f + magic) - magic;
    float r = std::fma(-k, 0.693359375f, x);
    r = std::fma(-k, -2.12194440e-4f, r);
    const float p = std::fma(exp_poly(r), r * r, r + 1.0f);
    const int ki = static_cast<int>(k), half = ki / 2;
    return (p * pow2(half)) * pow2(ki - half);
}

template <int DT>
void add_rms_norm(const void* h, const void* delta, void* h_sum, const void* weight, void* out, int64_t rows,
                  int64_t n, float eps, int threads) {
    const void* src = delta != nullptr ? h_sum : h;  // the norm's input, once the sum is written
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t t = 0; t < rows; ++t) {
        const int64_t base = t * n;
        float lanes[16] = {};  // lane j: the squares of elements j, j + 16, ... (as the AVX512 code's lanes)
        for (int64_t i0 = 0; i0 < n; i0 += 16) {
            const int len = n - i0 < 16 ? static_cast<int>(n - i0) : 16;
            for (int j = 0; j < len; ++j) {
                float v = load1<DT>(h, base + i0 + j);
                if (delta != nullptr) {
                    v = round_dtype<DT>(v + load1<DT>(delta, base + i0 + j));
                    store1<DT>(h_sum, base + i0 + j, v);
                }
                lanes[j] = std::fma(v, v, lanes[j]);
            }
        }
        for (int w = 8; w >= 1; w /= 2)
            for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
        const float inv = 1.0f / std::sqrt(lanes[0] / static_cast<float>(n) + eps);
        for (int64_t i = 0; i < n; ++i) {
            const float y = round_dtype<DT>(load1<DT>(src, base + i) * inv);
            store1<DT>(out, base + i, load1<DT>(weight, i) * y);
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// SiLU in 8 lanes on AVX2, with exp1's and round_dtype's operations lane by lane in the same order, so its bits
// are the scalar code's (and so the AVX512 code's). The scalar loop made SiLU ~8% of a cold 2,000-token
// prefill on the AVX2 tier.
template <int DT>
inline __m256 load8(const void* p, int64_t i) {
    if constexpr (DT == kDtypeF32) {
        return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    } else {
        const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
}

inline __m256i bf16_bits8(__m256 v) {  // f32_to_bf16's bits, in the low half of each dword
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    return _mm256_blendv_epi8(rounded, quiet, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

template <int DT>
inline __m256 round_dtype8(__m256 v) {
    if constexpr (DT == kDtypeF32) return v;
    else return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
}

template <int DT>
inline void store8(void* p, int64_t i, __m256 v) {
    if constexpr (DT == kDtypeF32) {
        _mm256_storeu_ps(static_cast<float*>(p) + i, v);
    } else {
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bf16_bits8(v), _mm256_setzero_si256()), 0xd8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), _mm256_castsi256_si128(packed));
    }
}

inline __m256i pow2_8(__m256i k) { return _mm256_slli_epi32(_mm256_add_epi32(k, _mm256_set1_epi32(127)), 23); }

inline __m256 exp8(__m256 x) {  // exp1, lane by lane
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));  // x > c ? x : c
    x = _mm256_min_ps(x, _mm256_set1_ps(88.7f));   // x < c ? x : c
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 k = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(brine::kExpPoly[0]);
    for (int i = 1; i < 6; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(brine::kExpPoly[i]));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i ki = _mm256_cvttps_epi32(k);  // k is integral: exact
    const __m256i half = _mm256_srai_epi32(_mm256_add_epi32(ki, _mm256_srli_epi32(ki, 31)), 1);  // ki / 2, as C's /
    return _mm256_mul_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(pow2_8(half))),
                         _mm256_castsi256_ps(pow2_8(_mm256_sub_epi32(ki, half))));
}
#endif

template <int DT>
void silu_mul(const void* gate_up, void* out, int64_t rows, int64_t n, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (rows > 1)
    for (int64_t t = 0; t < rows; ++t) {
        int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
        for (; i + 8 <= n; i += 8) {
            const __m256 g = load8<DT>(gate_up, t * 2 * n + i), up = load8<DT>(gate_up, t * 2 * n + n + i);
            const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            const __m256 sg = round_dtype8<DT>(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
            store8<DT>(out, t * n + i, _mm256_mul_ps(sg, up));
        }
#endif
        for (; i < n; ++i) {
            const float g = load1<DT>(gate_up, t * 2 * n + i), up = load1<DT>(gate_up, t * 2 * n + n + i);
            const float s = round_dtype<DT>(g / (1.0f + exp1(0.0f - g)));
            store1<DT>(out, t * n + i, s * up);
        }
    }
}

template <int DT>
void rope_head(const void* x, int64_t xi, const void* cos, const void* sin, int64_t ci, void* y, int64_t yi,
               int64_t half) {
    for (int64_t i = 0; i < half; ++i) {
        const float x1 = load1<DT>(x, xi + i), x2 = load1<DT>(x, xi + half + i);
        const float c = load1<DT>(cos, ci + i), s = load1<DT>(sin, ci + i);
        store1<DT>(y, yi + i, round_dtype<DT>(x1 * c) - round_dtype<DT>(x2 * s));
        store1<DT>(y, yi + half + i, round_dtype<DT>(x2 * c) + round_dtype<DT>(x1 * s));
    }
}

template <int DT>
void rope_write(const void* qkv, int64_t qkv_stride, const void* cos, const void* sin, const int64_t* slots,
                void* k_cache, void* v_cache, void* q_out, int64_t tokens, int heads, int kv_heads, int dim,
                int threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for num_threads(threads) schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; ++t) {
        const int64_t row = t * qkv_stride, slot = slots[t];
        for (int j = 0; j < heads; ++j) rope_head<DT>(qkv, row + j * dim, cos, sin, t * half, q_out, (t * heads + j) * dim, half);
        for (int j = 0; j < kv_heads; ++j)
            rope_head<DT>(qkv, row + (heads + j) * dim, cos, sin, t * half, k_cache, (slot * kv_heads + j) * dim, half);
        const size_t bytes = static_cast<size_t>(kv_heads) * dim * (DT == kDtypeF32 ? 4 : 2);
        const int64_t v0 = row + static_cast<int64_t>(heads + kv_heads) * dim;
        std::memcpy(static_cast<char*>(v_cache) + slot * bytes, static_cast<const char*>(qkv) + v0 * (DT == kDtypeF32 ? 4 : 2), bytes);
    }
}

}  // namespace
#endif  // BRINE_ELEMENTWISE_AVX512

namespace {

// float32 activations over a float16 KV cache (`brine serve --kv-cache-dtype float16`): q as rope_write<float32>
// writes it; k is roped in float32 (the same rope_head), then k and v are rounded to float16, nearest even, as
// the Python path's `.to(torch.float16)` into the cache rounds them. Each row by one thread, as rope_write.
void rope_write_kv16(const void* qkv, int64_t qkv_stride, const void* cos, const void* sin, const int64_t* slots,
                     void* k_cache, void* v_cache, void* q_out, int64_t tokens, int heads, int kv_heads, int dim,
                     int threads) {
    const int64_t half = dim / 2, width = static_cast<int64_t>(kv_heads) * dim;
    const float* x = static_cast<const float*>(qkv);
    uint16_t* kc = static_cast<uint16_t*>(k_cache);
    uint16_t* vc = static_cast<uint16_t*>(v_cache);
#pragma omp parallel num_threads(threads) if (tokens > 1)
    {
        std::vector<float> k(static_cast<size_t>(width));
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; ++t) {
            const int64_t row = t * qkv_stride, slot = slots[t];
            for (int j = 0; j < heads; ++j)
                rope_head<kDtypeF32>(qkv, row + j * dim, cos, sin, t * half, q_out, (t * heads + j) * dim, half);
            for (int j = 0; j < kv_heads; ++j)
                rope_head<kDtypeF32>(qkv, row + (heads + j) * dim, cos, sin, t * half, k.data(), j * dim, half);
            const float* v = x + row + static_cast<int64_t>(heads + kv_heads) * dim;
            for (int64_t i = 0; i < width; ++i) kc[slot * width + i] = brine::f32_to_f16(k[i]);
            for (int64_t i = 0; i < width; ++i) vc[slot * width + i] = brine::f32_to_f16(v[i]);
        }
    }
}

}  // namespace

extern "C" {

int brine_elementwise_supported() { return 1; }  // every tier (kept for the loader's check)

// h, delta [rows, n]: h_sum = h + delta is written and normalised (delta null: h is normalised, h_sum unused);
// weight [n]; out [rows, n]. All contiguous, of `dtype` (0 float32, 1 bfloat16); h_sum may be h.
// Returns non-zero for arguments it refuses.
int brine_add_rms_norm(int dtype, const void* h, const void* delta, void* h_sum, const void* weight, void* out,
                       int64_t rows, int64_t n, float eps, int threads) {
    if (rows < 0 || n <= 0 || threads <= 0 || (dtype != kDtypeF32 && dtype != kDtypeBF16)) return 1;
    if (dtype == kDtypeF32)
        add_rms_norm<kDtypeF32>(h, delta, h_sum, weight, out, rows, n, eps, threads);
    else
        add_rms_norm<kDtypeBF16>(h, delta, h_sum, weight, out, rows, n, eps, threads);
    return 0;
}

// gate_up [rows, 2n] (gate, then up), out [rows, n]; contiguous, of `dtype`.
int brine_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t n, int threads) {
    if (rows < 0 || n <= 0 || threads <= 0 || (dtype != kDtypeF32 && dtype != kDtypeBF16)) return 1;
    if (dtype == kDtypeF32)
        silu_mul<kDtypeF32>(gate_up, out, rows, n, threads);
    else
        silu_mul<kDtypeBF16>(gate_up, out, rows, n, threads);
    return 0;
}

// qkv [tokens, (heads + 2 kv_heads) dim] with row stride qkv_stride (elements); cos, sin [tokens, dim / 2] in
// the model dtype; slots [tokens]: k and v go to k_cache / v_cache [slot][kv_heads][dim] (contiguous), of
// kv_dtype: the model dtype, or float16 under float32 (rounded to nearest even);
// q_out [tokens, heads, dim]. Every token's K and V are written before this returns.
int brine_rope_write(int dtype, int kv_dtype, const void* qkv, int64_t qkv_stride, const void* cos, const void* sin,
                     const int64_t* slots, void* k_cache, void* v_cache, void* q_out, int64_t tokens, int heads,
                     int kv_heads, int dim, int threads) {
    if (tokens < 0 || heads <= 0 || kv_heads <= 0 || dim <= 0 || dim % 2 || threads <= 0 ||
        (dtype != kDtypeF32 && dtype != kDtypeBF16))
        return 1;
    if (kv_dtype != dtype) {  // float16 caches under float32 only
        if (dtype != kDtypeF32 || kv_dtype != brine::kDtypeF16) return 1;
        rope_write_kv16(qkv, qkv_stride, cos, sin, slots, k_cache, v_cache, q_out, tokens, heads, kv_heads, dim, threads);
        return 0;
    }
    if (dtype == kDtypeF32)
        rope_write<kDtypeF32>(qkv, qkv_stride, cos, sin, slots, k_cache, v_cache, q_out, tokens, heads, kv_heads, dim, threads);
    else
        rope_write<kDtypeBF16>(qkv, qkv_stride, cos, sin, slots, k_cache, v_cache, q_out, tokens, heads, kv_heads, dim, threads);
    return 0;
}

}  // extern "C"
