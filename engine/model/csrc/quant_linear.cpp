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
//   total = fma(d[n][b], P, total); total = fma(m[n][b], S[r][b], total)         (S: the block's sum of x)
//   y = round(total + bias[n]) to the output dtype
// With bfloat16 activations P uses AVX512-BF16 `vdpbf16ps`; q (0..15, or -128..127) and x are exact in
// bfloat16, so every product is exact. With float32 activations P uses fmaf (even input first, then odd).
//
// Invariance: that sequence depends only on the row's own x and the weights. Rows are processed in groups of
// up to 8 and columns in tiles by any thread, but no lane ever mixes rows or columns, and the block order is
// fixed: a row's bits do not depend on the batch, its position in it, or the thread count.

#include <cstdint>
#include <cstring>
#include <vector>

#include "dtypes.h"

static constexpr int kTile = 16;   // output features per tile: one 512-bit vector of float32
static constexpr int kBlock = 32;  // input features per GGUF block
static constexpr int kPairs = kBlock / 2;
static constexpr int64_t kPrefetch = 4096;  // bytes ahead of the record being unpacked
static constexpr int kRows = 8;  // rows per group, at most: 8 partial + 8 total accumulators in registers
static constexpr int kDirectRows = 24;  // up to this many rows, records are used as unpacked (measured crossover)

static constexpr int kQ4_1 = 0;
static constexpr int kQ8_0 = 1;
using brine::kDtypeBF16;
using brine::kDtypeF32;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define BRINE_QUANT_LINEAR 1
#include <immintrin.h>
#else
#define BRINE_QUANT_LINEAR 0
#endif

#if BRINE_QUANT_LINEAR
namespace {

using brine::bf16_to_f32;
using brine::f32_to_bf16;


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

struct Args {
    int64_t n, k, m;
    const void* x;
    int64_t x_stride;  // elements between rows
    const float* bias;
    void* out;
    int64_t out_stride;
    int out_dtype;
    const float* sums;  // [m][blocks]: each block's sum of x (Q4_1 only)
};

// One block of rows r0 .. r0 + R - 1 against one tile's unpacked block (w, dm): total += d P + m S.
template <int WT, int XT, int R>
inline void block_dot(const Args& a, const __m512i* w, const __m512* dm, int64_t b, int64_t r0, __m512* total) {
    const int64_t blocks = a.k / kBlock;
    __m512 part[R];
    for (int r = 0; r < R; ++r) part[r] = _mm512_setzero_ps();
    if constexpr (XT == kDtypeBF16) {
        for (int p = 0; p < kPairs; ++p) {
            const __m512bh wp = (__m512bh)w[p];
            for (int r = 0; r < R; ++r) {
                const uint16_t* xr = static_cast<const uint16_t*>(a.x) + (r0 + r) * a.x_stride + b * kBlock + 2 * p;
                int32_t pair;
                std::memcpy(&pair, xr, 4);
                part[r] = _mm512_dpbf16_ps(part[r], wp, (__m512bh)_mm512_set1_epi32(pair));
            }
        }
    } else {
        for (int p = 0; p < kPairs; ++p) {
            const __m512 we = _mm512_castsi512_ps(w[2 * p]), wo = _mm512_castsi512_ps(w[2 * p + 1]);
            for (int r = 0; r < R; ++r) {
                const float* xr = static_cast<const float*>(a.x) + (r0 + r) * a.x_stride + b * kBlock + 2 * p;
                part[r] = _mm512_fmadd_ps(we, _mm512_set1_ps(xr[0]), part[r]);
                part[r] = _mm512_fmadd_ps(wo, _mm512_set1_ps(xr[1]), part[r]);
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        total[r] = _mm512_fmadd_ps(dm[0], part[r], total[r]);
        if constexpr (WT == kQ4_1) total[r] = _mm512_fmadd_ps(dm[1], _mm512_set1_ps(a.sums[(r0 + r) * blocks + b]), total[r]);
    }
}

template <int R>
void store_rows(const Args& a, const __m512* total, int64_t tile, int64_t r0) {
    const int64_t c0 = tile * kTile;
    const int cols = static_cast<int>(a.n - c0 < kTile ? a.n - c0 : kTile);
    for (int r = 0; r < R; ++r) {
        alignas(64) float y[kTile];
        _mm512_store_ps(y, total[r]);
        for (int c = 0; c < cols; ++c) {
            const float v = a.bias ? y[c] + a.bias[c0 + c] : y[c];
            if (a.out_dtype == kDtypeBF16)
                static_cast<uint16_t*>(a.out)[(r0 + r) * a.out_stride + c0 + c] = f32_to_bf16(v);
            else
                static_cast<float*>(a.out)[(r0 + r) * a.out_stride + c0 + c] = v;
        }
    }
}

// Rows r0 .. r0 + R - 1 against one tile's panel: every lane's arithmetic is the sequence in the header.
template <int WT, int XT, int R>
void rows_tile(const Args& a, const Panel& panel, int64_t tile, int64_t r0) {
    __m512 total[R];
    for (int r = 0; r < R; ++r) total[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < a.k / kBlock; ++b)
        block_dot<WT, XT, R>(a, panel.pairs + b * pair_vectors(XT), panel.dm + 2 * b, b, r0, total);
    store_rows<R>(a, total, tile, r0);
}

// The same straight from the records, for calls with few rows (at most kDirectRows): each block is unpacked
// into registers and used at once, with no panel written and read back (a second row group unpacks again,
// from cache). Same arithmetic.
template <int WT, int XT, int R>
void rows_tile_direct(const Args& a, const uint8_t* rec, int64_t tile, int64_t r0) {
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

// Rows r0 .. r0 + rows - 1 (1 <= rows <= R) against one tile, straight from its records.
template <int WT, int XT, int R>
void direct_dispatch(const Args& a, const uint8_t* rec, int64_t tile, int64_t r0, int rows) {
    if constexpr (R > 0) {
        if (rows == R) return rows_tile_direct<WT, XT, R>(a, rec, tile, r0);
        direct_dispatch<WT, XT, R - 1>(a, rec, tile, r0, rows);
    }
}

// The row groups: as few of at most kRows rows as cover all rows, of near-equal sizes (13 rows: 7 + 6, not
// 8 + 5), since a small group is a short chain per lane that waits on each dot product's latency.
template <typename F>
inline void for_row_groups(int64_t m, F&& group) {
    int64_t r = 0;
    for (int64_t groups = (m + kRows - 1) / kRows; groups > 0; --groups) {
        const int rows = static_cast<int>((m - r + groups - 1) / groups);
        group(r, rows);
        r += rows;
    }
}

// Rows r0 .. r0 + rows - 1 (1 <= rows <= R): rows_tile instantiated for that count.
template <int WT, int XT, int R>
void rows_dispatch(const Args& a, const Panel& panel, int64_t tile, int64_t r0, int rows) {
    if constexpr (R > 0) {
        if (rows == R) return rows_tile<WT, XT, R>(a, panel, tile, r0);
        rows_dispatch<WT, XT, R - 1>(a, panel, tile, r0, rows);
    }
}

// Tiles are shared out among the threads, and each tile's rows run in for_row_groups' groups. Up to
// kDirectRows rows, each group reads the tile's records straight into registers (rows_tile_direct); more
// rows, each thread unpacks a tile once into its panel and every group reads that. (Several tiles at once
// for few rows, to overlap their chains, measured slower: 4-tile groups split the tiles unevenly between the
// threads.)
template <int WT, int XT>
void run(const Args& a, const uint8_t* w, int threads) {
    const int64_t blocks = a.k / kBlock, tiles = (a.n + kTile - 1) / kTile;
    if (a.m <= kDirectRows) {
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            const uint8_t* rec = w + t * blocks * record_bytes(WT);
            for_row_groups(a.m, [&](int64_t r0, int rows) { direct_dispatch<WT, XT, kRows>(a, rec, t, r0, rows); });
        }
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        // Kept per thread across calls: a fresh one per call cost a zeroed allocation (mmap'd, page-faulted
        // anew, for the larger layers) in every layer of every step.
        static thread_local Panel panel;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; ++t) {
            unpack<WT, XT>(w + t * blocks * record_bytes(WT), blocks, panel);
            for_row_groups(a.m, [&](int64_t r0, int rows) { rows_dispatch<WT, XT, kRows>(a, panel, t, r0, rows); });
        }
    }
}

template <int XT>
void block_sums(const void* x, int64_t x_stride, int64_t m, int64_t k, float* sums, int threads) {
    const int64_t blocks = k / kBlock;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t r = 0; r < m; ++r)
        for (int64_t b = 0; b < blocks; ++b) {
            float s = 0.0f;  // in order: fixed, whatever the thread
            for (int i = 0; i < kBlock; ++i) {
                const int64_t j = r * x_stride + b * kBlock + i;
                s += XT == kDtypeBF16 ? bf16_to_f32(static_cast<const uint16_t*>(x)[j]) : static_cast<const float*>(x)[j];
            }
            sums[r * blocks + b] = s;
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
    std::vector<float> sums;
    if (wtype == kQ4_1) {
        sums.resize(static_cast<size_t>(m * (k / kBlock)));
        if (x_dtype == kDtypeBF16)
            block_sums<kDtypeBF16>(x, x_stride, m, k, sums.data(), threads);
        else
            block_sums<kDtypeF32>(x, x_stride, m, k, sums.data(), threads);
    }
    const Args a{n, k, m, x, x_stride, bias, out, out_stride, out_dtype, sums.data()};
    if (wtype == kQ4_1 && x_dtype == kDtypeBF16) run<kQ4_1, kDtypeBF16>(a, w, threads);
    else if (wtype == kQ4_1) run<kQ4_1, kDtypeF32>(a, w, threads);
    else if (x_dtype == kDtypeBF16) run<kQ8_0, kDtypeBF16>(a, w, threads);
    else run<kQ8_0, kDtypeF32>(a, w, threads);
    return 0;
#endif
}

}  // extern "C"
