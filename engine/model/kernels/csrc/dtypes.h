// What Brine's CPU kernels share (engine/model/csrc/*.cpp): the dtype codes the Python side passes
// (native_kernels.DTYPE_CODES), scalar bfloat16 conversions, and the polynomial of their exp functions.
#pragma once

#include <cstdint>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif

namespace brine {

constexpr int kDtypeF32 = 0;
constexpr int kDtypeBF16 = 1;
constexpr int kDtypeF16 = 2;

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as torch's .to(torch.bfloat16)
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// IEEE half <-> float: F16C's instructions where the build has them, else integer and float32 arithmetic with
// their results (C++ has no portable half type: GCC 12 has no _Float16 in C++ on ARM64, and __fp16 is ARM's
// alone). f32_to_f16 rounds to nearest even (as vcvtps2ph and torch's .to(torch.float16) do); a NaN stays a quiet
// NaN with the top of its payload both ways. The fallbacks equal the instructions on all 2^32 floats and 2^16
// halves (checked exhaustively when they were written), so every tier stores and reads the same bits.
inline float f16_to_f32(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    uint32_t u;
    if (exp == 0x1fu) {  // inf, or a NaN made quiet (as vcvtph2ps does)
        u = sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0u);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else {  // zero or subnormal: man x 2^-24, exact in float32
        const float f = static_cast<float>(man) * (1.0f / 16777216.0f);
        std::memcpy(&u, &f, 4);
        u |= sign;
    }
    float f;
    std::memcpy(&f, &u, 4);
    return f;
#endif
}

inline uint16_t f32_to_f16(float f) {
#if defined(__F16C__)
    return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | static_cast<uint16_t>(0x7e00u | ((u >> 13) & 0x3ffu));  // NaN
    if (u >= 0x47800000u) return sign | 0x7c00u;  // >= 2^16 (and inf): inf
    if (u < 0x38800000u) {
        // below 2^-14, a subnormal half or zero: adding 0.5 puts |f| x 2^24 in the low mantissa bits, rounded to
        // nearest even by the float addition itself (0.5 + |f| is normal: no flush-to-zero can touch it)
        float a;
        std::memcpy(&a, &u, 4);
        a += 0.5f;
        uint32_t r;
        std::memcpy(&r, &a, 4);
        return sign | static_cast<uint16_t>(r - 0x3f000000u);
    }
    // normal: rebias the exponent and round the mantissa's low 13 bits to nearest even (a carry into the exponent
    // is right, up to inf at 65520 and above)
    u += 0xc8000fffu + ((u >> 13) & 1u);
    return sign | static_cast<uint16_t>(u >> 13);
#endif
}

// Cephes' expf polynomial: for |r| <= ln 2 / 2, exp(r) ~ 1 + r + r^2 p(r); p's coefficients, highest first.
// The attention's and SiLU's exp functions differ in how they reduce x and rebuild the result (the attention's
// must match its scalar version bit for bit), not in this Horner chain.
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float exp_poly(float r) {  // p(r), fma by fma
    float p = kExpPoly[0];
    for (int i = 1; i < 6; ++i) p = std::fma(p, r, kExpPoly[i]);
    return p;
}

#if defined(__AVX512F__)
inline __m512 exp_poly16(__m512 r) {  // p(r) in 16 lanes: the same fmas in the same order
    __m512 p = _mm512_set1_ps(kExpPoly[0]);
    for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpPoly[i]));
    return p;
}
#endif

}  // namespace brine
