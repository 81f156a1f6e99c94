// y = x W^T (+ b) on GGUF-quantized weights kept as stored (engine/model/quant_linear.py), on every CPU tier.
//
// Why: a decode step streams every weight once. As bfloat16 the default model's linears are ~270 MB per token;
// as the GGUF's own Q4_1 blocks (and the Q8_0 output head) they are ~96 MB, and the step is bound by that
// stream. The weights are the GGUF's exact values, d * q + m, never rounded to 16 bits.
//
// Layout (written once at load by quant_linear.records): the output features are cut into tiles of 16; for
// each tile and each block of 32 input features there is one record, of one of these kinds (wtype bits):
//   1: int8 q (else 4-bit q in 0..15);  2: a min m per block;  4: scales are float32 (else float16);
//   8: two scales per block, d0 for inputs 0-15 and d1 for 16-31 (int8, no min: Q6_K's 16-input scales).
//   16: not the record's: x is quantized to Q8 per block and the dot products are integers (quant_q8.h).
// A record: 16 d (then 16 m, or 16 d1) for the tile's 16 columns, then the q:
//   4-bit: 256 bytes of nibbles, q[c][i] for the 16 columns c and 32 inputs i, in the order unpack reads them
//   int8:  16 pairs x 16 x 2 int8, (q[c][2p], q[c][2p+1])
// so one 16-byte (or 32-byte) load gives one input pair for all 16 outputs of the tile. GGUF types map onto
// these kinds exactly (quant_linear.py): Q4_1 -> 2, Q4_0 -> 2 (m = -8 d), Q8_0 -> 1, Q5_0 -> 1 (q - 16),
// Q5_1 -> 3, Q4_K -> 6, Q5_K -> 7, Q6_K -> 13.
//
// Arithmetic, per output column n and input row r, over the K / 32 blocks b in order:
//   P = sum over the block's 32 inputs, in order, of q[n][i] x[i]             (from P = 0)
//   total = fma(d[n][b], P, total); total = fma(m[n][b], S[r][b], total)  (S: the block's x summed in order from 0)
//   (two scales: P0 over inputs 0-15 and P1 over 16-31, total = fma(d0, P0, total), then fma(d1, P1, total))
//   y = round(total + bias[n]) to the output dtype
// That is the float32 path of every tier (simd.h: the same lane arithmetic on AVX512, AVX2 and the portable
// build, so its bits are the same on all of them); bfloat16 activations are widened to float32 first (exact).
// On AVX512-BF16 the bfloat16 path instead takes P's pairs with `vdpbf16ps` (q and x are exact in bfloat16, so
// every product is exact; the instruction's own order of the two adds, and its flushing of subnormals, make
// its bits its own). With AMX (an AMX Xeon, where Linux grants the tiles), P comes from tdpbf16ps instead, for every
// row count alike (amx_blocks): its products are exact too, but it sums the even and the odd pairs apart, so its
// bits are its own again; 2.9-3.9x faster than vdpbf16ps from 128 rows up, the same at one row (2 threads).
// Either way, per row, the sequence depends only on the row's own x and the weights.
//
// Invariance: rows are processed in groups (of up to 12 or 16, from a copy of x packed per group, see run) and
// columns in tiles by any thread, but no lane ever mixes rows or columns, and the block order is fixed: a row's
// bits do not depend on the batch, its position in it, or the thread count.

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "dtypes.h"
#include "entry_points.h"
#include "simd.h"

namespace {

using namespace brine::simd;
using brine::kDtypeBF16;
using brine::kDtypeF32;

constexpr int kTile = 16;   // output features per tile: one VF
constexpr int kBlock = 32;  // input features per GGUF block
constexpr int kPairs = kBlock / 2;
constexpr int64_t kPrefetch = 4096;  // bytes ahead of the record being unpacked
constexpr int kDirectRows = 48;  // up to this many rows, records are used as unpacked (measured crossover)

// wtype bits (the header); kQ8Act: quantize x to Q8 per block and take integer dot products (quant_q8.h)
constexpr int kInt8 = 1, kMin = 2, kF32Scales = 4, kHalves = 8, kQ8Act = 16;
constexpr int kKnownBits = kInt8 | kMin | kF32Scales | kHalves | kQ8Act;
constexpr int kQ4 = 0, kQ8 = 1;  // the weight template: how q is stored

#if defined(BRINE_SIMD_DPBF16)
constexpr bool kBf16Dot = true;
#else
constexpr bool kBf16Dot = false;
#endif

// The float32 dot products of R rows (NB blocks at a time: blocks_at_once) take input_step(R) inputs'
// weight vectors at a time (each lane's fmas in the same order either way). AVX512: two. AVX2's 16 ymm hold
// 2 x R x NB partial sums, the R rows' totals (2 x R), the inputs' weights (2 each) and x's broadcast: two
// inputs fit only beside one row and 4 blocks (15); elsewhere they spilled a partial sum, whose chain then waited
// on a store-to-load forward in every iteration. One at a time there: 6 rows measured 1.05-1.2x faster (one
// thread), and 2 and 3 rows beside 2 blocks are in blocks_at_once's figures. 4 rows spill either way and measured
// ~5% faster with two (gate/up 3.04 against 3.24 ms, spec_step_cost.py --kernels 4 --clock wall).
constexpr int input_step(int rows) {
#if defined(BRINE_SIMD_AVX2)
    return rows == 1 || rows == 4 ? 2 : 1;
#else
    return static_cast<void>(rows), 2;
#endif
}

// Rows per group, at most (measured on AVX512): each row is one chain of dot products per lane, and each group
// reads the weights again (from cache), which costs the wider int8 records more. AVX2 has 16 vector registers
// for two per VF, and the portable build none to spare: fewer rows there.
#if defined(BRINE_SIMD_AMX)
constexpr int max_rows(int) { return 16; }  // a tile's rows
#elif defined(BRINE_SIMD_AVX512)
constexpr int max_rows(int wt) { return wt == kQ4 ? 12 : 16; }
#elif defined(BRINE_SIMD_AVX2)
constexpr int max_rows(int) { return 6; }
#else
constexpr int max_rows(int) { return 4; }
#endif

// What a record holds, from its wtype.
struct Kind {
    int bits;
    bool int8() const { return bits & kInt8; }
    bool min() const { return bits & kMin; }
    bool halves() const { return bits & kHalves; }
    bool q8act() const { return bits & kQ8Act; }
    int scale_bytes() const { return bits & kF32Scales ? 4 : 2; }
    int64_t scales_bytes() const { return kTile * scale_bytes() * (min() || halves() ? 2 : 1); }
    int64_t bytes() const { return scales_bytes() + (int8() ? kPairs * kTile * 2 : kPairs * kTile); }
};

// The record's two scale vectors as float32: d, then m or d1 (0 where it has neither).
inline void load_scales(const uint8_t* rec, Kind kind, VF* dm) {
    const bool two = kind.min() || kind.halves();
    if (kind.scale_bytes() == 2) {
        const uint16_t* s = reinterpret_cast<const uint16_t*>(rec);
        dm[0] = vload_f16(s);
        dm[1] = two ? vload_f16(s + kTile) : vzero();
    } else {
        const float* s = reinterpret_cast<const float*>(rec);
        dm[0] = vload_part(s, kTile);
        dm[1] = two ? vload_part(s + kTile, kTile) : vzero();
    }
}

inline void prefetch_record(const uint8_t* rec, Kind kind) {
    // The weights stream from memory once per call: ask for the lines kPrefetch bytes ahead (the rest of this
    // tile, then the next one, which follows it in memory) while these convert.
    for (int64_t o = 0; o < kind.bytes(); o += 64) __builtin_prefetch(rec + kPrefetch + o, 0, 3);
}

// ---- Unpacking one record's q into float32 vectors: w[i] = input i's q for the 16 columns, i = 0..31 ----

#if defined(BRINE_SIMD_AVX512) || defined(BRINE_SIMD_AVX2)
// bfloat16 of 0..15, split into its low and high bytes: vpshufb's tables (one per 128-bit lane)
inline __m128i bf16_table_lo() {
    return _mm_setr_epi8(0x00, static_cast<char>(0x80), 0x00, 0x40, static_cast<char>(0x80), static_cast<char>(0xa0),
                         static_cast<char>(0xc0), static_cast<char>(0xe0), 0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60,
                         0x70);
}
inline __m128i bf16_table_hi() {
    return _mm_setr_epi8(0x00, 0x3f, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41,
                         0x41);
}
#endif

#if defined(BRINE_SIMD_AVX512)
// The 4-bit q of one record as 16 vectors of bfloat16 pairs: pv[p] dword c = (q[c][2p], q[c][2p+1]).
// Each 64-byte chunk j holds pairs 4j .. 4j + 3 (the layout's order): the low nibbles of each lane's first and
// last 8 bytes are pairs 4j and 4j + 1, the high nibbles 4j + 2 and 4j + 3. A table lookup gives each nibble's
// bfloat16 bytes, and interleaving them gives the words in place.
// q4_chunk: chunk j's four pair vectors alone (pv[0 .. 3] = pairs 4j .. 4j + 3).
inline void q4_chunk(const uint8_t* qs, int j, __m512i* pv) {
    const __m512i table_lo = _mm512_broadcast_i32x4(bf16_table_lo()), table_hi = _mm512_broadcast_i32x4(bf16_table_hi());
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    const __m512i v = _mm512_loadu_si512(qs + 64 * j);
    const __m512i nib[2] = {_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
    for (int h = 0; h < 2; ++h) {
        const __m512i lo = _mm512_shuffle_epi8(table_lo, nib[h]), hi = _mm512_shuffle_epi8(table_hi, nib[h]);
        pv[2 * h] = _mm512_unpacklo_epi8(lo, hi);
        pv[2 * h + 1] = _mm512_unpackhi_epi8(lo, hi);
    }
}
inline void q4_pairs(const uint8_t* qs, __m512i* pv_out) {
    for (int j = 0; j < 4; ++j) q4_chunk(qs, j, pv_out + 4 * j);
}

// int8 q: input i's 16 weights as float32 (exact), straight from the record's q: pair i / 2's 32 int8
// (q[c][2p], q[c][2p+1]) for c = 0..15, widened to 16-bit words, input i's the low or high word of each dword.
inline VF int8_input(const uint8_t* qs, int i) {
    const __m512i q = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + (i / 2) * 2 * kTile)));
    return {_mm512_cvtepi32_ps(i % 2 ? _mm512_srai_epi32(q, 16) : _mm512_srai_epi32(_mm512_slli_epi32(q, 16), 16))};
}
// A chunk's four pair vectors (q4_chunk), and its input j (0-7) as float32: the low (even j) or high (odd j)
// bfloat16 of pair j / 2, widened (exact).
using Q4Chunk = __m512i[4];
inline VF q4_input(const __m512i* pv, int j) {
    const __m512i v = pv[j / 2];
    return {_mm512_castsi512_ps(j % 2 ? _mm512_and_si512(v, _mm512_set1_epi32(static_cast<int>(0xffff0000u)))
                                      : _mm512_slli_epi32(v, 16))};
}
#elif defined(BRINE_SIMD_AVX2)
// As the AVX512 unpacking, on 256-bit halves: bytes 0-31 of a chunk are columns 0-7 (its first two 128-bit
// lanes), bytes 32-63 columns 8-15; vpshufb and the byte unpacks act per 128-bit lane on both widths.
// q4_chunk: chunk j's pairs 4j .. 4j + 3 as bfloat16 pairs, pv[pair][columns 0-7, 8-15].
inline void q4_chunk(const uint8_t* qs, int j, __m256i (*pv)[2]) {
    const __m256i table_lo = _mm256_broadcastsi128_si256(bf16_table_lo());
    const __m256i table_hi = _mm256_broadcastsi128_si256(bf16_table_hi());
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i v[2] = {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * j)),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * j + 32))};
    for (int h = 0; h < 2; ++h)
        for (int s = 0; s < 2; ++s) {
            const __m256i nib = _mm256_and_si256(h ? _mm256_srli_epi16(v[s], 4) : v[s], low4);
            const __m256i lo = _mm256_shuffle_epi8(table_lo, nib), hi = _mm256_shuffle_epi8(table_hi, nib);
            pv[2 * h][s] = _mm256_unpacklo_epi8(lo, hi);
            pv[2 * h + 1][s] = _mm256_unpackhi_epi8(lo, hi);
        }
}
// int8 q: input i's 16 weights as float32 (exact), as the AVX512 one, columns 0-7 and 8-15 apart.
inline VF int8_input(const uint8_t* qs, int i) {
    const uint8_t* at = qs + (i / 2) * 2 * kTile;
    const __m256i a = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
    const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at + 16)));
    if (i % 2) return {_mm256_cvtepi32_ps(_mm256_srai_epi32(a, 16)), _mm256_cvtepi32_ps(_mm256_srai_epi32(b, 16))};
    return {_mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(a, 16), 16)),
            _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(b, 16), 16))};
}
// As the AVX512 ones: a chunk's pairs [pair][columns 0-7, 8-15], and its input j widened.
using Q4Chunk = __m256i[4][2];
inline VF q4_input(const __m256i (*pv)[2], int j) {
    const __m256i* v = pv[j / 2];
    const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
    if (j % 2)
        return {_mm256_castsi256_ps(_mm256_and_si256(v[0], high)), _mm256_castsi256_ps(_mm256_and_si256(v[1], high))};
    return {_mm256_castsi256_ps(_mm256_slli_epi32(v[0], 16)), _mm256_castsi256_ps(_mm256_slli_epi32(v[1], 16))};
}
#endif
#if defined(BRINE_SIMD_AVX512) || defined(BRINE_SIMD_AVX2)
// A whole record's 32 inputs as float32 vectors (exact), w[i] for input i: chunk by chunk (4-bit q), or pair by
// pair (int8 q; both inputs before the stores, which may alias qs, so that the pair is loaded once).
template <int WT>
inline void unpack_f32(const uint8_t* qs, VF* w) {
    if constexpr (WT == kQ4) {
        for (int c = 0; c < 4; ++c) {
            Q4Chunk pv;
            q4_chunk(qs, c, pv);
            for (int j = 0; j < 8; ++j) w[8 * c + j] = q4_input(pv, j);
        }
    } else {
        for (int p = 0; p < kPairs; ++p) {
            const VF even = int8_input(qs, 2 * p), odd = int8_input(qs, 2 * p + 1);
            w[2 * p] = even, w[2 * p + 1] = odd;
        }
    }
}
#else
// The layout read with GNU vectors of 16 bytes (simd.h's portable VF: NEON's or SSE's registers, whatever the
// target). 4-bit: input 2p + e of column 4 L + c is nibble (p % 4) / 2 of byte 64 (p / 4) + 8 (p % 2) + 16 L +
// 2 c + e (the AVX512 unpacking's order, written out); int8: byte 32 p + 2 c + e. Each 16 bytes are shuffled
// so that every 4 bytes are one F4's inputs (__builtin_shuffle: tbl on ARM64, pshufb with SSSE3), then widened
// to float 4 at a time (exact: |q| <= 128).
typedef uint8_t U8 __attribute__((vector_size(16)));
// Bytes i0 .. i3 of v as 4 floats (exact). Each byte goes to the low byte of its own 32-bit lane, the others
// from a zero vector (one shuffle), or to the high byte, shifted back with the sign (int8).
template <bool kSigned>
inline F4 widen4(U8 v, int i0, int i1, int i2, int i3) {
    constexpr uint8_t z = 16;  // any byte of the second operand: zero
    const U8 at = kSigned ? U8{z, z, z, uint8_t(i0), z, z, z, uint8_t(i1), z, z, z, uint8_t(i2), z, z, z, uint8_t(i3)}
                          : U8{uint8_t(i0), z, z, z, uint8_t(i1), z, z, z, uint8_t(i2), z, z, z, uint8_t(i3), z, z, z};
    I4 d;
    const U8 b = __builtin_shuffle(v, U8{}, at);
    std::memcpy(&d, &b, 16);
    return __builtin_convertvector(kSigned ? d >> 24 : d, F4);
}
template <int WT>
inline void unpack_f32(const uint8_t* qs, VF* w) {
    if constexpr (WT == kQ4) {
        for (int j = 0; j < 4; ++j)
            for (int L = 0; L < 4; ++L) {
                U8 v;
                std::memcpy(&v, qs + 64 * j + 16 * L, 16);
                for (int h = 0; h < 2; ++h) {
                    const U8 nib = h ? U8(v >> 4) : U8(v & 15);
                    for (int t = 0; t < 2; ++t)
                        for (int e = 0; e < 2; ++e) {  // input 2 p + e, p = 4 j + 2 h + t: bytes 8 t + e + 2 c
                            const int b = 8 * t + e;
                            w[2 * (4 * j + 2 * h + t) + e].q[L] = widen4<false>(nib, b, b + 2, b + 4, b + 6);
                        }
                }
            }
    } else {
        for (int p = 0; p < kPairs; ++p)
            for (int h = 0; h < 2; ++h) {  // columns 8 h .. 8 h + 7: 16 bytes, column c's pair at 2 (c - 8 h)
                U8 v;
                std::memcpy(&v, qs + p * 2 * kTile + 16 * h, 16);
                for (int g = 0; g < 2; ++g)
                    for (int e = 0; e < 2; ++e)
                        w[2 * p + e].q[2 * h + g] = widen4<true>(v, 8 * g + e, 8 * g + e + 2, 8 * g + e + 4, 8 * g + e + 6);
            }
    }
}
#endif

#if defined(BRINE_SIMD_DPBF16)
// The record's q as bfloat16 pairs for vdpbf16ps: pv[p] dword c = (q[c][2p], q[c][2p+1]). int8_pair: pair p of int8 q.
inline __m512i int8_pair(const uint8_t* qs, int p) {
    const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + p * 2 * kTile)));
    // int16 -> float32 -> bfloat16, exact for |q| <= 128: each word goes to its own lane pair
    // (vcvtne2ps2bf16 on the two halves measured 10% slower for the one-row head, two threads)
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w, 16), 16));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_srai_epi32(w, 16));
    const __m512i lo_b = _mm512_srli_epi32(_mm512_castps_si512(lo), 16);
    const __m512i hi_b = _mm512_andnot_si512(_mm512_set1_epi32(0xffff), _mm512_castps_si512(hi));
    return _mm512_or_si512(lo_b, hi_b);
}
template <int WT>
inline void unpack_bf16(const uint8_t* qs, __m512i* pv) {
    if constexpr (WT == kQ4) {
        q4_pairs(qs, pv);
    } else {
        for (int p = 0; p < kPairs; ++p) pv[p] = int8_pair(qs, p);
    }
}
#endif

#if defined(BRINE_SIMD_AMX)
// AMX (Sapphire Rapids and later Xeons): one tdpbf16ps takes a block's P for 16 rows and the 16 columns of a
// tile at once, A = the rows' 32 inputs of the block (16 rows of 64 bytes, as pack_rows lays them out), B = the
// record's 16 pair vectors (unpack_bf16's, which are a B tile's rows as they stand), C[r][c] = P. Every C element
// is its own chain over the 16 pairs of its row and column, in order, whatever else the tile holds, so a row's
// bits depend on nothing but itself: the same for one row (a decode) as among 2,000. Rows past a group's end
// are read (whatever follows them: packed() leaves room) and their C rows ignored. Where AMX is compiled in
// and the kernel grants it, every bfloat16 call takes this path, or none does (kAmx; amx.h).
//
// The tiles, by number (GCC's tile intrinsics paste their argument into the instruction: a literal only):
// 0, 1, 2 and 3, 4, 5: two sets of a whole block's C (rows x 16), A (rows x 32 inputs), B (16 pairs x 16
// columns); 6, 7: half a block's A (rows x 16 inputs) and B (8 pairs x 16 columns), for two-scale records.
// A and C get `rows` rows, the call's largest group: a tile instruction takes about a cycle per row, and a
// decode's one row in 16-row tiles made the one-row linears 1.2x slower than vdpbf16ps (rows past a group's
// own are computed and ignored, as ever).
inline brine::amx::Config tile_shapes(int rows) {
    brine::amx::Config c;
    c.shape(0, rows, 64), c.shape(1, rows, 64), c.shape(2, 16, 64);  // one whole block: C, A, B
    c.shape(3, rows, 64), c.shape(4, rows, 64), c.shape(5, 16, 64);  // another
    c.shape(6, rows, 32), c.shape(7, 8, 64);                         // half a block's A and B (C: 0 or 3)
    return c;
}
#endif
const bool kAmx = brine::amx::on();
// The rows past a group's last that a tile load reads (see above): room left after the packed rows.
constexpr size_t kTileSlack = 16 * kBlock * 2;

// The vectors one block of one tile takes: 32 float32 q vectors (or, XT bfloat16, 16 bfloat16 pair vectors
// in the same 64-byte slots), then its two scale vectors.
constexpr int q_vectors(int xt) { return xt == kDtypeBF16 ? kPairs : kBlock; }
constexpr int block_vectors(int xt) { return q_vectors(xt) + 2; }

// One record (one tile, one block of 32 inputs) unpacked into out[block_vectors(XT)].
template <int WT, int XT>
inline void unpack_block(const uint8_t* rec, Kind kind, VF* out) {
    prefetch_record(rec, kind);
    load_scales(rec, kind, out + q_vectors(XT));
    const uint8_t* qs = rec + kind.scales_bytes();
#if defined(BRINE_SIMD_DPBF16)
    if constexpr (XT == kDtypeBF16) return unpack_bf16<WT>(qs, reinterpret_cast<__m512i*>(out));
#endif
    if constexpr (XT != kDtypeBF16) unpack_f32<WT>(qs, out);
}

// One tile's records unpacked for the whole K, for many rows to reuse. (std::vector would not keep VF's
// 64-byte alignment: the storage is aligned by hand.)
class Panel {
   public:
    VF* resize(int64_t vectors) {
        const size_t need = static_cast<size_t>(vectors) * sizeof(VF) + 64;
        if (raw_.size() < need) raw_.resize(need);
        return reinterpret_cast<VF*>((reinterpret_cast<uintptr_t>(raw_.data()) + 63) & ~uintptr_t{63});
    }

   private:
    std::vector<uint8_t> raw_;
};

// The row groups: as few of at most `most` rows as cover all m rows, of near-equal sizes (the first m % count
// one row larger): 13 rows are 7 + 6, not 12 + 1, since a small group is a short chain per lane that waits
// on each dot product's latency. Past `most` rows no group has fewer than most / 2.
struct RowGroups {
    int64_t count, size, larger;
    RowGroups(int64_t m, int most) : count((m + most - 1) / most), size(m / count), larger(m % count) {}
    int64_t first(int64_t g) const { return g * size + (g < larger ? g : larger); }
    int rows(int64_t g) const { return static_cast<int>(size + (g < larger ? 1 : 0)); }
};

struct Args {
    int64_t n, k, m;
    Kind kind;
    // x as pack_rows writes it (float32, or bfloat16 for the vdpbf16ps path): each row group's rows side by
    // side per block, [group][block][row][32], so that a group's R rows of a block are one pointer and constant
    // offsets. Group g starts at row first(g) x k.
    void* x;
    float* sums;  // [group][block][row], likewise: each block's sum of x (kinds with a min only)
    const float* bias;
    void* out;
    int64_t out_stride;
    int out_dtype;
};

#if defined(BRINE_SIMD_AMX)
// blocks_dot's arithmetic with each block's P from tdpbf16ps (see the AMX note above): two whole blocks at a time on the
// two tile sets, so that one's product runs while the other's loads wait; a two-scale block's halves on tiles
// 6 and 7 into C tiles 0 and 3. Then, block by block in order, total += d P (+ m S) as everywhere.
template <int R, int NB>
inline void amx_blocks(const Args& a, const VF* w, const uint16_t* xb, int64_t at, VF* total) {
    constexpr int BV = block_vectors(kDtypeBF16), kRow = kBlock * 2;  // bytes from one row's block to the next
    alignas(64) float c[NB][2][kTile][kTile];                        // [block][half][row][column]
    const auto xa = [&](int i) { return xb + i * R * kBlock; };
    const auto wq = [&](int i) { return reinterpret_cast<const uint8_t*>(w + i * BV); };
    if (a.kind.halves()) {
        for (int i = 0; i < NB; ++i) {
            _tile_zero(0);
            _tile_loadd(6, xa(i), kRow);
            _tile_loadd(7, wq(i), 64);
            _tile_dpbf16ps(0, 6, 7);
            _tile_zero(3);
            _tile_loadd(6, xa(i) + kBlock / 2, kRow);
            _tile_loadd(7, wq(i) + kPairs / 2 * 64, 64);
            _tile_dpbf16ps(3, 6, 7);
            _tile_stored(0, c[i][0], 64);
            _tile_stored(3, c[i][1], 64);
        }
        for (int i = 0; i < NB; ++i) {
            const VF* dm = w + i * BV + q_vectors(kDtypeBF16);
            for (int r = 0; r < R; ++r) {
                total[r].v = _mm512_fmadd_ps(dm[0].v, _mm512_load_ps(c[i][0][r]), total[r].v);
                total[r].v = _mm512_fmadd_ps(dm[1].v, _mm512_load_ps(c[i][1][r]), total[r].v);
            }
        }
        return;
    }
    int i = 0;
    for (; i + 2 <= NB; i += 2) {
        _tile_zero(0);
        _tile_loadd(1, xa(i), kRow);
        _tile_loadd(2, wq(i), 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_zero(3);
        _tile_loadd(4, xa(i + 1), kRow);
        _tile_loadd(5, wq(i + 1), 64);
        _tile_dpbf16ps(3, 4, 5);
        _tile_stored(0, c[i][0], 64);
        _tile_stored(3, c[i + 1][0], 64);
    }
    if (i < NB) {
        _tile_zero(0);
        _tile_loadd(1, xa(i), kRow);
        _tile_loadd(2, wq(i), 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_stored(0, c[i][0], 64);
    }
    const bool min = a.kind.min();
    for (i = 0; i < NB; ++i) {
        const VF* dm = w + i * BV + q_vectors(kDtypeBF16);
        for (int r = 0; r < R; ++r) {
            total[r].v = _mm512_fmadd_ps(dm[0].v, _mm512_load_ps(c[i][0][r]), total[r].v);
            if (min) total[r].v = _mm512_fmadd_ps(dm[1].v, _mm512_set1_ps(a.sums[at + i * R + r]), total[r].v);
        }
    }
}
#endif

// Rows r0 .. r0 + R - 1 (one row group) of NB consecutive blocks b0 .. b0 + NB - 1 against one tile's unpacked
#if defined(BRINE_SIMD_DPBF16)
// The vdpbf16ps path of blocks_dot for NB blocks and R rows from x's packed rows at `at` (blocks_dot's). The pairs
// come 4 at a time (one 64-byte chunk of 4-bit q): chunk(c) readies the NB blocks' pairs 4c .. 4c + 3, pair(i, c, j)
// gives block i's pair 4c + j, and scales(i) block i's two scale vectors. Each (block, row) is one chain over its 16
// pairs in order, as in the header.
template <int R, int NB, typename Chunk, typename Pair, typename Scales>
__attribute__((always_inline)) inline void dot_bf16(const Args& a, int64_t at, Chunk&& chunk, Pair&& pair_of, Scales&& scales,
                                                    VF* total) {
    const uint16_t* xb = static_cast<const uint16_t*>(a.x) + at * kBlock;  // block i, row r: (i R + r) kBlock
    const bool halves = a.kind.halves(), min = a.kind.min();
    __m512 part[2][NB][R];  // [half][block][row]: the second half only for two scales
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < NB; ++i)
            for (int r = 0; r < R; ++r) part[h][i][r] = _mm512_setzero_ps();
    const auto pairs = [&](int h, int c0, int c1) __attribute__((always_inline)) {
        for (int c = c0; c < c1; ++c) {
            chunk(c);
            for (int j = 0; j < 4; ++j)
                for (int i = 0; i < NB; ++i) {
                    const int p = 4 * c + j;
                    const __m512bh wp = (__m512bh)pair_of(i, c, j);
                    for (int r = 0; r < R; ++r) {
                        int32_t pair;
                        std::memcpy(&pair, xb + (i * R + r) * kBlock + 2 * p, 4);
                        part[h][i][r] = _mm512_dpbf16_ps(part[h][i][r], wp, (__m512bh)_mm512_set1_epi32(pair));
                    }
                }
        }
    };
    if (halves) {
        pairs(0, 0, kPairs / 8);
        pairs(1, kPairs / 8, kPairs / 4);
        for (int i = 0; i < NB; ++i) {
            const VF* dm = scales(i);
            for (int r = 0; r < R; ++r) {
                total[r].v = _mm512_fmadd_ps(dm[0].v, part[0][i][r], total[r].v);
                total[r].v = _mm512_fmadd_ps(dm[1].v, part[1][i][r], total[r].v);
            }
        }
        return;
    }
    pairs(0, 0, kPairs / 4);
    for (int i = 0; i < NB; ++i) {
        const VF* dm = scales(i);
        for (int r = 0; r < R; ++r) {
            total[r].v = _mm512_fmadd_ps(dm[0].v, part[0][i][r], total[r].v);
            if (min) total[r].v = _mm512_fmadd_ps(dm[1].v, _mm512_set1_ps(a.sums[at + i * R + r]), total[r].v);
        }
    }
}
#endif

// The float32 path of blocks_dot, as dot_bf16 is the vdpbf16ps one: the inputs come 8 at a time (one 64-byte
// chunk of 4-bit q: pairs 4c .. 4c + 3), chunk(c) readying the NB blocks' inputs 8c .. 8c + 7 and weight(i, c, j)
// giving block i's input 8c + j. Each (block, row) is one chain over its 32 inputs in order, as in the header.
template <int R, int NB, bool kChunks, typename Chunk, typename Weight, typename Scales>
__attribute__((always_inline)) inline void dot_f32(const Args& a, int64_t at, Chunk&& chunk, Weight&& weight, Scales&& scales,
                                                   VF* total) {
    const bool halves = a.kind.halves(), min = a.kind.min();
    const float* xb = static_cast<const float*>(a.x) + at * kBlock;
    VF part[2][NB][R];
    for (int h = 0; h < 2; ++h)
        for (int i = 0; i < NB; ++i)
            for (int r = 0; r < R; ++r) part[h][i][r] = vzero();
    // Inlined, with its row and block loops unrolled, for the portable build: its GCC kept the lambda a call
    // of its own (x86-64-v2: quant_linear_bench --dtype float32, 16 and 512 rows 1.4x faster inlined), and,
    // inlined, walked the rows in a loop with their partial sums in memory (ARM64's -O3 assembly; unrolled, a
    // group's 4 rows x 4 vectors of partial sums stay in registers, fmla by element). The AVX2 and AVX512
    // builds' code was already that, and measures the same.
    constexpr int kStep = input_step(R);
    const auto step = [&](int h, int c, int j) __attribute__((always_inline)) {  // inputs 8c + j .. 8c + j + kStep - 1
#pragma GCC unroll 8
        for (int i = 0; i < NB; ++i) {
            VF wj[kStep];
            for (int s = 0; s < kStep; ++s) wj[s] = weight(i, c, j + s);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
                for (int s = 0; s < kStep; ++s)
                    part[h][i][r] = vfmadd(wj[s], vset1(xb[(i * R + r) * kBlock + 8 * c + j + s]), part[h][i][r]);
        }
    };
    // (Without chunks, one loop over the inputs, weight(i, 0, j) for input j: the panels' code as it was, which
    // measured 2-4% faster at 2,048 rows on the portable and AVX2 builds than walking them chunk by chunk.)
    const auto inputs = [&](int h, int c0, int c1) __attribute__((always_inline)) {
        if constexpr (kChunks) {
            for (int c = c0; c < c1; ++c) {
                chunk(c);
#pragma GCC unroll 8
                for (int j = 0; j < 8; j += kStep) step(h, c, j);
            }
        } else {
            for (int j = 8 * c0; j < 8 * c1; j += kStep) step(h, 0, j);
        }
    };
    if (halves) {
        inputs(0, 0, 2);
        inputs(1, 2, 4);
        for (int i = 0; i < NB; ++i) {
            const VF* dm = scales(i);
            for (int r = 0; r < R; ++r) {
                total[r] = vfmadd(dm[0], part[0][i][r], total[r]);
                total[r] = vfmadd(dm[1], part[1][i][r], total[r]);
            }
        }
        return;
    }
    inputs(0, 0, 4);
    for (int i = 0; i < NB; ++i) {
        const VF* dm = scales(i);
        for (int r = 0; r < R; ++r) {
            total[r] = vfmadd(dm[0], part[0][i][r], total[r]);
            if (min) total[r] = vfmadd(dm[1], vset1(a.sums[at + i * R + r]), total[r]);
        }
    }
}

// blocks (w: NB x block_vectors(XT) vectors, block after block): total += d P (+ m S) block by block in order,
// exactly as NB calls for one block each would add them. Each block's P (each half's, for two scales) is its own
// chain from 0, so the NB blocks' chains run side by side: one block's P is a chain of 16 vdpbf16ps (32 fmas in
// float32) whose latency, not the CPU's throughput, bounded a decode's rows (a few chains per block), and NB
// blocks at a time give the CPU NB times the independent work. The per-lane arithmetic is unchanged.
// Always inlined: GCC kept the bfloat16 instances a call of their own per block, so group_panel's row totals went
// to memory and back around every 192 vdpbf16ps. Inlined, they stay in registers: on a Zen 4 EPYC (AVX512-BF16,
// two threads) the bfloat16 linears at 2,048 rows 34.4 -> 27.5 ms, 128 rows 1.15x, 16 rows 1.11x, 7 rows 1.16x
// (quant_linear_bench.py); a verify chunk's 30 layers of linears at 9 and 16 rows 1.08x and 1.14x
// (spec_step_cost.py --kernels); float32 and the AVX2 build unchanged.
template <int XT, int R, int NB>
__attribute__((always_inline)) inline void blocks_dot(const Args& a, const VF* w, int64_t b0, int64_t r0, VF* total) {
    constexpr int BV = block_vectors(XT);
    const int64_t at = r0 * (a.k / kBlock) + b0 * R;  // the group's first row of block b0, in rows of one block
    if constexpr (XT == kDtypeBF16) {
#if defined(BRINE_SIMD_DPBF16)
#if defined(BRINE_SIMD_AMX)
        if (kAmx) {
            amx_blocks<R, NB>(a, w, static_cast<const uint16_t*>(a.x) + at * kBlock, at, total);
            return;
        }
#endif
        dot_bf16<R, NB>(
            a, at, [](int) {}, [&](int i, int c, int j) { return reinterpret_cast<const __m512i*>(w + i * BV)[4 * c + j]; },
            [&](int i) { return w + i * BV + q_vectors(XT); }, total);
#endif
    } else {
        dot_f32<R, NB, false>(
            a, at, [](int) {}, [&](int i, int c, int j) { return w[i * BV + 8 * c + j]; },
            [&](int i) { return w + i * BV + q_vectors(XT); }, total);
    }
}

// y rounded to bfloat16 into o[0 .. count): round to nearest even, a NaN kept quiet (brine::f32_to_bf16).
inline void store_bf16(uint16_t* o, VF y, int count) {
#if defined(BRINE_SIMD_AVX512)
    const __m512i u = _mm512_castps_si512(y.v);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                 _mm512_set1_epi32(0x7f800000));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
    // the high halves, as one 256-bit vector (vpermw: a down-converting store, vpmovdw, is slow on Zen 4)
    const __m512i high = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 31, 29, 27, 25, 23, 21, 19,
                                          17, 15, 13, 11, 9, 7, 5, 3, 1);
    const __m256i h = _mm512_castsi512_si256(_mm512_permutexvar_epi16(high, _mm512_mask_blend_epi32(nan, rounded, quiet)));
    if (count >= kTile) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), h);
    else _mm256_mask_storeu_epi16(o, static_cast<__mmask16>((1u << count) - 1), h);
#else
    alignas(64) float t[kTile];
    vstore(t, y);
    for (int i = 0; i < count && i < kTile; ++i) o[i] = brine::f32_to_bf16(t[i]);
#endif
}

// y = total + bias for rows r0 .. r0 + R - 1 of one tile; the last tile's missing columns are not written.
template <int R>
void store_rows(const Args& a, const VF* total, int64_t tile, int64_t r0) {
    const int64_t c0 = tile * kTile;
    const int cols = a.n - c0 < kTile ? static_cast<int>(a.n - c0) : kTile;
    const VF bias = a.bias ? vload_part(a.bias + c0, cols) : vzero();
    for (int r = 0; r < R; ++r) {
        const VF y = a.bias ? vadd(total[r], bias) : total[r];
        if (a.out_dtype == kDtypeBF16) store_bf16(static_cast<uint16_t*>(a.out) + (r0 + r) * a.out_stride + c0, y, cols);
        else vstore_part(static_cast<float*>(a.out) + (r0 + r) * a.out_stride + c0, y, cols);
    }
}

// Calls f(Rows<R>{}) for R = rows, kLow <= rows <= kHigh: the kernels are instantiated per row count, so
// that a group's partial sums are registers.
template <int R>
using Rows = std::integral_constant<int, R>;
template <int kLow, int kHigh, typename F>
inline void with_rows(int rows, F&& f) {
    if constexpr (kHigh >= kLow) {
        if (rows == kHigh) return f(Rows<kHigh>{});
        with_rows<kLow, kHigh - 1>(rows, f);
    }
}

// Blocks of one tile taken together by group_direct for R rows: enough independent chains to cover the dot
// products' latency (blocks_dot), while the NB x R partial sums and R totals stay in registers (AVX512: 32
// vectors; AVX2: 16, two per VF). More spilled them: on AVX2, 2 blocks beside 5 rows made the float32 linears
// 1.4x slower, and beside 4 rows 1.1x. AVX2's 3 rows take 2 blocks, one input at a time (input_step): one block
// was 6 fma chains, fewer than the 8 that two ports of 4-cycle fmas need, and 3 rows cost more than 4.
// spec_step_cost.py --kernels 1,2,3,4,5 --clock wall --dtype float32 --baseline (emulated AVX2, two threads,
// the 30 layers' linears and head of a verify chunk; same bits): 2 rows 7.38 -> 6.46 ms, 3 rows 9.60 -> 7.41,
// 1, 4 and 5 rows unchanged. The portable build keeps one block at a time (unmeasured there).
constexpr int blocks_at_once(int rows) {
#if defined(BRINE_SIMD_AVX512)
    return rows <= 1 ? 4 : rows <= 6 ? 2 : 1;  // (4 beside 2 rows: the int8 head 1.5x slower, its 4 blocks spilled)
#elif defined(BRINE_SIMD_AVX2)
    return rows <= 1 ? 4 : rows <= 3 ? 2 : 1;
#else
    return static_cast<void>(rows), 1;
#endif
}

// NB records' blocks (rec: the first's; b: its block) of one row group against one tile, unpacked as their dot
// products take them: a 64-byte chunk of 4-bit q (4 pairs) at a time; float32's int8 records input by input (from
// kInt8ChunkedRows rows). Unpacking whole records first (direct_blocks' other path) stored NB x 16 bfloat16 pair
// vectors, or NB x 32 float32 ones, to the stack and loaded them back; on a Zen 4 EPYC that traffic, not the
// arithmetic, bounded the calls of a few rows (a decode, a few streams, a verify chunk): a 1-row bfloat16 block
// took ~61 cycles for its 16 vdpbf16ps, in cache. Here the pairs stay in registers (AVX2: some spill, 8 per chunk rather than 16 float32 vectors) and
// float32 weights are widened from them input by input. The same dot products in the same order: the same bits.
// quant_linear_bench.py (two threads, same bits at every row count), before -> after:
//   bfloat16: 1 row 1.32x, 3 rows 1.36x, 4 rows 1.24x, 6 rows 1.08x, 8 rows and more unchanged;
//   float32, AVX512 (the native build and the Ice Lake build alike): 1 row 1.55-1.60x, 2-3 rows 1.8-1.9x, 4 rows
//   1.35-1.45x, 6 rows 1.25x, 8 to 48 rows 1.1-1.2x;  AVX2: 1 row 1.30x, 2 rows 1.35x, 3 rows 1.19x, 4 rows
//   1.12x, 5 to 48 rows 1.04-1.12x.
// Past 48 rows this path measured no faster than the panels (float32) or slower (bfloat16: 0.83x), so
// kDirectRows stays. The portable build keeps whole records (its speed on ARM64 is unmeasured).
#if defined(BRINE_SIMD_AVX512) || defined(BRINE_SIMD_AVX2)
constexpr bool kChunked = true;
#else
constexpr bool kChunked = false;
#endif

// int8 records (Q8_0, the default model's head; Q5_0; Q6_K) one input (float32) or pair (bfloat16) at a time,
// from memory (the head's 32 MB, benchmarks/quant_linear_bench.py --type q8_0 --shape 49152x576): float32 from this
// many rows, where 4, 5, 8 and 16 rows measured 1.35x, 1.39x, 1.34x and 1.16x (AVX512), 1.15x, 1.21x, 1.30x and
// 1.15x (AVX2), and fewer rows the same. bfloat16 keeps whole records at every row count: one row measured 1.75x
// slower pair by pair (its stream from memory fell from ~33 to ~19 GB/s), 4 rows 0.77x, 5 rows 1.03x, 8 rows
// 1.27x, 16 rows 0.96x.
constexpr int kInt8ChunkedRows = 4;

template <int WT, int XT, int R, int NB>
__attribute__((always_inline)) inline void chunked_blocks(const Args& a, const uint8_t* rec, int64_t b, int64_t r0, VF* total) {
    const int64_t bytes = a.kind.bytes(), at = r0 * (a.k / kBlock) + b * R;
    VF dm[NB][2];
    for (int i = 0; i < NB; ++i) {
        prefetch_record(rec + i * bytes, a.kind);
        load_scales(rec + i * bytes, a.kind, dm[i]);
    }
    const uint8_t* qs = rec + a.kind.scales_bytes();
    const auto scales = [&](int i) { return dm[i]; };
    if constexpr (XT == kDtypeBF16) {
#if defined(BRINE_SIMD_DPBF16)
        static_assert(WT == kQ4, "bfloat16's int8 records are unpacked whole (kInt8ChunkedRows)");
        __m512i pv[NB][4];  // the NB blocks' pairs of one chunk
        dot_bf16<R, NB>(
            a, at,
            [&](int c) {
                for (int i = 0; i < NB; ++i) q4_chunk(qs + i * bytes, c, pv[i]);
            },
            [&](int i, int, int j) { return pv[i][j]; }, scales, total);
#endif
    } else if constexpr (WT == kQ4) {  // (int8: input by input, int8_input)
#if defined(BRINE_SIMD_AVX512) || defined(BRINE_SIMD_AVX2)
        Q4Chunk pv[NB];  // the NB blocks' pairs of one chunk
        dot_f32<R, NB, true>(
            a, at,
            [&](int c) {
                for (int i = 0; i < NB; ++i) q4_chunk(qs + i * bytes, c, pv[i]);
            },
            [&](int i, int, int j) { return q4_input(pv[i], j); }, scales, total);
#endif
    } else {
#if defined(BRINE_SIMD_AVX512) || defined(BRINE_SIMD_AVX2)
        dot_f32<R, NB, true>(
            a, at, [](int) {}, [&](int i, int c, int j) { return int8_input(qs + i * bytes, 8 * c + j); }, scales, total);
#endif
    }
}

// Blocks [b, end) of one row group against one tile, straight from their records (rec: block b's), NB at a time
// and then fewer for the rest.
template <int WT, int XT, int R, int NB>
inline void direct_blocks(const Args& a, const uint8_t* rec, int64_t b, int64_t end, int64_t r0, VF* total) {
    const int64_t bytes = a.kind.bytes();
    for (; b + NB <= end; b += NB, rec += NB * bytes) {
        if constexpr (kChunked && (WT == kQ4 || (XT == kDtypeF32 && R >= kInt8ChunkedRows)))
            if (XT != kDtypeBF16 || !kAmx) {  // (AMX's tile loads take whole unpacked records from memory)
                chunked_blocks<WT, XT, R, NB>(a, rec, b, r0, total);
                continue;
            }
        VF w[NB * block_vectors(XT)];
        for (int i = 0; i < NB; ++i) unpack_block<WT, XT>(rec + i * bytes, a.kind, w + i * block_vectors(XT));
        blocks_dot<XT, R, NB>(a, w, b, r0, total);
    }
    if constexpr (NB > 1) direct_blocks<WT, XT, R, NB / 2>(a, rec, b, end, r0, total);
}

// One row group against one tile, straight from its records: each block is unpacked into registers (or the
// stack, a few KB in L1) and used at once, with no panel written and read back (a second group unpacks again,
// from cache). Every lane's arithmetic is the sequence in the header.
template <int WT, int XT, int R>
void group_direct(const Args& a, const uint8_t* rec, int64_t tile, int64_t r0) {
    VF total[R];
    for (int r = 0; r < R; ++r) total[r] = vzero();
    const auto walk = [&](auto blocks_at_a_time) {
        direct_blocks<WT, XT, R, decltype(blocks_at_a_time)::value>(a, rec, 0, a.k / kBlock, r0, total);
        store_rows<R>(a, total, tile, r0);
    };
#if defined(BRINE_SIMD_AMX)
    // On tiles a block's partial products are a tile and a store, not registers beside the rows' totals, so
    // every row count takes 4 blocks at a time (two pairs for amx_blocks' two tile sets), as one row does: one
    // block at a time (blocks_at_once past 6 rows) left each tile product waiting on the one before.
    // benchmarks/spec_step_cost.py --kernels --clock wall (two threads, the default model's 30 layers): 7 rows,
    // a verify chunk of 6 drafts, gate/up 3.10 -> 1.99 ms, q/k/v 1.01 -> 0.79, down 1.60 -> 1.06; 16 rows, a
    // 16-sequence decode step, gate/up 3.81 -> 3.12; 5 rows (2 -> 4 blocks) 1.88 -> 1.83; 8 at a time measured
    // no better than 4. The same per-lane arithmetic, in the same block order.
    if constexpr (XT == kDtypeBF16)
        if (kAmx) return walk(std::integral_constant<int, 4>{});
#endif
    walk(std::integral_constant<int, blocks_at_once(R)>{});
}

// One row group against one tile's panel (its records unpacked for the whole K). Same arithmetic.
template <int XT, int R>
void group_panel(const Args& a, const VF* panel, int64_t tile, int64_t r0) {
    VF total[R];
    for (int r = 0; r < R; ++r) total[r] = vzero();
    int64_t b = 0;
    if (XT == kDtypeBF16 && kAmx)  // two blocks at a time, for amx_blocks' two tile sets
        for (; b + 2 <= a.k / kBlock; b += 2) blocks_dot<XT, R, 2>(a, panel + b * block_vectors(XT), b, r0, total);
    for (; b < a.k / kBlock; ++b) blocks_dot<XT, R, 1>(a, panel + b * block_vectors(XT), b, r0, total);
    store_rows<R>(a, total, tile, r0);
}

template <typename T>
inline float widen(T v) {
    if constexpr (std::is_same_v<T, float>) return v;
    else return brine::bf16_to_f32(v);
}

#if defined(BRINE_SIMD_AVX512)
// Each block's sum of x for 16 blocks of one row at once (lane j: block j, where `blocks` has bit j), each in
// order from 0 as the header's S is: the lanes gather their blocks' inputs one index at a time.
template <typename T>
inline __m512 block_sums16(const T* row, __mmask16 blocks) {
    const __m512i block = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 s = _mm512_setzero_ps();
    if constexpr (std::is_same_v<T, uint16_t>) {  // a 32-bit gather brings inputs 2i (its low half) and 2i + 1
        const __m512i at = _mm512_slli_epi32(block, 6), high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
        for (int i = 0; i < kBlock; i += 2) {
            const __m512i two = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), blocks, at, row + i, 1);
            s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(two, 16)));
            s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_and_si512(two, high)));
        }
    } else {
        const __m512i at = _mm512_slli_epi32(block, 7);
        for (int i = 0; i < kBlock; ++i)
            s = _mm512_add_ps(s, _mm512_mask_i32gather_ps(_mm512_setzero_ps(), blocks, at, row + i, 1));
    }
    return s;
}
#endif

// One row's block sums into sums[b * stride] for every block b.
template <typename T>
inline void row_sums(const T* row, int64_t blocks, float* sums, int64_t stride) {
#if defined(BRINE_SIMD_AVX512)
    for (int64_t b0 = 0; b0 < blocks; b0 += kTile) {
        const int64_t count = blocks - b0 < kTile ? blocks - b0 : kTile;
        alignas(64) float s[kTile];
        _mm512_store_ps(s, block_sums16(row + b0 * kBlock, static_cast<__mmask16>((1u << count) - 1)));
        for (int64_t j = 0; j < count; ++j) sums[(b0 + j) * stride] = s[j];
    }
#else
    for (int64_t b = 0; b < blocks; ++b) {
        float s = 0.0f;
        for (int i = 0; i < kBlock; ++i) s += widen(row[b * kBlock + i]);
        sums[b * stride] = s;
    }
#endif
}

// Row groups g0 .. g1 - 1 of x (of T) copied into the packed layout of a.x (of PT: T, or float32 widened from
// bfloat16), with each block's sum of x where the kind has a min.
template <typename PT, typename T>
void pack_rows(const T* x, int64_t x_stride, const RowGroups& groups, int64_t g0, int64_t g1, const Args& a) {
    const int64_t blocks = a.k / kBlock;
    PT* packed = static_cast<PT*>(a.x);
    for (int64_t g = g0; g < g1; ++g) {
        const int64_t r0 = groups.first(g), rows = groups.rows(g);
        for (int64_t r = 0; r < rows; ++r) {
            const T* row = x + (r0 + r) * x_stride;
            for (int64_t b = 0; b < blocks; ++b) {
                PT* dst = packed + (r0 * blocks + b * rows + r) * kBlock;
                if constexpr (std::is_same_v<PT, T>) std::memcpy(dst, row + b * kBlock, sizeof(T) * kBlock);
                else
                    for (int i = 0; i < kBlock; ++i) dst[i] = widen(row[b * kBlock + i]);
            }
            if (a.kind.min()) row_sums(row, blocks, a.sums + r0 * blocks + r, rows);
        }
    }
}

// Memory kept per thread across calls, for the packed rows (as the panels are, for the same reason); it holds
// the largest call's rows: 6 MB for a 2,048-token prefill's 1,536-wide bfloat16 rows.
inline uint8_t* scratch(size_t bytes) {
    static thread_local std::vector<uint8_t> buffer;
    if (buffer.size() < bytes) buffer.resize(bytes);
    return buffer.data();
}

// a, with its packed rows (of PT) and sums in this thread's scratch memory.
template <typename PT>
Args packed(Args a) {
    const auto x_bytes = static_cast<size_t>(a.m * a.k) * sizeof(PT);
    uint8_t* at = scratch(x_bytes + static_cast<size_t>(a.kind.min() ? a.m * (a.k / kBlock) * 4 : 0) + kTileSlack);
    a.x = at;
    a.sums = reinterpret_cast<float*>(at + x_bytes);
    return a;
}

// Row groups per chunk: where the packed rows exceed kChunkFrom, the panel path runs every round of a thread's tiles
// (panel_tiles) over one chunk of rows (kChunkBytes of them) before the next, so that the chunk stays in L2 across
// its tiles, where streaming all the rows per round of tiles read them from memory each time. Each chunk unpacks
// the thread's panels again. A 2,048-row, 1,536-input float32 x (12.6 MB, the down projection): 1.16x on AVX512, 1.2-1.3x on
// AVX2 (one thread); the smaller ones (4.7 MB at 576 inputs, bfloat16's 6.3 MB) measured within -5..+5% either
// way, so they stream as before.
constexpr int64_t kChunkBytes = 512 * 1024, kChunkFrom = 8 * 1024 * 1024;

// Tiles whose panels a thread unpacks at once and runs each row group over, one after the other: at least 2, and
// on AVX512's float32 path as many as kPanelBytes of panels hold (16 at 576 inputs, 6 at 1,536), at most 16.
// Why: a row group's packed x (12 rows: 27 KB at 576 inputs) is read once per tile; two tiles at a time read
// every group's x from L3 or memory again for each pair (2,048 rows of 576 floats are 4.7 MB), and the dot
// products waited on it: the float32 linears ran at ~half of the fma peak, and a throwaway switch that had every
// group read group 0's x (in L1) made them ~1.2x faster on two threads. With more tiles a group's x is read
// again from L1 or L2 for the rest, and the panels (39 KB each at 576 inputs) stay in L2. The emulated Ice Lake
// build, two threads, the default model's four linears of a layer (q/k/v, o, gate/up, down; Q4_1), 2,048 rows:
// 60-64 -> 47-54 ms; 512 rows 1.1x; 128 rows and fewer no change. Each (group, tile) is the same call on the same
// operands, so the same bits. bfloat16 (its panels are half the size, and AMX's tiles run them) and AVX2 (whose
// CPUs have 256-512 KB of L2; unmeasured there) keep two.
#if defined(BRINE_SIMD_AVX512)
constexpr int64_t kPanelBytes = 640 * 1024;
#else
constexpr int64_t kPanelBytes = 0;
#endif
constexpr int kMostPanelTiles = 16;
template <int XT>
inline int panel_tiles(int64_t blocks) {
    const int64_t bytes = blocks * block_vectors(XT) * static_cast<int64_t>(sizeof(VF));
    if (XT != kDtypeF32 || bytes <= 0) return 2;
    return static_cast<int>(std::max<int64_t>(2, std::min<int64_t>(kMostPanelTiles, kPanelBytes / bytes)));
}
// from: the rows' bytes past which they are chunked (the Q8 path's, int8 rows, chunks from kChunkBytes).
inline int64_t chunk_groups(int64_t rows, int64_t row_bytes, int most, int64_t count, int64_t from = kChunkFrom) {
    if (rows * row_bytes <= from) return count;
    const int64_t chunk = kChunkBytes / row_bytes;
    return chunk / most > 1 ? chunk / most : 1;
}

// The tile shapes a call's groups take (on the AMX path; unused elsewhere).
template <int XT>
brine::amx::Config tile_config(const RowGroups& groups) {
#if defined(BRINE_SIMD_AMX)
    if (XT == kDtypeBF16 && kAmx) return tile_shapes(static_cast<int>(groups.size + (groups.larger ? 1 : 0)));
#endif
    static_cast<void>(groups);
    return {};
}

// The threads share out the tiles, each a run of neighbouring tiles (they follow each other in memory, for
// the prefetch), and run each tile's row groups.
//  - Up to kDirectRows rows, each thread packs all the rows itself (a few KB: no thread waits for another's,
//    nor reads them from the other core's cache), and every group reads the tile's records straight into
//    registers (group_direct). (Several tiles at once for few rows, to overlap their chains, measured slower:
//    4-tile groups split the tiles unevenly between the threads.)
//  - More rows, the threads pack them together; then, chunk of rows by chunk (chunk_groups), each unpacks
//    panel_tiles() tiles at a time into its panels and runs each of the chunk's groups over all of them, so that
//    the chunk's packed rows stay in L2 across the thread's tiles, and a group's rows in L1 or L2 across the
//    tiles it runs over.
// T: the caller's activations; XT: what the dot products take (bfloat16 only on the vdpbf16ps path).
template <int WT, int XT, typename T>
void run(const Args& in, const T* x, int64_t x_stride, const uint8_t* w, int threads) {
    using PT = std::conditional_t<XT == kDtypeBF16, uint16_t, float>;
    const int64_t blocks = in.k / kBlock, tiles = (in.n + kTile - 1) / kTile, bytes = in.kind.bytes();
    constexpr int kMost = max_rows(WT);
    const RowGroups groups(in.m, kMost);
    const auto records = [&](int64_t tile) { return w + tile * blocks * bytes; };
    if (in.m <= kDirectRows) {
#pragma omp parallel num_threads(threads)
        {
            const auto shapes = tile_config<XT>(groups);
            const brine::amx::Scope tiles_on(XT == kDtypeBF16 && kAmx ? &shapes : nullptr);
            const Args a = packed<PT>(in);
            pack_rows<PT>(x, x_stride, groups, 0, groups.count, a);
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < tiles; ++t)
                for (int64_t g = 0; g < groups.count; ++g) {
                    const int64_t r0 = groups.first(g);
                    with_rows<1, kMost>(groups.rows(g),
                                        [&](auto R) { group_direct<WT, XT, R.value>(a, records(t), t, r0); });
                }
        }
        return;
    }
    const Args a = packed<PT>(in);
#pragma omp parallel num_threads(threads)
    {
        const auto shapes = tile_config<XT>(groups);
        const brine::amx::Scope tiles_on(XT == kDtypeBF16 && kAmx ? &shapes : nullptr);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups.count; ++g) pack_rows<PT>(x, x_stride, groups, g, g + 1, a);
        // (past the omp for's barrier: every row is packed)
        // Kept per thread across calls: a fresh one per call cost a zeroed allocation (mmap'd, page-faulted
        // anew, for the larger layers) in every layer of every step.
        static thread_local Panel panels[kMostPanelTiles];
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t end = tiles * (me + 1) / team;
        const int64_t chunk = chunk_groups(in.m, in.k * static_cast<int64_t>(sizeof(PT)), kMost, groups.count);
        const int at_once = panel_tiles<XT>(blocks);
        for (int64_t g0 = 0; g0 < groups.count; g0 += chunk) {
            const int64_t g1 = g0 + chunk < groups.count ? g0 + chunk : groups.count;
            for (int64_t t = tiles * me / team; t < end; t += at_once) {
                const int n = static_cast<int>(std::min<int64_t>(at_once, end - t));  // tiles t .. t + n - 1
                VF* panel[kMostPanelTiles] = {};
                for (int i = 0; i < n; ++i) {
                    panel[i] = panels[i].resize(blocks * block_vectors(XT));
                    for (int64_t b = 0; b < blocks; ++b)
                        unpack_block<WT, XT>(records(t + i) + b * bytes, a.kind, panel[i] + b * block_vectors(XT));
                }
                for (int64_t g = g0; g < g1; ++g) {
                    const int64_t r0 = groups.first(g);
                    with_rows<(kMost + 1) / 2, kMost>(groups.rows(g), [&](auto R) {
                        for (int i = 0; i < n; ++i) group_panel<XT, R.value>(a, panel[i], t + i, r0);
                    });
                }
            }
        }
    }
}

template <int WT>
void dispatch(const Args& a, int x_dtype, const void* x, int64_t x_stride, const uint8_t* w, int threads) {
    if (x_dtype == kDtypeF32) return run<WT, kDtypeF32>(a, static_cast<const float*>(x), x_stride, w, threads);
    const auto* xb = static_cast<const uint16_t*>(x);
    if constexpr (kBf16Dot) run<WT, kDtypeBF16>(a, xb, x_stride, w, threads);
    else run<WT, kDtypeF32>(a, xb, x_stride, w, threads);
}

#include "quant_q8.h"

}  // namespace

extern "C" {

// The tier these kernels were compiled for: "avx512-bf16", "avx512", "avx2" or "portable" (simd.h); "amx-bf16"
// where the AVX512-BF16 build has AMX and the kernel granted it (the bfloat16 linears' and attention's dot
// products take tiles).
const char* brine_kernel_tier() { return kAmx ? "amx-bf16" : kTier; }

// 1: every build has the kernel (kept for the loader's check).
int brine_quant_linear_supported() { return 1; }

// Bumped whenever the arguments or the record layout change (2: wtype is the kind's bits; 3: its kQ8Act bit).
int brine_quant_linear_abi() { return 3; }

// wtype: the record kind's bits (the header). x_dtype / out_dtype: 0 = float32, 1 = bfloat16. k: a multiple
// of 32. Returns 0, or non-zero for arguments it refuses (nothing is written then).
int brine_quant_linear(int wtype, const uint8_t* w, int64_t n, int64_t k, int x_dtype, const void* x, int64_t m,
                       int64_t x_stride, const float* bias, void* out, int64_t out_stride, int out_dtype,
                       int threads) {
    const Kind kind{wtype};
    const bool kind_ok = (wtype & ~kKnownBits) == 0 && (!kind.halves() || (kind.int8() && !kind.min()));
    if (n <= 0 || k <= 0 || k % kBlock != 0 || m < 0 || threads <= 0 || !kind_ok ||
        (x_dtype != kDtypeF32 && x_dtype != kDtypeBF16) || (out_dtype != kDtypeF32 && out_dtype != kDtypeBF16))
        return 1;
    if (m == 0) return 0;
    const Args a{n, k, m, kind, nullptr, nullptr, bias, out, out_stride, out_dtype};  // run packs x
    if (kind.q8act()) {
        if (x_dtype == kDtypeF32) run_q8(a, static_cast<const float*>(x), x_stride, w, threads);
        else run_q8(a, static_cast<const uint16_t*>(x), x_stride, w, threads);
        return 0;
    }
    if (kind.int8()) dispatch<kQ8>(a, x_dtype, x, x_stride, w, threads);
    else dispatch<kQ4>(a, x_dtype, x, x_stride, w, threads);
    return 0;
}

}  // extern "C"
