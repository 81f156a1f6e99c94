// y = x W^T (+ b) on GGUF-quantized weights kept as stored (engine/model/quant_linear.py).
//
// Why: a decode step streams every weight once. As bfloat16 the default model's linears are ~270 MB per token;
// as the GGUF's own Q4_1 blocks (and the Q8_0 output head) they are ~96 MB, and the step is bound by that
// stream. The weights are the GGUF's exact values, d * q + m, never rounded to 16 bits.
//
// Layout (written once at load by quant_linear.repack): the output features are cut into tiles of 16; for
// each tile and each block of 32 input features there is one record:
//   Q4_1: 16 f16 d | 16 f16 m | 256 bytes of nibbles: q[c][i] for the 16 columns c and 32 inputs i, in the
//         order unpack reads them (see there)                                                        (320 B)
//   Q8_0: 16 f16 d | 16 pairs x 16 x 2 int8, (q[c][2p], q[c][2p+1])                                  (544 B)
// so one 16-byte (or 32-byte) load gives one input pair for all 16 outputs of the tile.
//
// Arithmetic, per output column n and input row r, over the K / 32 blocks b in order:
//   P = sum over the block's 16 pairs, in order, of q[n][2p] x[2p] + q[n][2p+1] x[2p+1]   (from P = 0)
//   total = fma(d[n][b], P, total); total = fma(m[n][b], S[r][b], total)  (S: the block's x summed in order from 0)
//   y = round(total + bias[n]) to the output dtype
// With bfloat16 activations P uses AVX512-BF16 `vdpbf16ps`; q (0..15, or -128..127) and x are exact in
// bfloat16, so every product is exact. With float32 activations P uses fmaf (even input first, then odd).
//
// Invariance: that sequence depends only on the row's own x and the weights. Rows are processed in groups (of
// up to 12 or 16, from a copy of x packed per group, see run) and columns in tiles by any thread, but no lane
// ever mixes rows or columns, and the block order is fixed: a row's bits do not depend on the batch, its
// position in it, or the thread count.

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "dtypes.h"

static constexpr int kTile = 16;   // output features per tile: one 512-bit vector of float32
static constexpr int kBlock = 32;  // input features per GGUF block
static constexpr int kPairs = kBlock / 2;
static constexpr int64_t kPrefetch = 4096;  // bytes ahead of the record being unpacked
static constexpr int kDirectRows = 48;  // up to this many rows, records are used as unpacked (measured crossover)

static constexpr int kQ4_1 = 0;
static constexpr int kQ8_0 = 1;
using brine::kDtypeBF16;
using brine::kDtypeF32;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define BRINE_QUANT_LINEAR 1
#include <immintrin.h>
#include <omp.h>
#else
#define BRINE_QUANT_LINEAR 0
#endif

#if BRINE_QUANT_LINEAR
namespace {

// Rows per group, at most (measured): each row is one chain of dot products per lane, and each group reads the
// weights again (from cache), which costs Q8_0's wider records more.
constexpr int max_rows(int wtype) { return wtype == kQ4_1 ? 12 : 16; }

constexpr int64_t record_bytes(int wtype) { return wtype == kQ4_1 ? 2 * 2 * kTile + kPairs * kTile : 2 * kTile + kPairs * kTile * 2; }

// One tile's weights unpacked for the whole K: per block, 16 pair vectors and the d and m vectors.
// bf16 activations: a pair vector is 32 bfloat16 (q[c][2p], q[c][2p+1]) for c = 0..15.
// f32 activations: two float32 vectors per pair (the even inputs' q, then the odd ones').
// (std::vector would not keep __m512's 64-byte alignment: the storage is aligned by hand.)
class Panel {
   public:
    void resize(int64_t blocks, int per_pair) {
        const size_t need = static_cast<size_t>(blocks) * (kPairs * per_pair + 2) * 64 + 64;
        if (raw_.size() < need) raw_.resize(need);
        auto base = reinterpret_cast<uintptr_t>(raw_.data());
        pairs = reinterpret_cast<__m512i*>((base + 63) & ~uintptr_t{63});
        dm = reinterpret_cast<__m512*>(pairs + blocks * kPairs * per_pair);
    }
    __m512i* pairs = nullptr;  // [blocks][16 or 32]
    __m512* dm = nullptr;      // [blocks][2]: d, then m

   private:
    std::vector<uint8_t> raw_;
};

// One record (one tile, one block of 32 inputs): its 16 pair vectors (32 for float32 activations: the even
// inputs' q, then the odd ones') into out, and its d and m (0 for Q8_0) as float32 into dm.
template <int WT, int XT>
inline void unpack_block(const uint8_t* rec, __m512i* out, __m512* dm) {
    // bfloat16 of 0..15, split into its low and high bytes: vpshufb's tables (one per 128-bit lane)
    const __m512i table_lo = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0x00, static_cast<char>(0x80), 0x00, 0x40, static_cast<char>(0x80), static_cast<char>(0xa0),
                      static_cast<char>(0xc0), static_cast<char>(0xe0), 0x00, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60,
                      0x70));
    const __m512i table_hi = _mm512_broadcast_i32x4(
        _mm_setr_epi8(0x00, 0x3f, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41, 0x41));
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    // The weights stream from memory once per call: ask for the lines kPrefetch bytes ahead (the rest of this
    // tile, then the next one, which follows it in memory) while these convert.
    for (int64_t o = 0; o < record_bytes(WT); o += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rec + kPrefetch + o), _MM_HINT_T0);
    const uint16_t* scales = reinterpret_cast<const uint16_t*>(rec);
    dm[0] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales)));
    dm[1] = WT == kQ4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + kTile)))
                        : _mm512_setzero_ps();
    const uint8_t* qs = rec + (WT == kQ4_1 ? 4 : 2) * kTile;
    if constexpr (WT == kQ4_1) {
        // Each 64-byte chunk j holds pairs 4j .. 4j + 3 (repack's order): the low nibbles of each lane's first
        // and last 8 bytes are pairs 4j and 4j + 1, the high nibbles 4j + 2 and 4j + 3. A table lookup gives
        // each nibble's bfloat16 bytes, and interleaving them gives the words in place.
        for (int j = 0; j < 4; ++j) {
            const __m512i v = _mm512_loadu_si512(qs + 64 * j);
            const __m512i nib[2] = {_mm512_and_si512(v, low4), _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
            for (int h = 0; h < 2; ++h) {
                const __m512i lo = _mm512_shuffle_epi8(table_lo, nib[h]), hi = _mm512_shuffle_epi8(table_hi, nib[h]);
                const __m512i pv[2] = {_mm512_unpacklo_epi8(lo, hi), _mm512_unpackhi_epi8(lo, hi)};
                for (int t = 0; t < 2; ++t) {
                    const int p = 4 * j + 2 * h + t;
                    if constexpr (XT == kDtypeBF16) {
                        out[p] = pv[t];
                    } else {  // exact: q's bfloat16 widened
                        out[2 * p] = _mm512_slli_epi32(pv[t], 16);
                        out[2 * p + 1] = _mm512_and_si512(pv[t], _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
                    }
                }
            }
        }
    } else {
        for (int p = 0; p < kPairs; ++p) {
            // 32 int8: (q[c][2p], q[c][2p+1]) for c = 0..15
            const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + p * 2 * kTile)));
            if constexpr (XT == kDtypeBF16) {
                // int16 -> float32 -> bfloat16, exact for |q| <= 128: each word goes to its own lane pair
                // (vcvtne2ps2bf16 on the two halves measured 10% slower for the one-row head, two threads)
                const __m512 lo = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w, 16), 16));
                const __m512 hi = _mm512_cvtepi32_ps(_mm512_srai_epi32(w, 16));
                const __m512i lo_b = _mm512_srli_epi32(_mm512_castps_si512(lo), 16);
                const __m512i hi_b = _mm512_andnot_si512(_mm512_set1_epi32(0xffff), _mm512_castps_si512(hi));
                out[p] = _mm512_or_si512(lo_b, hi_b);
            } else {
                out[2 * p] = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(w, 16), 16)));
                out[2 * p + 1] = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srai_epi32(w, 16)));
            }
        }
    }
}

constexpr int pair_vectors(int xt) { return xt == kDtypeBF16 ? kPairs : 2 * kPairs; }

// A tile's records unpacked into the panel, for many rows to reuse.
template <int WT, int XT>
void unpack(const uint8_t* rec, int64_t blocks, Panel& panel) {
    panel.resize(blocks, pair_vectors(XT) / kPairs);
    for (int64_t b = 0; b < blocks; ++b)
        unpack_block<WT, XT>(rec + b * record_bytes(WT), panel.pairs + b * pair_vectors(XT), panel.dm + 2 * b);
}

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
    // x as pack_rows writes it: each row group's rows side by side per block, [group][block][row][32], so that
    // a group's R rows of a block are one pointer and constant offsets. Group g starts at row first(g) x k.
    void* x;
    float* sums;  // [group][block][row], likewise: each block's sum of x (Q4_1 only)
    const float* bias;
    void* out;
    int64_t out_stride;
    int out_dtype;
};

// Rows r0 .. r0 + R - 1 (one row group) of block b against one tile's unpacked block (w, dm): total += d P + m S.
template <int WT, int XT, int R>
inline void block_dot(const Args& a, const __m512i* w, const __m512* dm, int64_t b, int64_t r0, __m512* total) {
    const int64_t at = r0 * (a.k / kBlock) + b * R;  // the group's first row of block b, in rows of one block
    __m512 part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
    if constexpr (XT == kDtypeBF16) {
        const uint16_t* xb = static_cast<const uint16_t*>(a.x) + at * kBlock;
        for (int p = 0; p < kPairs; ++p) {
            const __m512bh wp = (__m512bh)w[p];
            for (int r = 0; r < R; ++r) {
                int32_t pair;
                std::memcpy(&pair, xb + r * kBlock + 2 * p, 4);
                part[r] = _mm512_dpbf16_ps(part[r], wp, (__m512bh)_mm512_set1_epi32(pair));
            }
        }
    } else {
        const float* xb = static_cast<const float*>(a.x) + at * kBlock;
        for (int p = 0; p < kPairs; ++p) {
            const __m512 we = _mm512_castsi512_ps(w[2 * p]), wo = _mm512_castsi512_ps(w[2 * p + 1]);
            for (int r = 0; r < R; ++r) {
                part[r] = _mm512_fmadd_ps(we, _mm512_set1_ps(xb[r * kBlock + 2 * p]), part[r]);
                part[r] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xb[r * kBlock + 2 * p + 1]), part[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        total[r] = _mm512_fmadd_ps(dm[0], part[r], total[r]);
        if constexpr (WT == kQ4_1) total[r] = _mm512_fmadd_ps(dm[1], _mm512_set1_ps(a.sums[at + r]), total[r]);
    }
}

// f32_to_bf16 on 16 lanes: a NaN kept quiet, anything else rounded to nearest even.
inline __m256i to_bf16(__m512 y) {
    const __m512i u = _mm512_castps_si512(y);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                 _mm512_set1_epi32(0x7f800000));
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb);
    const __m512i quiet = _mm512_or_si512(u, _mm512_set1_epi32(0x400000));
    // the high halves, as one 256-bit vector (vpermw: a down-converting store, vpmovdw, is slow on Zen 4)
    const __m512i high = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 31, 29, 27, 25, 23, 21, 19,
                                          17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi16(high, _mm512_mask_blend_epi32(nan, rounded, quiet)));
}

// y = total + bias for rows r0 .. r0 + R - 1 of one tile; the last tile's missing columns are not written.
template <int R>
void store_rows(const Args& a, const __m512* total, int64_t tile, int64_t r0) {
    const int64_t c0 = tile * kTile;
    const __mmask16 cols = a.n - c0 < kTile ? static_cast<__mmask16>((1u << (a.n - c0)) - 1) : __mmask16{0xffff};
    const __m512 bias = a.bias ? _mm512_maskz_loadu_ps(cols, a.bias + c0) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
        const __m512 y = a.bias ? _mm512_add_ps(total[r], bias) : total[r];
        if (a.out_dtype == kDtypeBF16) {
            uint16_t* o = static_cast<uint16_t*>(a.out) + (r0 + r) * a.out_stride + c0;
            if (cols == 0xffff) _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), to_bf16(y));
            else _mm256_mask_storeu_epi16(o, cols, to_bf16(y));
        } else {
            float* o = static_cast<float*>(a.out) + (r0 + r) * a.out_stride + c0;
            if (cols == 0xffff) _mm512_storeu_ps(o, y);
            else _mm512_mask_storeu_ps(o, cols, y);
        }
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

// One row group against one tile, straight from its records: each block is unpacked into registers and
// used at once, with no panel written and read back (a second group unpacks again, from cache). Every lane's
// arithmetic is the sequence in the header.
template <int WT, int XT, int R>
void group_direct(const Args& a, const uint8_t* rec, int64_t tile, int64_t r0) {
    __m512 total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a.k / kBlock; ++b, rec += record_bytes(WT)) {
        __m512i w[pair_vectors(XT)];
        __m512 dm[2];
        unpack_block<WT, XT>(rec, w, dm);
        block_dot<WT, XT, R>(a, w, dm, b, r0, total);
    }
    store_rows<R>(a, total, tile, r0);
}

// One row group against one tile's panel (its records unpacked for the whole K). Same arithmetic.
template <int WT, int XT, int R>
void group_panel(const Args& a, const Panel& panel, int64_t tile, int64_t r0) {
    __m512 total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a.k / kBlock; ++b)
        block_dot<WT, XT, R>(a, panel.pairs + b * pair_vectors(XT), panel.dm + 2 * b, b, r0, total);
    store_rows<R>(a, total, tile, r0);
}

// Each block's sum of x for 16 blocks of one row at once (lane j: block j, where `blocks` has bit j), each in
// order from 0 as the header's S is: the lanes gather their blocks' inputs one index at a time.
template <int XT, typename T>
inline __m512 block_sums(const T* row, __mmask16 blocks) {
    const __m512i block = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512 s = _mm512_setzero_ps();
    if constexpr (XT == kDtypeBF16) {  // a 32-bit gather brings inputs 2i (its low half) and 2i + 1
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

// Row groups g0 .. g1 - 1 of x copied into the packed layout of a.x, with (Q4_1) each block's sum of x.
template <int WT, int XT, typename T>
void pack_rows(const T* x, int64_t x_stride, const RowGroups& groups, int64_t g0, int64_t g1, const Args& a) {
    const int64_t blocks = a.k / kBlock;
    T* packed = static_cast<T*>(a.x);
    for (int64_t g = g0; g < g1; ++g) {
        const int64_t r0 = groups.first(g), rows = groups.rows(g);
        for (int64_t r = 0; r < rows; ++r) {
            const T* row = x + (r0 + r) * x_stride;
            for (int64_t b = 0; b < blocks; ++b)
                std::memcpy(packed + (r0 * blocks + b * rows + r) * kBlock, row + b * kBlock, sizeof(T) * kBlock);
            if constexpr (WT == kQ4_1)
                for (int64_t b0 = 0; b0 < blocks; b0 += kTile) {
                    const int64_t count = blocks - b0 < kTile ? blocks - b0 : kTile;
                    alignas(64) float s[kTile];
                    _mm512_store_ps(s, block_sums<XT>(row + b0 * kBlock, static_cast<__mmask16>((1u << count) - 1)));
                    for (int64_t j = 0; j < count; ++j) a.sums[r0 * blocks + (b0 + j) * rows + r] = s[j];
                }
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

// a, with its packed rows and sums in this thread's scratch memory.
template <int WT, int XT>
Args packed(Args a) {
    const auto x_bytes = static_cast<size_t>(a.m * a.k * (XT == kDtypeBF16 ? 2 : 4));
    uint8_t* at = scratch(x_bytes + static_cast<size_t>(WT == kQ4_1 ? a.m * (a.k / kBlock) * 4 : 0));
    a.x = at;
    a.sums = reinterpret_cast<float*>(at + x_bytes);
    return a;
}

// The threads share out the tiles, each a run of neighbouring tiles (they follow each other in memory, for
// the prefetch), and run each tile's row groups.
//  - Up to kDirectRows rows, each thread packs all the rows itself (a few KB: no thread waits for another's,
//    nor reads them from the other core's cache), and every group reads the tile's records straight into
//    registers (group_direct). (Several tiles at once for few rows, to overlap their chains, measured slower:
//    4-tile groups split the tiles unevenly between the threads.)
//  - More rows, the threads pack them together; then each unpacks two tiles at a time into its panels and runs
//    every group over both, so that the packed rows (megabytes at prefill sizes) stream in once per two tiles
//    and each row's output line is written in one go.
template <int WT, int XT>
void run(const Args& in, const void* x_in, int64_t x_stride, const uint8_t* w, int threads) {
    using T = std::conditional_t<XT == kDtypeBF16, uint16_t, float>;
    const T* x = static_cast<const T*>(x_in);
    const int64_t blocks = in.k / kBlock, tiles = (in.n + kTile - 1) / kTile;
    constexpr int kMost = max_rows(WT);
    const RowGroups groups(in.m, kMost);
    const auto records = [&](int64_t tile) { return w + tile * blocks * record_bytes(WT); };
    if (in.m <= kDirectRows) {
#pragma omp parallel num_threads(threads)
        {
            const Args a = packed<WT, XT>(in);
            pack_rows<WT, XT>(x, x_stride, groups, 0, groups.count, a);
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
    const Args a = packed<WT, XT>(in);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups.count; ++g) pack_rows<WT, XT>(x, x_stride, groups, g, g + 1, a);
        // (past the omp for's barrier: every row is packed)
        // Kept per thread across calls: a fresh one per call cost a zeroed allocation (mmap'd, page-faulted
        // anew, for the larger layers) in every layer of every step.
        static thread_local Panel panels[2];
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t end = tiles * (me + 1) / team;
        for (int64_t t = tiles * me / team; t < end; t += 2) {
            const int pair = end - t < 2 ? 1 : 2;
            for (int i = 0; i < pair; ++i) unpack<WT, XT>(records(t + i), blocks, panels[i]);
            for (int64_t g = 0; g < groups.count; ++g) {
                const int64_t r0 = groups.first(g);
                with_rows<kMost / 2, kMost>(groups.rows(g), [&](auto R) {
                    for (int i = 0; i < pair; ++i) group_panel<WT, XT, R.value>(a, panels[i], t + i, r0);
                });
            }
        }
    }
}

}  // namespace
#endif  // BRINE_QUANT_LINEAR

extern "C" {

// 1 where this build has the kernel (AVX512 with BF16, which -march=native enables only on CPUs that have it).
int brine_quant_linear_supported() { return BRINE_QUANT_LINEAR; }

// Bumped whenever the arguments or the record layout change.
int brine_quant_linear_abi() { return 1; }

// wtype: 0 = Q4_1, 1 = Q8_0. x_dtype / out_dtype: 0 = float32, 1 = bfloat16. k: a multiple of 32.
// Returns 0, or non-zero for arguments it refuses (nothing is written then).
int brine_quant_linear(int wtype, const uint8_t* w, int64_t n, int64_t k, int x_dtype, const void* x, int64_t m,
                       int64_t x_stride, const float* bias, void* out, int64_t out_stride, int out_dtype,
                       int threads) {
    if (n <= 0 || k <= 0 || k % kBlock != 0 || m < 0 || threads <= 0 || (wtype != kQ4_1 && wtype != kQ8_0) ||
        (x_dtype != kDtypeF32 && x_dtype != kDtypeBF16) || (out_dtype != kDtypeF32 && out_dtype != kDtypeBF16))
        return 1;
    if (m == 0) return 0;
#if !BRINE_QUANT_LINEAR
    (void)w, (void)x, (void)x_stride, (void)bias, (void)out, (void)out_stride;
    return 3;
#else
    const Args a{n, k, m, nullptr, nullptr, bias, out, out_stride, out_dtype};  // run packs x
    if (wtype == kQ4_1 && x_dtype == kDtypeBF16) run<kQ4_1, kDtypeBF16>(a, x, x_stride, w, threads);
    else if (wtype == kQ4_1) run<kQ4_1, kDtypeF32>(a, x, x_stride, w, threads);
    else if (x_dtype == kDtypeBF16) run<kQ8_0, kDtypeBF16>(a, x, x_stride, w, threads);
    else run<kQ8_0, kDtypeF32>(a, x, x_stride, w, threads);
    return 0;
#endif
}

}  // extern "C"
