// Sixteen float32 lanes for every CPU tier, behind one type (engine/model/csrc/*.cpp): the kernels are written
// once against `VF` and its functions, and the compiler's target picks the implementation:
//   - AVX512F + BW:           one __m512 (also the AVX512-BF16 tier, whose bfloat16 dot products are extra);
//   - AVX2 + FMA + F16C:      two __m256 (lanes 0-7, then 8-15);
//   - anything else:          four 16-byte GNU vectors (ARM64's NEON, old x86's SSE, or plain code where a
//                             target has no vectors): the portable tier, with no intrinsics.
// Every function is lane-wise IEEE arithmetic (fma is fused, rounded once; add, sub, mul, div rounded once; vmax is
// a > b ? a : b; vkeep picks x where lo <= pos < hi, else other), so a lane's
// bits are the same on every tier: the kernels' results differ between tiers only where a tier has an
// instruction the others emulate differently (AVX512-BF16's vdpbf16ps), never within one tier by batch.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dtypes.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define BRINE_SIMD_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define BRINE_SIMD_AVX2 1
#include <immintrin.h>
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define BRINE_SIMD_DPBF16 1  // vdpbf16ps: bfloat16 pairs, float32 sums
#endif
#if defined(BRINE_SIMD_DPBF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define BRINE_SIMD_AMX 1  // tdpbf16ps: the bfloat16 linears' and attention's dot products on tiles (amx.h)
#endif

namespace brine::simd {

// The tier this file was compiled for, as the startup log and the tests name it.
#if defined(BRINE_SIMD_DPBF16)
constexpr const char* kTier = "avx512-bf16";
#elif defined(BRINE_SIMD_AVX512) && defined(__AVX512VNNI__)
constexpr const char* kTier = "avx512-vnni";
#elif defined(BRINE_SIMD_AVX512)
constexpr const char* kTier = "avx512";
#elif defined(BRINE_SIMD_AVX2)
constexpr const char* kTier = "avx2";
#else
constexpr const char* kTier = "portable";
#endif

#if defined(BRINE_SIMD_AVX512)
struct VF {
    __m512 v;
};
inline VF vzero() { return {_mm512_setzero_ps()}; }
inline VF vset1(float x) { return {_mm512_set1_ps(x)}; }
inline VF vfmadd(VF a, VF b, VF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline VF vadd(VF a, VF b) { return {_mm512_add_ps(a.v, b.v)}; }
inline VF vload_f16(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline __mmask16 vmask(int count) { return count >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << count) - 1); }
inline VF vload_part(const float* p, int count) { return {_mm512_maskz_loadu_ps(vmask(count), p)}; }
inline void vstore(float* p, VF x) { _mm512_storeu_ps(p, x.v); }
inline void vstore_part(float* p, VF x, int count) { _mm512_mask_storeu_ps(p, vmask(count), x.v); }
inline VF vload(const float* p) { return {_mm512_loadu_ps(p)}; }
inline VF vmul(VF a, VF b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline VF vdiv(VF a, VF b) { return {_mm512_div_ps(a.v, b.v)}; }
inline VF vsub(VF a, VF b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline VF vmax(VF a, VF b) { return {_mm512_max_ps(a.v, b.v)}; }  // vmaxps: a > b ? a : b (NaN, +-0 too)
inline VF vkeep(VF pos, VF lo, VF hi, VF x, VF other) {
    const __mmask16 in = _mm512_cmp_ps_mask(lo.v, pos.v, _CMP_LE_OQ) & _mm512_cmp_ps_mask(pos.v, hi.v, _CMP_LT_OQ);
    return {_mm512_mask_blend_ps(in, other.v, x.v)};
}
inline VF vpow2i(VF n) {  // 2^n for integral n in [-126, 127]: the exponent bits ((int)n + 127) << 23
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n.v), _mm512_set1_epi32(127)), 23);
    return {_mm512_castsi512_ps(e)};
}
#elif defined(BRINE_SIMD_AVX2)
struct VF {
    __m256 a, b;
};
inline VF vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline VF vset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline VF vfmadd(VF a, VF b, VF c) { return {_mm256_fmadd_ps(a.a, b.a, c.a), _mm256_fmadd_ps(a.b, b.b, c.b)}; }
inline VF vadd(VF a, VF b) { return {_mm256_add_ps(a.a, b.a), _mm256_add_ps(a.b, b.b)}; }
inline VF vload_f16(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void vstore(float* p, VF x) {
    _mm256_storeu_ps(p, x.a);
    _mm256_storeu_ps(p + 8, x.b);
}
inline VF vload_part(const float* p, int count) {
    if (count >= 16) return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)};
    alignas(32) float t[16] = {};
    std::memcpy(t, p, sizeof(float) * static_cast<size_t>(count));
    return {_mm256_load_ps(t), _mm256_load_ps(t + 8)};
}
inline void vstore_part(float* p, VF x, int count) {
    if (count >= 16) return vstore(p, x);
    alignas(32) float t[16];
    vstore(t, x);
    std::memcpy(p, t, sizeof(float) * static_cast<size_t>(count));
}
inline VF vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline VF vmul(VF a, VF b) { return {_mm256_mul_ps(a.a, b.a), _mm256_mul_ps(a.b, b.b)}; }
inline VF vdiv(VF a, VF b) { return {_mm256_div_ps(a.a, b.a), _mm256_div_ps(a.b, b.b)}; }
inline VF vsub(VF a, VF b) { return {_mm256_sub_ps(a.a, b.a), _mm256_sub_ps(a.b, b.b)}; }
inline VF vmax(VF a, VF b) { return {_mm256_max_ps(a.a, b.a), _mm256_max_ps(a.b, b.b)}; }  // a > b ? a : b
inline __m256 keep8(__m256 pos, __m256 lo, __m256 hi, __m256 x, __m256 other) {
    const __m256 in = _mm256_and_ps(_mm256_cmp_ps(lo, pos, _CMP_LE_OQ), _mm256_cmp_ps(pos, hi, _CMP_LT_OQ));
    return _mm256_blendv_ps(other, x, in);
}
inline VF vkeep(VF pos, VF lo, VF hi, VF x, VF other) {
    return {keep8(pos.a, lo.a, hi.a, x.a, other.a), keep8(pos.b, lo.b, hi.b, x.b, other.b)};
}
inline __m256 pow2i8(__m256 n) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23));
}
inline VF vpow2i(VF n) { return {pow2i8(n.a), pow2i8(n.b)}; }
#else
// Four 4-lane GNU vectors (vector_size(16): what NEON and SSE hold in one register), so that the compiler emits
// their vector instructions lane for lane on any target; the same IEEE operations as plain loops would do.
typedef float F4 __attribute__((vector_size(16)));
typedef int32_t I4 __attribute__((vector_size(16)));
struct alignas(64) VF {
    F4 q[4];
};
// fma of 4 lanes, each rounded once: the compiler turns the four into one vector fma (fmla on ARM64, vfmadd with FMA)
inline F4 fma4(F4 a, F4 b, F4 c) {
    return F4{__builtin_fmaf(a[0], b[0], c[0]), __builtin_fmaf(a[1], b[1], c[1]), __builtin_fmaf(a[2], b[2], c[2]),
              __builtin_fmaf(a[3], b[3], c[3])};
}
inline VF vzero() { return VF{}; }
inline VF vset1(float x) {
    const F4 b = {x, x, x, x};
    return VF{{b, b, b, b}};
}
inline VF vfmadd(VF a, VF b, VF c) {
    for (int i = 0; i < 4; ++i) c.q[i] = fma4(a.q[i], b.q[i], c.q[i]);
    return c;
}
inline VF vadd(VF a, VF b) {
    for (int i = 0; i < 4; ++i) a.q[i] += b.q[i];
    return a;
}
// dtypes.h's f16_to_f32 for 4 lanes, with selects instead of branches: the same exact values (a subnormal half is
// m x 2^-24, and float(m) x 2^-24 is exact), the same quiet NaNs.
inline F4 half4(const uint16_t* p) {
    typedef uint16_t U16x4 __attribute__((vector_size(8)));
    U16x4 h;
    std::memcpy(&h, p, sizeof h);
    const I4 x = __builtin_convertvector(h, I4);
    const I4 sign = (x & 0x8000) << 16, e = (x >> 10) & 0x1f, m = x & 0x3ff;
    const F4 sub = __builtin_convertvector(m, F4) * (1.0f / 16777216.0f);
    I4 subnormal;
    std::memcpy(&subnormal, &sub, sizeof sub);
    const I4 special = sign | 0x7f800000 | (m << 13) | (m != 0 ? 0x400000 : 0);  // inf, or a quiet NaN
    const I4 bits = e == 0 ? (sign | subnormal) : e == 31 ? special : (sign | ((e + 112) << 23) | (m << 13));
    F4 r;
    std::memcpy(&r, &bits, sizeof r);
    return r;
}
inline VF vload_f16(const uint16_t* p) { return VF{{half4(p), half4(p + 4), half4(p + 8), half4(p + 12)}}; }
inline void vstore(float* p, VF x) { std::memcpy(p, x.q, sizeof x.q); }
inline VF vload_part(const float* p, int count) {
    VF r{};
    std::memcpy(r.q, p, sizeof(float) * static_cast<size_t>(count < 16 ? count : 16));
    return r;
}
inline void vstore_part(float* p, VF x, int count) {
    std::memcpy(p, x.q, sizeof(float) * static_cast<size_t>(count < 16 ? count : 16));
}
inline VF vload(const float* p) {
    VF r;
    std::memcpy(r.q, p, sizeof r.q);
    return r;
}
inline VF vmul(VF a, VF b) {
    for (int i = 0; i < 4; ++i) a.q[i] *= b.q[i];
    return a;
}
inline VF vdiv(VF a, VF b) {
    for (int i = 0; i < 4; ++i) a.q[i] /= b.q[i];
    return a;
}
inline VF vsub(VF a, VF b) {
    for (int i = 0; i < 4; ++i) a.q[i] -= b.q[i];
    return a;
}
inline VF vmax(VF a, VF b) {
    for (int i = 0; i < 4; ++i) a.q[i] = a.q[i] > b.q[i] ? a.q[i] : b.q[i];
    return a;
}
inline VF vkeep(VF pos, VF lo, VF hi, VF x, VF other) {
    for (int i = 0; i < 4; ++i) x.q[i] = ((lo.q[i] <= pos.q[i]) & (pos.q[i] < hi.q[i])) ? x.q[i] : other.q[i];
    return x;
}
inline VF vpow2i(VF n) {
    VF r;
    for (int i = 0; i < 4; ++i) {
        const I4 e = (__builtin_convertvector(n.q[i], I4) + 127) << 23;
        std::memcpy(&r.q[i], &e, sizeof e);
    }
    return r;
}
#endif

}  // namespace brine::simd
