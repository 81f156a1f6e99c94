// What Brine's CPU kernels share (engine/model/csrc/*.cpp): the dtype codes the Python side passes
// (native_kernels.DTYPE_CODES), scalar bfloat16 conversions, and the polynomial of their exp functions.
#pragma once

#include <cstdint>
#include <cmath>
#include <cstring>

#if defined(__AVX512F__)
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
