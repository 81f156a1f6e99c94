// Batch-invariant paged attention for CPU that reads the KV cache in place (engine/model/native_attention.py).
//
// One work item is (a few consecutive query tokens of one request, one KV head); its rows are (token, query
// head of the GQA group). It walks the request's block table from its first visible block to its last,
// twice: pass 1 computes every row's scores against each block's keys and keeps them, with each row's exact
// max; pass 2 turns the scores into weights exp(score - max) and accumulates weights x values and the
// weights' sum. Nothing is gathered into contiguous tensors first, so a cached context costs only its reads,
// and no running max is ever rescaled.
//
// The caches are in the query's dtype, or in float16 under float32 queries (`--kv-cache-dtype float16`): each
// float16 key and value widens to float32 exactly, and the float32 paths run on the widened numbers.
//
// Two implementations of the same contract:
//   - the generic one (any dtype, block size and head_dim): float32 arithmetic, explicit fmaf;
//   - in bfloat16 with 16-key blocks and head_dim a multiple of 32, where the CPU has AVX512-BF16: scores are
//     vdpbf16ps over the query's and keys' dimension pairs, in order, times the scale; weights are rounded to
//     bfloat16 (as transformers rounds its probabilities before multiplying the values), summed as rounded,
//     and weights x values come from vdpbf16ps over key pairs (2i, 2i + 1) of each block, in order.
//
// Invariance: each row's arithmetic is a fixed sequence that depends only on its own query, its own visible
// keys (by absolute position) and the block size. Which other rows share its item, the batch, the chunking of
// its prompt, which physical blocks hold its keys and the thread count change none of it:
//   - a score is a dot product over head_dim in order (-ffp-contract=off keeps the compiler from fusing
//     anything else differently in different loops);
//   - the max is exact in any order; hidden keys get weight exactly 0;
//   - weights are summed per key lane (a key's position mod the block size) in position order, then the
//     lanes by a fixed halving tree; weights x values are accumulated key by key (key pair by key pair) in
//     position order, each output dimension on its own.
// Rows are computed in groups only to give the CPU independent chains; that changes no row's arithmetic
// either. The tests compare rows computed alone, chunked, batched, on other blocks and threads bit for bit.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx.h"
#include "dtypes.h"
#include "entry_points.h"
#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BRINE_BF16_SCORES 1
#include <immintrin.h>
#else
#define BRINE_BF16_SCORES 0
#endif

namespace {

using namespace brine;

template <int DT>
inline float load(const void* p, int64_t i) {
    if constexpr (DT == kDtypeF32) {
        return static_cast<const float*>(p)[i];
    } else if constexpr (DT == kDtypeBF16) {
        return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    } else {
        return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
    }
}

template <int DT>
inline void store(void* p, int64_t i, float x) {
    if constexpr (DT == kDtypeF32) {
        static_cast<float*>(p)[i] = x;
    } else if constexpr (DT == kDtypeBF16) {
        static_cast<uint16_t*>(p)[i] = f32_to_bf16(x);
    } else {
        static_cast<uint16_t*>(p)[i] = f32_to_f16(x);
    }
}

// exp(x) for x <= 0 (Cephes' expf polynomial, ~1 ulp), written so that the compiler vectorises a loop of it.
inline float exp_nonpos(float x) {
    x = x > -87.0f ? x : -87.0f;  // also maps -inf (a first block's old max) to a tiny weight
    // n = round(x / ln 2) by the 1.5 * 2^23 trick (floorf would not vectorise without -fno-trapping-math)
    const float magic = 12582912.0f;
    const float n = (x * 1.44269504088896341f + magic) - magic;
    float r = std::fma(n, -0.693359375f, x);
    r = std::fma(n, 2.12194440e-4f, r);
    const float p = exp_poly(r);
    const float y = std::fma(p * r, r, r) + 1.0f;
    union {
        int32_t i;
        float f;
    } scale;
    scale.i = (static_cast<int32_t>(n) + 127) << 23;
    return y * scale.f;
}

struct Args {
    const void* q;
    int64_t q_stride_t, q_stride_h;  // elements; head_dim is contiguous
    const void* k_cache;             // [num_blocks, block_size, kv_heads, head_dim], contiguous
    const void* v_cache;
    void* out;                       // [tokens, heads, head_dim], contiguous
    const int32_t* items;            // [num_items, 5]: first token, tokens, first position, context, table row
    int64_t num_items;
    const int32_t* tables;           // [rows, table_width] block ids
    int64_t table_width;
    int heads, kv_heads, head_dim, block_size;
    int causal, window;              // window <= 0: none; else key k visible to query p iff k > p - window
    float scale;
};

#if BRINE_BF16_SCORES
// A 16 x 16 matrix of dwords, row j in m[j], transposed in place (m[i] then holds column i): 32-bit, then 64-bit
// unpacks within 128-bit lanes, then two rounds of 128-bit lane shuffles. 64 shuffles where element-wise copies
// took 256 loads and stores (a 16-key block's keys for the bf16 scores: half of a decode step's attention).
inline void transpose16x16(__m512i m[16]) {
    __m512i t[16];
    for (int k = 0; k < 8; ++k) {  // t[2k]: rows 2k, 2k+1 interleaved, columns 4L, 4L+1 of each lane L; t[2k+1]: 4L+2, 4L+3
        t[2 * k] = _mm512_unpacklo_epi32(m[2 * k], m[2 * k + 1]);
        t[2 * k + 1] = _mm512_unpackhi_epi32(m[2 * k], m[2 * k + 1]);
    }
    __m512i u[16];  // u[4g + c]: lane L holds rows 4g .. 4g+3 of column 4L + c
    for (int g = 0; g < 4; ++g) {
        u[4 * g + 0] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        u[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        u[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int c = 0; c < 4; ++c) {  // column 4L + c: lane L of u[c], u[4 + c], u[8 + c], u[12 + c]
        const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xee);
        const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44), v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xee);
        m[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
        m[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xdd);
        m[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
        m[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xdd);
    }
}
#endif

// Each pass first asks for up to this many of the item's blocks (this head's rows of them) in L2, and then for
// one more as it finishes each: a decode over cached context then has more lines in flight than the hardware
// prefetcher keeps for a walk that reads one head's 128 bytes of every kv_heads x 128 in blocks scattered over
// the pool (decode over 2,000 cached tokens in DRAM 1.3-1.8x faster than with no prefetch). 16 blocks ahead
// measured 1.15-1.2x faster than asking for 256 up front (probably: those stalled the walk until the miss queue
// had taken them all), and the same as 4 or 8; _MM_HINT_T0 was 2x slower. The loops are written out in place:
// the same prefetches from a helper function measured 1.2-1.7x slower.
constexpr int kPrefetchBlocks = 16;
constexpr int kRowBlock = 4;    // rows whose scores are computed together: independent FMA chains, same bits
// The bfloat16 path's dot products on AMX tiles (Bf16Work's tile_scores and tile_values), where the build has them
// and the kernel grants them (amx.h): every call or none.
const bool kAmx = brine::amx::on();
constexpr int kMaxBlock = 256;  // largest block size and head_dim of the generic instantiation
constexpr int kMaxDim = 512;

constexpr int pow2_at_least(int n) {
    int w = 1;
    while (w < n) w *= 2;
    return w;
}

template <int N>
using Count = std::integral_constant<int, N>;
template <int kHigh, typename F>
inline void with_count(int n, F&& f) {  // f(Count<n>{}) for 1 <= n <= kHigh
    if constexpr (kHigh >= 1) {
        if (n == kHigh) return f(Count<kHigh>{});
        with_count<kHigh - 1>(n, f);
    }
}

// An item's query tokens, and the keys each may see: positions [first_key(t), end_key(t)).
struct ItemKeys {
    int tok0 = 0, ntok = 0, pos0 = 0, ctx = 0;
    const int32_t* table = nullptr;
    int b_lo = 0, b_hi = 0;  // the blocks any of its tokens sees

    ItemKeys() = default;

    ItemKeys(const Args& a, int64_t item, int bs) {
        const int32_t* it = a.items + item * 5;
        tok0 = it[0], ntok = it[1], pos0 = it[2], ctx = it[3];
        table = a.tables + static_cast<int64_t>(it[4]) * a.table_width;
        find_blocks(a, bs);
    }
    // Tokens [t0, t0 + n) of this item as an item of their own (the blocks they see, and no more).
    ItemKeys narrowed(const Args& a, int t0, int n, int bs) const {
        ItemKeys out = *this;
        out.tok0 = tok0 + t0, out.ntok = n, out.pos0 = pos0 + t0;
        out.find_blocks(a, bs);
        return out;
    }
    // b_lo, b_hi: the blocks of bs keys that any of the tokens sees.
    void find_blocks(const Args& a, int bs) {
        int lo_all = ctx, hi_all = 0;
        for (int t = 0; t < ntok; ++t) {
            lo_all = std::min(lo_all, first_key(a, t));
            hi_all = std::max(hi_all, end_key(a, t));
        }
        b_lo = lo_all / bs, b_hi = (hi_all + bs - 1) / bs;
    }
    int first_key(const Args& a, int t) const { return a.window > 0 ? std::max(0, pos0 + t - a.window + 1) : 0; }
    int end_key(const Args& a, int t) const { return a.causal ? pos0 + t + 1 : ctx; }
    // The keys of block b (of bs keys) that token t sees: lanes [vlo, vhi) (none when vhi <= vlo).
    void visible(const Args& a, int t, int b, int bs, int& vlo, int& vhi) const {
        vhi = std::min(end_key(a, t), bs * b + bs) - bs * b;
        vlo = std::max(first_key(a, t), bs * b) - bs * b;
    }
};

// A float32 step's cache element: float, or a float16 cache's bits (`brine serve --kv-cache-dtype float16`). A
// float16 key or value widens to float32 exactly, so every path below does the float32 cache's arithmetic on the
// widened values: the bits are those of a float32 cache that holds the same float16-rounded numbers.
template <int KT>
struct CacheElem {
    using type = float;
};
template <>
struct CacheElem<kDtypeF16> {
    using type = uint16_t;
};
inline float widen(float x) { return x; }
inline float widen(uint16_t h) { return f16_to_f32(h); }
inline simd::VF vload_kv(const float* p) { return simd::vload(p); }
inline simd::VF vload_kv(const uint16_t* p) { return simd::vload_f16(p); }

// A float16 block's 16 rows of D (stride apart) widened into out[16][D], 16 at a time. The generic path reads a
// block's keys and values once per item, the row-lanes path once per 16 rows; widening element by element there
// cost a decode 1.6x (generic, AVX512) and a prefill 1.3-1.4x (row lanes): widened per block, both read floats.
template <int D>
inline void widen_rows(const uint16_t* src, int64_t stride, float* out) {
    for (int j = 0; j < 16; ++j)
        for (int d = 0; d < D; d += 16) simd::vstore(out + j * D + d, simd::vload_f16(src + j * stride + d));
}
// A float32 block's keys copied the same way, for attend_lanes' scores: rows D apart, a stride the compiler knows.
// Read in place, `stride` apart (kv_heads x D, known only at run time), the 16 keys of a score chunk needed a
// pointer each, more than the general registers, and GCC kept them in vector registers, moved back one by one
// for every dim (AVX512 build, attention_bench --dtype float32: prefill 2,048 1.05x faster copied).
template <int D>
inline void widen_rows(const float* src, int64_t stride, float* out) {
    for (int j = 0; j < 16; ++j)
        for (int d = 0; d < D; d += 16) simd::vstore(out + j * D + d, simd::vload(src + j * stride + d));
}

// The generic implementation. BSC, DC: block size and head_dim fixed at compile time (0: taken from the
// arguments). The fixed ones let the compiler keep a row block's scores and a row's output in registers; the
// arithmetic is the same.
template <int DT, int KT, int BSC, int DC>
void attend_item(const Args& a, int64_t item, int kvh, std::vector<float>& buf) {
    const int BS = BSC ? BSC : a.block_size, D = DC ? DC : a.head_dim;
    const ItemKeys ik(a, item, BS);
    const int ntok = ik.ntok, tok0 = ik.tok0, b_lo = ik.b_lo, b_hi = ik.b_hi;
    const int G = a.heads / a.kv_heads, R = ntok * G;
    const int RP = (R + kRowBlock - 1) / kRowBlock * kRowBlock;  // rows padded with zero queries
    constexpr int BWC = BSC ? pow2_at_least(BSC) : 0;
    const int BW = BWC ? BWC : pow2_at_least(BS);  // block size rounded up to a power of two: lane count
    const int span = (b_hi - b_lo) * BS;

    buf.resize(static_cast<size_t>(RP) * (D + span) + static_cast<size_t>(R) * (D + 2 * BW) +
               static_cast<size_t>(BS) * 2 * D);
    float* qf = buf.data();      // [RP, D] scaled queries (pad rows 0)
    float* sc = qf + RP * D;     // [RP, span] every score of the item
    float* acc = sc + RP * span; // [R, D] weighted sum of values
    float* mx = acc + R * D;     // [R, BW] max per key lane (a key's lane: its position mod the block size)
    float* ls = mx + R * BW;     // [R, BW] sum of weights per key lane
    float* kt = ls + R * BW;     // [D, BS] one block's keys, transposed
    float* vf = kt + D * BS;     // [BS, D] one block's values

    for (int i = 0; i < R * D; ++i) acc[i] = 0.0f;
    for (int i = 0; i < R * BW; ++i) mx[i] = -INFINITY, ls[i] = 0.0f;

    const int64_t key_stride = static_cast<int64_t>(a.kv_heads) * D;  // between positions of one block
    for (int t = 0; t < ntok; ++t) {  // float32 queries, scaled
        for (int g = 0; g < G; ++g) {
            const int r = t * G + g;
            const int64_t qo = (tok0 + t) * a.q_stride_t + (kvh * G + g) * a.q_stride_h;
            for (int d = 0; d < D; ++d) qf[r * D + d] = load<DT>(a.q, qo + d) * a.scale;
        }
    }
    for (int i = R * D; i < RP * D; ++i) qf[i] = 0.0f;
    // Pass 1: scores, s[r, k] = sum over d, in order, of q[r, d] k[k, d]; each row's max per lane.
    for (int b = b_lo; b < b_hi; ++b) {
        const int64_t base = (static_cast<int64_t>(ik.table[b]) * BS * a.kv_heads + kvh) * D;
        const int col = (b - b_lo) * BS;
        if constexpr (KT == kDtypeF16 && BSC == 16 && DC > 0 && DC % 16 == 0) {  // widen_rows, then transpose
            widen_rows<DC>(static_cast<const uint16_t*>(a.k_cache) + base, key_stride, vf);  // (vf: free until pass 2)
            for (int j = 0; j < BS; ++j)
                for (int d = 0; d < D; ++d) kt[d * BS + j] = vf[j * D + d];
        } else {
            for (int j = 0; j < BS; ++j)
                for (int d = 0; d < D; ++d) kt[d * BS + j] = load<KT>(a.k_cache, base + j * key_stride + d);
        }
        for (int r0 = 0; r0 < RP; r0 += kRowBlock) {
            // Four separate accumulators (not one 2-D array), so that the compiler keeps all in registers.
            constexpr int W = BSC ? BSC : kMaxBlock;
            float s0[W], s1[W], s2[W], s3[W];
            for (int j = 0; j < BS; ++j) s0[j] = s1[j] = s2[j] = s3[j] = 0.0f;
            const float* q0 = qf + r0 * D;
            for (int d = 0; d < D; ++d) {
                const float* kd = kt + d * BS;
                const float a0 = q0[d], a1 = q0[D + d], a2 = q0[2 * D + d], a3 = q0[3 * D + d];
                for (int j = 0; j < BS; ++j) {
                    s0[j] = std::fma(a0, kd[j], s0[j]);
                    s1[j] = std::fma(a1, kd[j], s1[j]);
                    s2[j] = std::fma(a2, kd[j], s2[j]);
                    s3[j] = std::fma(a3, kd[j], s3[j]);
                }
            }
            float* sr = sc + static_cast<int64_t>(r0) * span + col;
            for (int j = 0; j < BS; ++j) {
                sr[j] = s0[j];
                sr[span + j] = s1[j];
                sr[2 * span + j] = s2[j];
                sr[3 * span + j] = s3[j];
            }
        }
        for (int t = 0; t < ntok; ++t) {
            int vlo, vhi;
            ik.visible(a, t, b, BS, vlo, vhi);
            if (vhi <= vlo) continue;
            for (int g = 0; g < G; ++g) {
                const int r = t * G + g;
                const float* sr = sc + static_cast<int64_t>(r) * span + col;
                float* mr = mx + r * BW;
                for (int j = 0; j < BS; ++j) {
                    const float x = (j >= vlo && j < vhi) ? sr[j] : -INFINITY;
                    mr[j] = x > mr[j] ? x : mr[j];
                }
            }
        }
    }
    // Each row's max: a halving tree over its lanes (max is exact in any order).
    for (int r = 0; r < R; ++r) {
        float* mr = mx + r * BW;
        for (int w = BW / 2; w >= 1; w /= 2)
            for (int j = 0; j < w; ++j) mr[j] = mr[j] > mr[j + w] ? mr[j] : mr[j + w];
    }
    // Pass 2: weights exp(s - max) (hidden keys exactly 0), their sums per lane, and weights x values.
    for (int b = b_lo; b < b_hi; ++b) {
        const int64_t base = (static_cast<int64_t>(ik.table[b]) * BS * a.kv_heads + kvh) * D;
        const int col = (b - b_lo) * BS;
        if constexpr (KT == kDtypeF16 && BSC == 16 && DC > 0 && DC % 16 == 0) {
            widen_rows<DC>(static_cast<const uint16_t*>(a.v_cache) + base, key_stride, vf);
        } else {
            for (int j = 0; j < BS; ++j)
                for (int d = 0; d < D; ++d) vf[j * D + d] = load<KT>(a.v_cache, base + j * key_stride + d);
        }
        for (int t = 0; t < ntok; ++t) {
            int vlo, vhi;
            ik.visible(a, t, b, BS, vlo, vhi);
            if (vhi <= vlo) continue;
            for (int g = 0; g < G; ++g) {
                const int r = t * G + g;
                const float* sr = sc + static_cast<int64_t>(r) * span + col;
                const float m = mx[r * BW];
                float* lr = ls + r * BW;
                float p[BSC ? BSC : kMaxBlock];
                for (int j = 0; j < BS; ++j) {
                    const float e = exp_nonpos(sr[j] - m);
                    p[j] = (j >= vlo && j < vhi) ? e : 0.0f;
                    lr[j] += p[j];
                }
                // Output += weights x values, key by key in order, 64 columns at a time in four registers.
                float* ar = acc + r * D;
                int d0 = 0;
                for (; d0 + 64 <= D; d0 += 64) {
                    float o0[16], o1[16], o2[16], o3[16];
                    for (int i = 0; i < 16; ++i) {
                        o0[i] = ar[d0 + i];
                        o1[i] = ar[d0 + 16 + i];
                        o2[i] = ar[d0 + 32 + i];
                        o3[i] = ar[d0 + 48 + i];
                    }
                    for (int j = vlo; j < vhi; ++j) {
                        const float pj = p[j];
                        const float* vj = vf + j * D + d0;
                        for (int i = 0; i < 16; ++i) {
                            o0[i] = std::fma(pj, vj[i], o0[i]);
                            o1[i] = std::fma(pj, vj[16 + i], o1[i]);
                            o2[i] = std::fma(pj, vj[32 + i], o2[i]);
                            o3[i] = std::fma(pj, vj[48 + i], o3[i]);
                        }
                    }
                    for (int i = 0; i < 16; ++i) {
                        ar[d0 + i] = o0[i];
                        ar[d0 + 16 + i] = o1[i];
                        ar[d0 + 32 + i] = o2[i];
                        ar[d0 + 48 + i] = o3[i];
                    }
                }
                for (int d = d0; d < D; ++d) {  // head_dim not a multiple of 64: the rest, the same arithmetic
                    float o = ar[d];
                    for (int j = vlo; j < vhi; ++j) o = std::fma(p[j], vf[j * D + d], o);
                    ar[d] = o;
                }
            }
        }
    }
    for (int t = 0; t < ntok; ++t) {
        for (int g = 0; g < G; ++g) {
            const int r = t * G + g;
            const int64_t oo = (static_cast<int64_t>(tok0 + t) * a.heads + kvh * G + g) * D;
            float* lanes = ls + r * BW;  // the sum of weights: a fixed halving tree over the key lanes
            for (int w = BW / 2; w >= 1; w /= 2)
                for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
            const float lr = lanes[0] > 0.0f ? lanes[0] : 1.0f;  // a row that sees no key (not causal): 0
            for (int d = 0; d < D; ++d) store<DT>(a.out, oo + d, acc[r * D + d] / lr);
        }
    }
}

#if BRINE_BF16_SCORES
// ---- The AVX512-BF16 implementation: bfloat16, 16-key blocks, head_dim DC a multiple of 32 ----

// exp_nonpos for 16 lanes: the same operations in the same order (max, multiply, add, subtract, the same
// fmas, the same exponent bits), so every lane has the scalar function's bits.
inline __m512 exp_nonpos16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // vmaxps: x > -87 ? x : -87, as the scalar (NaN too)
    const __m512 magic = _mm512_set1_ps(12582912.0f);
    const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), magic), magic);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693359375f), x);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
    const __m512 p = exp_poly16(r);
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

inline __mmask16 lanes_between(int lo, int hi) {  // lanes [lo, hi) of 16
    return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// A row's weights for one block: exp(s - max) on lanes [vlo, vhi), exactly 0 elsewhere, rounded to bfloat16
// and added as rounded to the row's lane sums; `pairs` gets the 8 (key 2i, key 2i + 1) weight pairs.
// vcvtneps2bf16 rounds to nearest even as f32_to_bf16 does; the two differ only on NaN and subnormal inputs,
// and exp_nonpos never returns either (its input is clamped to -87, NaN included, so it is >= 1.6e-38).
inline void bf16_weights(const float* sr, float m, int vlo, int vhi, float* lr, uint32_t* pairs) {
    const __m512 e = exp_nonpos16(_mm512_sub_ps(_mm512_loadu_ps(sr), _mm512_set1_ps(m)));
    const __m256bh wb = _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(lanes_between(vlo, vhi), e));
    const __m512 wr = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)wb), 16));
    _mm512_storeu_ps(lr, _mm512_add_ps(_mm512_loadu_ps(lr), wr));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs), (__m256i)wb);
}

// NR rows' scores against NB blocks of 16 keys: per row and key, vdpbf16ps over the dimension pairs in
// order, times the scale. Every (row, block) is its own chain, so how many run together changes no bits;
// NR x NB chains hide the instruction's latency, and each query broadcast serves NB blocks.
template <int NR, int NB, int DC>
inline void bf16_score_rows(const uint32_t* qp, const uint32_t* kpairs, float* out, int64_t span, __m512 vscale) {
    __m512 acc[NR][NB];
    for (int i = 0; i < NR; ++i)
        for (int k = 0; k < NB; ++k) acc[i][k] = _mm512_setzero_ps();
    for (int pr = 0; pr < DC / 2; ++pr) {
        __m512bh kv[NB];
        for (int k = 0; k < NB; ++k) kv[k] = (__m512bh)_mm512_loadu_si512(kpairs + (k * DC / 2 + pr) * 16);
        for (int i = 0; i < NR; ++i) {
            const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[i * DC / 2 + pr]));
            for (int k = 0; k < NB; ++k) acc[i][k] = _mm512_dpbf16_ps(acc[i][k], kv[k], q);
        }
    }
    for (int i = 0; i < NR; ++i)
        for (int k = 0; k < NB; ++k) _mm512_storeu_ps(out + i * span + 16 * k, _mm512_mul_ps(acc[i][k], vscale));
}

// NR rows' outputs, columns of NC chunks of 32 dimensions, += their weights x one block's values, key pair
// by key pair in order. rows[i]: row i's accumulator at the first chunk; w[i]: its weight pairs; vpairs:
// [8 key pairs][NC chunks][2] (v[2i][d], v[2i + 1][d]) dwords. Each row is its own chains.
template <int NR, int NC>
inline void bf16_value_rows(float* const* rows, const uint32_t (*w)[8], const __m512i* vpairs) {
    __m512 o[NR][2 * NC];
    for (int k = 0; k < NR; ++k)
        for (int i = 0; i < 2 * NC; ++i) o[k][i] = _mm512_loadu_ps(rows[k] + 16 * i);
    for (int jp = 0; jp < 8; ++jp) {
        for (int k = 0; k < NR; ++k) {
            const __m512bh wk = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w[k][jp]));
            for (int i = 0; i < 2 * NC; ++i) o[k][i] = _mm512_dpbf16_ps(o[k][i], (__m512bh)vpairs[jp * 2 * NC + i], wk);
        }
    }
    for (int k = 0; k < NR; ++k)
        for (int i = 0; i < 2 * NC; ++i) _mm512_storeu_ps(rows[k] + 16 * i, o[k][i]);
}

// One (item, KV head) of the bfloat16 implementation: its rows and keys, and its working memory.
template <int DC>
struct Bf16Work {
    ItemKeys ik;
    int kvh = 0, G = 0, R = 0, RP = 0, span = 0;
    std::vector<uint32_t> qpairs;  // [RP][DC / 2] query dimension pairs (pad rows 0)
    std::vector<float> sc;         // [RP][span] every score of the item
    // The whole unit's row state, made by scores() (mx) and values() (ls, acc); run_bf16_shared keeps its own.
    std::vector<float> acc;        // [RP][DC] weighted sums of values; a chunk's 32 columns in unpack order
    std::vector<float> mx;         // [R][16] max per key lane, then each row's max in lane 0
    std::vector<float> ls;         // [R][16] sums of weights per key lane
    std::vector<uint32_t> wt;      // AMX: [RP][8] one block's weight pairs, every row (0 where it sees none)

    // Takes (item, KV head) on, or tokens [t0, t0 + nt) of the item (nt > 0), reusing the vectors' memory from
    // the last one.
    void reset(const Args& a, int64_t item, int kvh_, int t0 = 0, int nt = 0) {
        ik = ItemKeys(a, item, 16);
        if (nt > 0) ik = ik.narrowed(a, t0, nt, 16);
        kvh = kvh_, G = a.heads / a.kv_heads, R = ik.ntok * G;
        const int rows_at_once = kAmx ? 16 : kRowBlock;  // AMX: whole tiles of rows
        RP = (R + rows_at_once - 1) / rows_at_once * rows_at_once, span = (ik.b_hi - ik.b_lo) * 16;
        qpairs.assign(static_cast<size_t>(RP) * DC / 2, 0u);
        for (int t = 0; t < ik.ntok; ++t)
            for (int g = 0; g < G; ++g) {
                const int64_t qo = (ik.tok0 + t) * a.q_stride_t + (kvh * G + g) * a.q_stride_h;
                std::memcpy(qpairs.data() + static_cast<size_t>(t * G + g) * DC / 2,
                            static_cast<const uint16_t*>(a.q) + qo, DC * 2);
            }
        sc.resize(static_cast<size_t>(RP) * span);
    }

    int64_t base(const Args& a, int b) const { return (static_cast<int64_t>(ik.table[b]) * 16 * a.kv_heads + kvh) * DC; }

#if defined(BRINE_SIMD_AMX)
    // On AMX (amx.h), every call alike. Tiles: 0, 1, 2 the scores' C (16 rows x 16 keys), A (16 rows x 16 query
    // pairs), B (16 pairs x 16 keys); 3, 4, 5 the values' C (16 rows x 16 of the output's dimensions), A (16 rows
    // x 8 weight pairs), B (8 key pairs x 16 dimensions); 6, 7 (and 0, 3) the values' four Cs kept in tiles for
    // a whole walk (tile_values_kept).
    static brine::amx::Config tile_shapes() {
        brine::amx::Config c;
        c.shape(0, 16, 64), c.shape(1, 16, 64), c.shape(2, 16, 64);
        c.shape(3, 16, 64), c.shape(4, 16, 32), c.shape(5, 8, 64);
        c.shape(6, 16, 64), c.shape(7, 16, 64);
        return c;
    }

    // Whether the values' sums stay in tiles for the whole walk (tile_values_kept): one tile of rows (a decode, a
    // verify chunk: RP = 16) and 64 dimensions (four Cs of 16).
    bool keeps_tiles() const { return DC == 64 && RP == 16; }

    // tile_values for one tile of rows, with the four Cs in tiles 0, 3, 6, 7 from the first block to the last
    // (zeroed before it, stored after it: kept_sums_out) instead of loaded and stored around every block: the
    // same products added to the same sums in the same order, so the same bits, without 8 tile loads and stores
    // (each waiting on the product before it) per block.
    void tile_values_kept(const Args& a, int b, const __m512i* vpairs) {
        constexpr int NC = DC / 32;
        wt.assign(static_cast<size_t>(RP) * 8, 0u);
        block_weights(a, b, mx.data(), ls.data(), [&](int r) { return wt.data() + r * 8; });
        _tile_loadd(4, wt.data(), 32);
        _tile_loadd(5, vpairs + 0, 2 * NC * 64);
        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(5, vpairs + 1, 2 * NC * 64);
        _tile_dpbf16ps(3, 4, 5);
        _tile_loadd(5, vpairs + 2, 2 * NC * 64);
        _tile_dpbf16ps(6, 4, 5);
        _tile_loadd(5, vpairs + 3, 2 * NC * 64);
        _tile_dpbf16ps(7, 4, 5);
    }

    void kept_sums_in() {  // acc is all zeros (values)
        _tile_zero(0);
        _tile_zero(3);
        _tile_zero(6);
        _tile_zero(7);
    }

    void kept_sums_out() {
        _tile_stored(0, acc.data() + 0, DC * 4);
        _tile_stored(3, acc.data() + 16, DC * 4);
        _tile_stored(6, acc.data() + 32, DC * 4);
        _tile_stored(7, acc.data() + 48, DC * 4);
    }

    // The scores of nb blocks (their keys' pairs in kpairs, as transposed for bf16_score_rows) for all RP rows:
    // per 16 rows and block, C = the dot products over the dimensions in chunks of 32, in order; times the
    // scale into out (sc at the first block's column).
    void tile_scores(const Args& a, const uint32_t* kpairs, int nb, float* out) const {
        const __m512 vscale = _mm512_set1_ps(a.scale);
        if (DC == 64 && nb == 2) {  // the two blocks' products interleaved (tile_scores_pair), rows 16 at a time
            for (int r0 = 0; r0 < RP; r0 += 16) {
                float* o = out + int64_t{r0} * span;
                tile_scores_pair(kpairs, r0, o);
                for (int k = 0; k < 2; ++k)
                    for (int r = 0; r < 16 && r0 + r < R; ++r)
                        _mm512_storeu_ps(o + r * span + 16 * k,
                                         _mm512_mul_ps(_mm512_loadu_ps(o + r * span + 16 * k), vscale));
            }
            return;
        }
        for (int r0 = 0; r0 < RP; r0 += 16)
            for (int k = 0; k < nb; ++k) {
                float* o = out + int64_t{r0} * span + 16 * k;
                _tile_zero(0);
                for (int c = 0; c < DC / 32; ++c) {
                    _tile_loadd(1, qpairs.data() + (r0 * DC / 2 + 16 * c), DC * 2);
                    _tile_loadd(2, kpairs + (k * DC / 2 + 16 * c) * 16, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, o, span * 4);
                for (int r = 0; r < 16 && r0 + r < R; ++r)
                    _mm512_storeu_ps(o + r * span, _mm512_mul_ps(_mm512_loadu_ps(o + r * span), vscale));
            }
    }

    // Two blocks' scores for rows r0 .. r0 + 15 (64 dimensions: two chunks of 32), into o (unscaled): each block's C
    // is zeroed, then gets chunk 0's products, then chunk 1's, as in tile_scores' loop (the same bits), but block
    // 0's C in tile 0 and block 1's in tile 3 with the query chunks loaded once (tiles 1, 6) and the keys'
    // alternating between tiles 2 and 7, so that one block's product runs while the other's waits on its own.
    void tile_scores_pair(const uint32_t* kpairs, int r0, float* o) const {
        const uint32_t* q = qpairs.data() + r0 * DC / 2;
        _tile_zero(0);
        _tile_zero(3);
        _tile_loadd(1, q, DC * 2);
        _tile_loadd(6, q + 16, DC * 2);
        _tile_loadd(2, kpairs + (0 * DC / 2 + 0) * 16, 64);
        _tile_dpbf16ps(0, 1, 2);
        _tile_loadd(7, kpairs + (1 * DC / 2 + 0) * 16, 64);
        _tile_dpbf16ps(3, 1, 7);
        _tile_loadd(2, kpairs + (0 * DC / 2 + 16) * 16, 64);
        _tile_dpbf16ps(0, 6, 2);
        _tile_loadd(7, kpairs + (1 * DC / 2 + 16) * 16, 64);
        _tile_dpbf16ps(3, 6, 7);
        _tile_stored(0, o, span * 4);
        _tile_stored(3, o + 16, span * 4);
    }

    // Block b's weights x values for all RP rows: each row's weight pairs as values() makes them (a row that
    // sees none of the block's keys gets zeros, which add +0 to its sums: the bits of skipping it), then per
    // 16 rows and 16 output dimensions, C = the row's sums += the pairs' products in order.
    void tile_values(const Args& a, int b, const __m512i* vpairs) {
        constexpr int NC = DC / 32;
        wt.assign(static_cast<size_t>(RP) * 8, 0u);
        block_weights(a, b, mx.data(), ls.data(), [&](int r) { return wt.data() + r * 8; });
        for (int r0 = 0; r0 < RP; r0 += 16) {
            _tile_loadd(4, wt.data() + r0 * 8, 32);
            for (int i = 0; i < 2 * NC; ++i) {
                float* o = acc.data() + int64_t{r0} * DC + 16 * i;
                _tile_loadd(3, o, DC * 4);
                _tile_loadd(5, vpairs + i, 2 * NC * 64);
                _tile_dpbf16ps(3, 4, 5);
                _tile_stored(3, o, DC * 4);
            }
        }
    }
#endif

    // Block b's weights for every row that sees any of its keys, in row order (bf16_weights: into the row's lane
    // sums ls, from its max in mx[r * 16], and its weight pairs where dest(r) says).
    template <typename Dest>
    void block_weights(const Args& a, int b, const float* mxs, float* lss, Dest&& dest) const {
        for (int t = 0; t < ik.ntok; ++t) {
            int vlo, vhi;
            ik.visible(a, t, b, 16, vlo, vhi);
            if (vhi <= vlo) continue;
            for (int g = 0; g < G; ++g) {
                const int r = t * G + g;
                bf16_weights(sc.data() + int64_t{r} * span + (b - ik.b_lo) * 16, mxs[r * 16], vlo, vhi,
                             lss + r * 16, dest(r));
            }
        }
    }

    // Pass 1: scores, two blocks at a time, then each row's max per lane, then per row.
    void scores(const Args& a) {
        mx.assign(static_cast<size_t>(R) * 16, -INFINITY);
        scores_of(a, ik.b_lo, ik.b_hi, mx.data());
        row_max(mx.data());
    }

    // Each lane's max (in lane 0: the row's) by a halving tree over the lanes (max is exact in any order).
    void row_max(float* mxs) const {
        for (int r = 0; r < R; ++r) {
            float* mr = mxs + r * 16;
            for (int w = 8; w >= 1; w /= 2)
                for (int j = 0; j < w; ++j) mr[j] = mr[j] > mr[j + w] ? mr[j] : mr[j + w];
        }
    }

    // The scores of blocks [bA, bB) into sc, and their max per row and key lane into mxs ([R][16], which holds
    // the max so far).
    void scores_of(const Args& a, int bA, int bB, float* mxs) {
        const uint16_t* kc = static_cast<const uint16_t*>(a.k_cache);
        const int64_t key_stride = static_cast<int64_t>(a.kv_heads) * DC;
        const __m512 vscale = _mm512_set1_ps(a.scale);
        alignas(64) uint32_t kpairs[2 * DC / 2 * 16];  // [block][pr][key]: key's dimension pair pr
        for (int b = bA; b < std::min(bB, bA + kPrefetchBlocks); ++b) {  // see kPrefetchBlocks
            const uint16_t* p = kc + base(a, b);
            for (int j = 0; j < 16; ++j)
                for (int c = 0; c < DC / 32; ++c)
                    _mm_prefetch(reinterpret_cast<const char*>(p + j * key_stride + 32 * c), _MM_HINT_T1);
        }
        for (int b = bA; b < bB; b += 2) {
            const int nb = std::min(2, bB - b);
            for (int k = 0; k < nb; ++k)  // the window moves on with the walk
                if (b + k + kPrefetchBlocks < bB) {
                    const uint16_t* p = kc + base(a, b + k + kPrefetchBlocks);
                    for (int j = 0; j < 16; ++j)
                        for (int c = 0; c < DC / 32; ++c)
                            _mm_prefetch(reinterpret_cast<const char*>(p + j * key_stride + 32 * c), _MM_HINT_T1);
                }
            for (int k = 0; k < nb; ++k) {  // 16 x 16 dword transposes of each block's keys
                const int64_t kb = base(a, b + k);
                for (int c = 0; c < DC / 32; ++c) {
                    __m512i rows[16];
                    for (int j = 0; j < 16; ++j) rows[j] = _mm512_loadu_si512(kc + kb + j * key_stride + 32 * c);
                    transpose16x16(rows);
                    for (int i = 0; i < 16; ++i) _mm512_store_si512(kpairs + (k * DC / 2 + 16 * c + i) * 16, rows[i]);
                }
            }
            float* out = sc.data() + (b - ik.b_lo) * 16;
            const uint32_t* qp = qpairs.data();
            int r0 = 0;
#if defined(BRINE_SIMD_AMX)
            if (kAmx) {
                tile_scores(a, kpairs, nb, out);
                continue;
            }
#endif
            if (nb == 2) {
                for (; r0 + 8 <= RP; r0 += 8)
                    bf16_score_rows<8, 2, DC>(qp + r0 * DC / 2, kpairs, out + int64_t{r0} * span, span, vscale);
                for (; r0 < RP; r0 += kRowBlock)
                    bf16_score_rows<kRowBlock, 2, DC>(qp + r0 * DC / 2, kpairs, out + int64_t{r0} * span, span, vscale);
            } else {
                for (; r0 + 8 <= RP; r0 += 8)
                    bf16_score_rows<8, 1, DC>(qp + r0 * DC / 2, kpairs, out + int64_t{r0} * span, span, vscale);
                for (; r0 < RP; r0 += kRowBlock)
                    bf16_score_rows<kRowBlock, 1, DC>(qp + r0 * DC / 2, kpairs, out + int64_t{r0} * span, span, vscale);
            }
        }
        for (int b = bA; b < bB; ++b)
            for (int t = 0; t < ik.ntok; ++t) {
                int vlo, vhi;
                ik.visible(a, t, b, 16, vlo, vhi);
                if (vhi <= vlo) continue;
                const __mmask16 vis = lanes_between(vlo, vhi);
                for (int g = 0; g < G; ++g) {  // vmaxps: x > m ? x : m, as the generic loop
                    const int r = t * G + g;
                    const __m512 x = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), vis,
                                                          sc.data() + int64_t{r} * span + (b - ik.b_lo) * 16);
                    float* mr = mxs + r * 16;
                    _mm512_storeu_ps(mr, _mm512_max_ps(x, _mm512_loadu_ps(mr)));
                }
            }
    }

    // Pass 2: weights (into the lane sums) and weights x values, rows four at a time; then the outputs.
    void values(const Args& a) {
        ls.assign(static_cast<size_t>(R) * 16, 0.0f);
        acc.assign(static_cast<size_t>(RP) * DC, 0.0f);
        values_of<DC / 32>(a, 0, mx.data(), ls.data(), acc.data());
    }

    // Pass 2 for the output dimensions of chunks [c0, c0 + NCS) of 32 (all of them: NCS = DC / 32), from each
    // row's max in mxs[r * 16], with the lane sums in lss ([R][16], zeros) and the value sums in accs ([RP][DC],
    // zeros in those chunks). Every chunk's sums are the same whichever chunks are taken together, and every
    // caller computes the same weights and lane sums: run_bf16_shared gives a unit's chunks to different threads.
    template <int NCS>
    void values_of(const Args& a, int c0, const float* mxs, float* lss, float* accs) {
        constexpr int NC = NCS;  // chunks of 32 output dimensions taken here
        const uint16_t* vc = static_cast<const uint16_t*>(a.v_cache) + 32 * c0;
        const int64_t key_stride = static_cast<int64_t>(a.kv_heads) * DC;
        alignas(64) __m512i vpairs[8 * 2 * NC];
        for (int b = ik.b_lo; b < std::min(ik.b_hi, ik.b_lo + kPrefetchBlocks); ++b) {  // see kPrefetchBlocks
            const uint16_t* p = vc + base(a, b);
            for (int j = 0; j < 16; ++j)
                for (int c = 0; c < NC; ++c)
                    _mm_prefetch(reinterpret_cast<const char*>(p + j * key_stride + 32 * c), _MM_HINT_T1);
        }
        for (int b = ik.b_lo; b < ik.b_hi; ++b) {
            const int64_t vb = base(a, b);
            if (b + kPrefetchBlocks < ik.b_hi) {  // the window moves on with the walk
                const uint16_t* p = vc + base(a, b + kPrefetchBlocks);
                for (int j = 0; j < 16; ++j)
                    for (int c = 0; c < NC; ++c)
                        _mm_prefetch(reinterpret_cast<const char*>(p + j * key_stride + 32 * c), _MM_HINT_T1);
            }
            for (int jp = 0; jp < 8; ++jp)
                for (int c = 0; c < NC; ++c) {
                    const uint16_t* v = vc + vb + (2 * jp) * key_stride + 32 * c;
                    const __m512i v0 = _mm512_loadu_si512(v), v1 = _mm512_loadu_si512(v + key_stride);
                    // lane i of lo: d = 32(c0 + c) + 8(i / 4) + i % 4; of hi: the same + 4
                    vpairs[jp * 2 * NC + 2 * c] = _mm512_unpacklo_epi16(v0, v1);
                    vpairs[jp * 2 * NC + 2 * c + 1] = _mm512_unpackhi_epi16(v0, v1);
                }
#if defined(BRINE_SIMD_AMX)
            if constexpr (NCS == DC / 32)
                if (kAmx && keeps_tiles()) {
                    if (b == ik.b_lo) kept_sums_in();
                    tile_values_kept(a, b, vpairs);
                    if (b + 1 == ik.b_hi) kept_sums_out();
                    continue;
                }
            if constexpr (NCS == DC / 32)
                if (kAmx) {
                    tile_values(a, b, vpairs);
                    continue;
                }
#endif
            float* group[4];
            alignas(32) uint32_t w[4][8];
            int n = 0;
            auto flush = [&]() {
                switch (n) {
                    case 1: bf16_value_rows<1, NC>(group, w, vpairs); break;
                    case 2: bf16_value_rows<2, NC>(group, w, vpairs); break;
                    case 3: bf16_value_rows<3, NC>(group, w, vpairs); break;
                    case 4: bf16_value_rows<4, NC>(group, w, vpairs); break;
                    default: break;
                }
                n = 0;
            };
            block_weights(a, b, mxs, lss, [&](int r) {  // a full group's products first, then its weights' slot again
                if (n == 4) flush();
                group[n] = accs + r * DC + 32 * c0;
                return w[n++];
            });
            flush();
        }
        for (int t = 0; t < ik.ntok; ++t)
            for (int g = 0; g < G; ++g) {
                const int r = t * G + g;
                const int64_t oo = (static_cast<int64_t>(ik.tok0 + t) * a.heads + kvh * G + g) * DC;
                float* lanes = lss + r * 16;  // the sum of weights: a fixed halving tree over the key lanes
                for (int wd = 8; wd >= 1; wd /= 2)
                    for (int j = 0; j < wd; ++j) lanes[j] += lanes[j + wd];
                const float lr = lanes[0] > 0.0f ? lanes[0] : 1.0f;  // a row that sees no key (not causal): 0
                for (int d = 32 * c0; d < 32 * (c0 + NCS); ++d) {
                    const int c = d / 32, l = (d % 32) / 8, k = d % 8;  // where dimension d accumulated
                    store<kDtypeBF16>(a.out, oo + d, accs[r * DC + 32 * c + 16 * (k >= 4) + 4 * l + k % 4] / lr);
                }
            }
    }
};

// Every (item, KV head) on its own, spread over the threads. On AMX at head_dim 64, an item of more rows than
// one tile of 16 (tokens x the GQA group: a verify chunk of 5 or more drafts at the default model's group of 3)
// goes as parts of at most 16 rows, tokens [t0, t0 + nt) each: a part's values stay in tiles for its whole walk
// (Bf16Work::keeps_tiles), where 32 rows loaded and stored their sums around every block, and the parts spread
// over the threads (3 KV heads' items on 2 threads left one idle for a third of the step). Each part walks the
// context again, but on tiles the walk is not what 32 rows cost. A row's arithmetic is its own wherever its
// item is cut (as the planner's cuts already are: engine/model/attention/native.py), so the bits are the same.
// Only where the parts spread over the threads better than the whole items do (one sequence's verify chunk: its
// 3 units on 2 threads, 6 parts on 2), and an item goes in at most kMostParts parts: where the whole items
// already spread evenly, a part's kept tiles about pay for its extra walk and no more (16 new tokens as two
// items of 8, on 2 threads: 0.97x cut), and a prefill's 16-token items cut in 4 walked each context 4 times
// (prefills of 512 and 2,048 tokens 1.2-1.3x slower; attention_bench --baseline). Cut: verify chunks of 9
// tokens 1.14x faster, a 13-token question over a cached document 1.09x.
constexpr int kMostParts = 3;

// Whether run_bf16_shared takes a step's units (items x KV heads): where whole units would leave threads idle for
// a quarter of the units' time or more (one sequence's 3 KV heads on 2 threads: 2 walks on one thread, 1 on the
// other; on 16 threads, 13 idle), every item walks at least kShareMinKeys keys (a short walk is not worth the
// barrier and the second walk of a shared unit's weights: over 600 keys a lone decode and a verify chunk of 5
// measured 0.8x-1.03x shared, over 1,000 1.05x-1.07x) and has at most kShareMostRows rows (a verify chunk of
// 9 tokens, 27 rows, measured 0.91x-1.18x over 2,000 keys, where its sc rows written by one thread and read by
// the other cost more), and the tiles are not in use (AMX cuts its own parts, above). The float32 paths'
// counterpart is run_split_units.
constexpr int kShareMinKeys = 1024, kShareMostRows = 16;
inline bool shares_units(const Args& a, int threads) {
    const int64_t units = a.num_items * a.kv_heads, rounds = (units + threads - 1) / threads;
    if (kAmx || threads < 2 || (rounds * threads - units) * 4 < units) return false;
    for (int64_t i = 0; i < a.num_items; ++i) {
        const ItemKeys ik(a, i, 16);
        if ((ik.b_hi - ik.b_lo) * 16 < kShareMinKeys || ik.ntok * (a.heads / a.kv_heads) > kShareMostRows)
            return false;
    }
    return true;
}

// Every unit walked by all the threads together, in two phases with a barrier between them. Phase 1: the units'
// blocks (pairs of them, in order) shared out evenly, each thread taking the scores of its blocks and their max
// per row and key lane in a max of its own. Phase 2: the units' chunks of 32 output dimensions shared out
// evenly; a thread merges the threads' maxes for each unit it has chunks of (max is exact in any order), and
// walks the unit's blocks once for its chunks: every block's weights and lane sums (so a unit whose chunks two
// threads share has its weights made twice), and the values of its chunks only. A row's scores, max, weights, lane
// sums and each dimension's value sums are the same numbers in the same order as one thread walking the unit
// alone (Bf16Work::scores_of, values_of), so the same bits. Why: a decode or a verify chunk of one sequence has
// as many units as KV heads, and each unit's walk over its context is what the step's attention waits on.
template <int DC>
void run_bf16_shared(const Args& a, int threads) {
    constexpr int NC = DC / 32;
    const int64_t units = a.num_items * a.kv_heads;
    // Kept across calls, as the vectors' memory is. They are the caller's (thread_local): the team reaches them
    // through the pointers below, taken before the parallel region.
    static thread_local std::vector<Bf16Work<DC>> kept;
    static thread_local std::vector<int64_t> kept_offsets;  // pairs of blocks before unit u; its maxes' offset
    static thread_local std::vector<float> kept_maxes;      // [team][units][R][16]: each thread's max per lane
    if (static_cast<int64_t>(kept.size()) < units) kept.resize(static_cast<size_t>(units));
    kept_offsets.assign(static_cast<size_t>(2 * units + 1), 0);
    Bf16Work<DC>* const work = kept.data();
    int64_t* const pairs_before = kept_offsets.data();  // [units + 1]
    int64_t* const at = pairs_before + units + 1;        // [units]
    int64_t rows16 = 0;
    for (int64_t u = 0; u < units; ++u) {
        work[u].reset(a, u / a.kv_heads, static_cast<int>(u % a.kv_heads));
        pairs_before[u + 1] = pairs_before[u] + (work[u].ik.b_hi - work[u].ik.b_lo + 1) / 2;
        at[u] = rows16, rows16 += int64_t{work[u].R} * 16;
    }
    kept_maxes.assign(static_cast<size_t>(threads * rows16), -INFINITY);
    float* const maxes = kept_maxes.data();
#pragma omp parallel num_threads(threads)
    {
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t p0 = pairs_before[units] * me / team, p1 = pairs_before[units] * (me + 1) / team;
        for (int64_t u = 0; u < units; ++u) {
            const int64_t lo = std::max(p0, pairs_before[u]), hi = std::min(p1, pairs_before[u + 1]);
            if (lo >= hi) continue;
            Bf16Work<DC>& w = work[u];
            const int b_lo = w.ik.b_lo + 2 * static_cast<int>(lo - pairs_before[u]);
            const int b_hi = std::min(w.ik.b_hi, w.ik.b_lo + 2 * static_cast<int>(hi - pairs_before[u]));
            w.scores_of(a, b_lo, b_hi, maxes + me * rows16 + at[u]);
        }
#pragma omp barrier
        static thread_local std::vector<float> mx, ls, acc;  // this thread's own, for each unit it has chunks of
        const int64_t c0 = units * NC * me / team, c1 = units * NC * (me + 1) / team;
        for (int64_t u = c0 / NC; u < units && u * NC < c1; ++u) {
            Bf16Work<DC>& w = work[u];
            const int64_t n16 = int64_t{w.R} * 16;
            const int first = static_cast<int>(std::max(c0, u * NC) - u * NC);
            const int count = static_cast<int>(std::min(c1, (u + 1) * NC) - u * NC) - first;
            mx.assign(maxes + at[u], maxes + at[u] + n16);
            for (int64_t t = 1; t < team; ++t) {
                const float* other = maxes + t * rows16 + at[u];
                for (int64_t i = 0; i < n16; ++i) mx[i] = other[i] > mx[i] ? other[i] : mx[i];  // as vmaxps
            }
            w.row_max(mx.data());
            ls.assign(static_cast<size_t>(n16), 0.0f);
            acc.assign(static_cast<size_t>(w.RP) * DC, 0.0f);
            with_count<NC>(count, [&](auto n) {
                w.template values_of<decltype(n)::value>(a, first, mx.data(), ls.data(), acc.data());
            });
        }
    }
}

template <int DC>
void run_bf16_items(const Args& a, int threads) {
    if (shares_units(a, threads)) return run_bf16_shared<DC>(a, threads);
    struct Part {
        int64_t item;
        int t0, nt;
    };
    std::vector<Part> parts;  // empty: every item whole
    const int group = a.heads / a.kv_heads;
    if (kAmx && DC == 64 && group <= 16) {
        const int most = 16 / group;  // tokens per part: a tile of rows
        const auto count = [&](int64_t i) {
            const int n = (a.items[i * 5 + 1] + most - 1) / most;
            return n > kMostParts ? 1 : n;
        };
        int64_t total = 0, widest = 1;
        for (int64_t i = 0; i < a.num_items; ++i) {
            const int64_t n = count(i);
            total += n, widest = std::max(widest, n);
        }
        const auto rounds = [&](int64_t units) { return (units * a.kv_heads + threads - 1) / threads; };
        if (widest > 1 && rounds(total) < widest * rounds(a.num_items))
            for (int64_t i = 0; i < a.num_items; ++i) {
                const int ntok = a.items[i * 5 + 1], n = count(i);
                for (int p = 0, t0 = 0; p < n; ++p) {  // near-equal parts: 9 tokens as 5 + 4
                    const int nt = n == 1 ? 0 : ntok / n + (p < ntok % n ? 1 : 0);
                    parts.push_back({i, t0, nt});
                    t0 += nt;
                }
            }
    }
    const int64_t work = (parts.empty() ? a.num_items : static_cast<int64_t>(parts.size())) * a.kv_heads;
#pragma omp parallel num_threads(threads)
    {
#if defined(BRINE_SIMD_AMX)
        const auto shapes = Bf16Work<DC>::tile_shapes();
        const brine::amx::Scope tiles_on(kAmx ? &shapes : nullptr);
#endif
        Bf16Work<DC> w;
#pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < work; ++u) {
            const Part p = parts.empty() ? Part{u / a.kv_heads, 0, 0} : parts[u / a.kv_heads];
            w.reset(a, p.item, static_cast<int>(u % a.kv_heads), p.t0, p.nt);
            w.scores(a);
            w.values(a);
        }
    }
}

#endif

// ---- float32 with 16 rows in the lanes: 16-key blocks, head_dim a multiple of 16, items of kLaneRowsMin rows or more ----
//
// The generic path's arithmetic, element for element, with the vectors laid across rows instead of keys: lane l
// of a group is row r0 + l of the item. A score is still q . k over d in order from 0 (fma by fma), a weight
// exp_nonpos(score - max) (the same operations, simd.h's lanes), a row's weight sums per key lane (position mod
// 16) in block order and then the same halving tree, and its output fma(weight, value, o) key by key in position
// order with hidden keys left out (blended away, never added), divided by the sum at the end. Only the max is
// taken in another order (key by key instead of per key lane, then a tree), and a max is exact in any order (a
// NaN never wins either way; +0 or -0 as the max gives every score - max the same bits, and exp the same result).
// Why: in the generic loops the compiler keeps one row's 16 keys in a vector, and transposes each block's keys
// element by element; here the rows share every key and value load (one broadcast per element), each block's
// keys are read as stored, and the chains are register-blocked to fill the CPU's vector registers (AVX2's 16
// ymm, AVX512's 32 zmm). AVX2 tier, one thread, the default model's shape: a 2,048-token prefill 168 -> 65 ms per
// layer (29 -> 75 GFLOP/s), a 16-token chunk over 2,000 cached 2.1 -> 0.8 ms; same bits.
constexpr int kLanes = 16;
// Items with fewer rows keep the generic path. AVX2: every item (attention_bench --dtype float32, one thread, against
// the generic path: a decode over 2,000 tokens in DRAM 1.19x faster, verify chunks of 3 and 5 tokens 1.5x and 1.8x).
// AVX512: a decode's GQA group (3 rows) measured 0.8x in DRAM there (its generic loops are wider), verify chunks 1.1x
// and 1.3x, so from 4 rows. The portable build: unmeasured, as before.
#if defined(BRINE_SIMD_AVX2)
constexpr int kLaneRowsMin = 1;
#elif defined(BRINE_SIMD_AVX512)
constexpr int kLaneRowsMin = 4;
#else
constexpr int kLaneRowsMin = 16;
#endif
#if defined(BRINE_SIMD_AVX512)
constexpr int kChunk = 16;  // keys of a block per score chunk, dims per value chunk: accumulators in registers
#elif defined(BRINE_SIMD_AVX2)
constexpr int kChunk = 6;  // two ymm per VF: 12 accumulators, the operand and a broadcast
#else
constexpr int kChunk = 4;
#endif

inline simd::VF exp_nonpos_lanes(simd::VF x) {  // exp_nonpos, lane by lane: the same operations in the same order
    using namespace simd;
    x = vmax(x, vset1(-87.0f));
    const VF magic = vset1(12582912.0f);
    const VF n = vsub(vadd(vmul(x, vset1(1.44269504088896341f)), magic), magic);
    VF r = vfmadd(n, vset1(-0.693359375f), x);
    r = vfmadd(n, vset1(2.12194440e-4f), r);
    VF p = vset1(kExpPoly[0]);
    for (int i = 1; i < 6; ++i) p = vfmadd(p, r, vset1(kExpPoly[i]));
    const VF y = vadd(vfmadd(vmul(p, r), r, r), vset1(1.0f));
    return vmul(y, vpow2i(n));
}

// Groups of 16 rows that attend_lanes takes at once, at most (kLaneGroups), and how many of them share registers
// (kRegGroups). AVX512's 32 zmm registers hold three groups' sums for 8 keys (scores) or 8 dims (values), 24
// accumulators: each key or value broadcast then feeds three fmas, not one, and a float16 block is widened once
// for 48 rows, not 16. AVX2's 16 ymm registers hold one group's 6 (two ymm each) beside the operands, where two
// groups could not share a broadcast with fewer loads per fma; its three groups still share one walk of the
// blocks, each run over a block's keys (copied or widened once for all three) and a run's values (widened once)
// in turn. One group per walk spent ~11% of a float16 cache's prefill attention widening it (perf annotate, the
// emulated AVX2 build); one walk for three (with kLaneValueBlocks below and the output's vector division):
// attention_bench --baseline --dtype float32, prefill 2,048 1.08x over a float16 cache, 1.03x over a float32 one.
#if defined(BRINE_SIMD_AVX512)
constexpr int kLaneGroups = 3, kRegGroups = 3;
#else
constexpr int kLaneGroups = 3, kRegGroups = 1;
#endif

// Scores of keys kb[0 .. N) (rows of D floats, one after the other: widen_rows) for NG groups' 16 rows each:
// s[g][j] lane l = sum over d in order of qT[g][d][l] k[j][d].
template <int N, int D, int NG>
inline void lane_scores(const float* const* qT, const float* kb, float* const* s) {
    using namespace simd;
    VF acc[NG * N];
    for (int g = 0; g < NG; ++g)
        for (int j = 0; j < N; ++j) acc[g * N + j] = vzero();
    for (int d = 0; d < D; ++d) {
        VF q[NG];
        for (int g = 0; g < NG; ++g) q[g] = vload(qT[g] + d * kLanes);
        for (int j = 0; j < N; ++j) {
            const VF k = vset1(kb[j * D + d]);
            for (int g = 0; g < NG; ++g) acc[g * N + j] = vfmadd(q[g], k, acc[g * N + j]);
        }
    }
    for (int g = 0; g < NG; ++g)
        for (int j = 0; j < N; ++j) vstore(s[g] + j * kLanes, acc[g * N + j]);
}

// Output dims d0 .. d0 + N of the groups' rows over blocks [b0, b1) of the item's [w_lo, b_hi): o[i] = fma(p[key],
// v[key][d0 + i], o[i]) key by key, keys a lane does not see left out, continuing from acc's sums unless b0 is the
// item's first block. The caller walks the blocks in runs of kLaneValueBlocks, each run for every chunk of dims, so
// that a run's values come from memory once (the first chunk's walk, which also asks for the blocks ahead) and
// from L1 for the other chunks: a walk of all blocks per chunk read a long context's values from memory or L3
// once per chunk. Per lane and dim the fmas stay key by key in position order.
constexpr int kValueBlocks = 8;  // 128 keys: 32 KB of float32 values at head_dim 64
// attend_lanes' runs. AVX2: 64 keys, 16 KB of values, beside each group's 4 KB of weights for them (three groups
// walk together, one after the other): 8 blocks and three groups' weights (56 KB) spilled L1 (48 KB on the AMX
// Xeon, 32 KB on most AVX2 CPUs); the emulated AVX2 build, attention_bench --dtype float32 --baseline, one thread:
// prefill 2,048 1.02x and 1.04x faster over a float32 and a float16 cache than with 8-block runs. AVX512's three
// groups share registers and each value load, and keep 8.
#if defined(BRINE_SIMD_AVX512)
constexpr int kLaneValueBlocks = 8;
#else
constexpr int kLaneValueBlocks = 4;
#endif
// Blocks ahead that the float32 walks ask for: as many bytes in flight as kPrefetchBlocks of bfloat16 at head_dim 64.
constexpr int kLanePrefetch = 8;

// KV head kvh's rows of block b of a float32 step's cache (E: CacheElem) with 16-key blocks (row j at j x
// kv_heads x D elements).
template <typename E>
inline const E* kv_block(const Args& a, const void* cache, const int32_t* table, int b, int kvh, int D) {
    return static_cast<const E*>(cache) + (static_cast<int64_t>(table[b]) * 16 * a.kv_heads + kvh) * D;
}
// Asks for those rows (bytes [o0, o1) of each, all of it unless told) in L2: they are scattered (kv_heads apart,
// blocks anywhere), where the hardware prefetcher would not guess them.
template <typename E>
inline void prefetch_kv_block(const Args& a, const void* cache, const int32_t* table, int b, int kvh, int D,
                              int64_t o0 = 0, int64_t o1 = -1) {
    const char* p = reinterpret_cast<const char*>(kv_block<E>(a, cache, table, b, kvh, D));
    constexpr int64_t kBytes = sizeof(E);
    const int64_t stride = static_cast<int64_t>(a.kv_heads) * D * kBytes;
    if (o1 < 0) o1 = D * kBytes;
    for (int j = 0; j < 16; ++j)
        for (int64_t o = o0; o < o1; o += 64) __builtin_prefetch(p + j * stride + o, 0, 2);
}

// One group of 16 rows in attend_lanes: which keys each lane sees, and where its buffers are.
struct LaneGroup {
    simd::VF vlo, vhi;     // each lane's keys [lo, hi)
    int full_lo, full_hi;  // every lane sees all of a block inside [full_lo, full_hi)
    float* qT;             // [D][16] scaled queries
    float* w;              // [span][16] scores, then weights, from the groups' first block
    float* ls;             // [16 key lanes][16] sums of weights
    float* acc;            // [D][16] weighted sums of values
    bool whole(int b) const { return whole(full_lo, full_hi, b); }
    static bool whole(int full_lo, int full_hi, int b) { return full_lo <= 16 * b && full_hi >= 16 * b + 16; }
};

// A float16 cache's values come widened: `wide` holds blocks [b0, b1) as [block][16][D] floats. A block some
// group's lanes do not all see takes the masked fmas for every group: a lane that sees a key picks the same fma
// either way, so the bits are those of the group walked alone.
// lead: the first call over these blocks and dims, which asks for the blocks ahead (the others find them in cache).
template <int N, int D, typename E, int NG>
inline void lane_values(const Args& a, const int32_t* table, int kvh, int w_lo, int b_hi, int b0, int b1,
                        const LaneGroup* gs, int d0, const float* wide, bool lead) {
    using namespace simd;
    constexpr int BS = 16;
    constexpr bool kWide = !std::is_same_v<E, float>;
    const int64_t stride = static_cast<int64_t>(a.kv_heads) * D;
    VF o[NG * N];
    for (int g = 0; g < NG; ++g)
        for (int i = 0; i < N; ++i) o[g * N + i] = b0 == w_lo ? vzero() : vload(gs[g].acc + (d0 + i) * kLanes);
    // The groups' masks and buffers in locals (see attend_lanes' pass 2)
    VF vlo[NG], vhi[NG];
    int full_lo[NG], full_hi[NG];
    const float* w[NG];
    for (int g = 0; g < NG; ++g)
        vlo[g] = gs[g].vlo, vhi[g] = gs[g].vhi, full_lo[g] = gs[g].full_lo, full_hi[g] = gs[g].full_hi, w[g] = gs[g].w;
    const auto prefetch = [&](int b) { prefetch_kv_block<E>(a, a.v_cache, table, b, kvh, D); };
    if (lead && d0 == 0 && b0 == w_lo)  // see kLanePrefetch: the first chunk's walk asks for the blocks ahead
        for (int b = b0; b < std::min(b_hi, b0 + kLanePrefetch); ++b) prefetch(b);
    for (int b = b0; b < b1; ++b) {
        if (lead && d0 == 0 && b + kLanePrefetch < b_hi) prefetch(b + kLanePrefetch);
        if constexpr (!kWide)
            if (lead && b + 1 < b1) {
                // This chunk's line of each of the next block's values, into L1: each chunk reads another part of
                // every value row, whose line the chunks before may have left L1 by now, and a prefill's walk waited
                // on them (the default model in process, emulated AVX512, float32: a cold 2,029-token prompt 1-4% faster)
                const float* next = kv_block<E>(a, a.v_cache, table, b + 1, kvh, D) + d0;
                for (int j = 0; j < BS; ++j) __builtin_prefetch(next + j * stride, 0, 3);
            }
        bool whole = true;
        for (int g = 0; g < NG; ++g) whole = whole && LaneGroup::whole(full_lo[g], full_hi[g], b);
        const int64_t pw = static_cast<int64_t>(b - w_lo) * BS * kLanes;
        const float* vb;
        int64_t rs;
        if constexpr (!kWide)
            vb = kv_block<E>(a, a.v_cache, table, b, kvh, D) + d0, rs = stride;
        else
            vb = wide + static_cast<int64_t>(b - b0) * BS * D + d0, rs = D;
        if (whole) {
            for (int j = 0; j < BS; ++j) {
                VF pj[NG];
                for (int g = 0; g < NG; ++g) pj[g] = vload(w[g] + pw + j * kLanes);
                for (int i = 0; i < N; ++i) {
                    const VF v = vset1(vb[j * rs + i]);
                    for (int g = 0; g < NG; ++g) o[g * N + i] = vfmadd(pj[g], v, o[g * N + i]);
                }
            }
        } else {
            for (int j = 0; j < BS; ++j) {
                const VF pos = vset1(static_cast<float>(BS * b + j));
                VF pj[NG];
                for (int g = 0; g < NG; ++g) pj[g] = vload(w[g] + pw + j * kLanes);
                for (int i = 0; i < N; ++i) {
                    const VF v = vset1(vb[j * rs + i]);
                    for (int g = 0; g < NG; ++g)
                        o[g * N + i] = vkeep(pos, vlo[g], vhi[g], vfmadd(pj[g], v, o[g * N + i]), o[g * N + i]);
                }
            }
        }
    }
    for (int g = 0; g < NG; ++g)
        for (int i = 0; i < N; ++i) vstore(gs[g].acc + (d0 + i) * kLanes, o[g * N + i]);
}

// Rows r0 .. r0 + 16 NG of one item (fewer at its end: the pad lanes repeat the last row's keys with a zero query
// and are not stored) for KV head kvh, float32 caches, in NG groups of 16 rows (kLaneGroups). The groups walk the
// blocks any of them sees; a block a group does not see is all masked for it (its scores leave the max alone, its
// weights are exactly 0 and add nothing to the sums, its values leave the sums as they were), so each row's
// arithmetic is the one-group walk's, in the same order, and its bits too. Three groups against one, AVX512
// (attention_bench --baseline, emulated avx512-vnni, same bits): prefill 2,048 1.17x faster over a float32
// cache and over a float16 one (two threads), 1.11x over a float32 one (one thread).
template <int DC, typename E, int NG>
void attend_lanes(const Args& a, const ItemKeys& ik, int kvh, int r0, std::vector<float>& buf) {
    using namespace simd;
    constexpr int BS = 16, D = DC;
    constexpr int RG = NG <= kRegGroups ? NG : 1;  // groups per register block (kRegGroups); NG / RG blocks per walk
    static_assert(NG % RG == 0, "whole register blocks");
    constexpr int N = RG == 1 ? kChunk : 8;  // keys per score chunk, dims per value chunk: RG x N accumulators
    const int G = a.heads / a.kv_heads, R = ik.ntok * G;
    LaneGroup gs[NG];
    int b_lo = INT32_MAX, b_hi = 0, rows[NG];
    for (int g = 0; g < NG; ++g) {
        const int rg = r0 + g * kLanes;
        rows[g] = std::min(kLanes, R - rg);
        const int t_first = rg / G, t_last = (rg + rows[g] - 1) / G;
        alignas(64) float lo[kLanes], hi[kLanes];
        for (int l = 0; l < kLanes; ++l) {
            const int t = l < rows[g] ? (rg + l) / G : t_last;
            lo[l] = static_cast<float>(ik.first_key(a, t));
            hi[l] = static_cast<float>(ik.end_key(a, t));
        }
        gs[g].vlo = vload(lo), gs[g].vhi = vload(hi);
        // A token's keys are [first_key, end_key), both non-decreasing in the token: the group sees the blocks of
        // [first_key(t_first), end_key(t_last)), and every lane sees all of a block inside [full_lo, full_hi).
        b_lo = std::min(b_lo, ik.first_key(a, t_first) / BS);
        b_hi = std::max(b_hi, (ik.end_key(a, t_last) + BS - 1) / BS);
        gs[g].full_lo = ik.first_key(a, t_last), gs[g].full_hi = ik.end_key(a, t_first);
    }
    const int span = (b_hi - b_lo) * BS;
    const size_t per_group = static_cast<size_t>(kLanes) * (2 * D + span + BS);
    const size_t wide = static_cast<size_t>(BS) * D * (std::is_same_v<E, float> ? 1 : 1 + kLaneValueBlocks);
    buf.resize(per_group * NG + wide);
    for (int g = 0; g < NG; ++g) {
        gs[g].qT = buf.data() + per_group * g;
        gs[g].w = gs[g].qT + D * kLanes;
        gs[g].ls = gs[g].w + span * kLanes;
        gs[g].acc = gs[g].ls + BS * kLanes;
    }
    float* kwide = buf.data() + per_group * NG;  // one block's keys widened (float16) or copied (float32), [16][D]
    float* vwide = kwide + BS * D;                // a float16 cache's run of values widened, [kLaneValueBlocks][16][D]
    for (int g = 0; g < NG; ++g)
        for (int l = 0; l < kLanes; ++l) {
            const int r = r0 + g * kLanes + l;
            const bool real = l < rows[g];
            const int64_t qo = real ? (ik.tok0 + r / G) * a.q_stride_t + (kvh * G + r % G) * a.q_stride_h : 0;
            for (int d = 0; d < D; ++d) gs[g].qT[d * kLanes + l] = real ? load<kDtypeF32>(a.q, qo + d) * a.scale : 0.0f;
        }
    const int64_t stride = static_cast<int64_t>(a.kv_heads) * D;
    // Pass 1: scores, and each row's max over the keys it sees.
    VF mx[NG];
    for (int g = 0; g < NG; ++g) mx[g] = vset1(-INFINITY);
    const float* qTs[NG];
    for (int g = 0; g < NG; ++g) qTs[g] = gs[g].qT;
    // The keys' blocks, kLanePrefetch ahead, into L2.
    const auto prefetch_keys = [&](int b) { prefetch_kv_block<E>(a, a.k_cache, ik.table, b, kvh, D); };
    for (int b = b_lo; b < std::min(b_hi, b_lo + kLanePrefetch); ++b) prefetch_keys(b);
    for (int b = b_lo; b < b_hi; ++b) {
        const E* kb = kv_block<E>(a, a.k_cache, ik.table, b, kvh, D);
        if (b + kLanePrefetch < b_hi) prefetch_keys(b + kLanePrefetch);
        widen_rows<D>(kb, stride, kwide);
        for (int j0 = 0; j0 < BS; j0 += N)
            with_count<N>(std::min(N, BS - j0), [&](auto C) {
                float* s[NG];
                for (int g = 0; g < NG; ++g) s[g] = gs[g].w + ((b - b_lo) * BS + j0) * kLanes;
                for (int g = 0; g < NG; g += RG) lane_scores<C.value, D, RG>(qTs + g, kwide + j0 * D, s + g);
            });
        for (int g = 0; g < NG; ++g) {
            const float* s = gs[g].w + (b - b_lo) * BS * kLanes;
            const bool whole = gs[g].whole(b);
            const VF lo = gs[g].vlo, hi = gs[g].vhi;
            VF m = mx[g];
            for (int j = 0; j < BS; ++j) {
                const VF x = vload(s + j * kLanes);
                m = whole ? vmax(x, m) : vkeep(vset1(static_cast<float>(BS * b + j)), lo, hi, vmax(x, m), m);
            }
            mx[g] = m;
        }
    }
    // Pass 2: weights (hidden keys exactly 0) and their sums per key lane, block by block.
    // (Locals, not gs[g]'s members or mx[g], in the loops here and in lane_values: behind a store, which may alias
    // anything, GCC reads those again. In lane_values, an array of the groups' weight pointers per block even had it
    // store every accumulator after every key: a float32 prefill's attention 0.7x.)
    for (int g = 0; g < NG; ++g) {
        float* const ls = gs[g].ls;
        const LaneGroup lg = gs[g];
        const VF m = mx[g];
        for (int j = 0; j < BS; ++j) vstore(ls + j * kLanes, vzero());
        for (int b = b_lo; b < b_hi; ++b) {
            float* p = lg.w + (b - b_lo) * BS * kLanes;
            const bool whole = lg.whole(b);
            for (int j = 0; j < BS; ++j) {
                const VF e = exp_nonpos_lanes(vsub(vload(p + j * kLanes), m));
                const VF pj = whole ? e : vkeep(vset1(static_cast<float>(BS * b + j)), lg.vlo, lg.vhi, e, vzero());
                vstore(p + j * kLanes, pj);
                vstore(ls + j * kLanes, vadd(vload(ls + j * kLanes), pj));
            }
        }
    }
    for (int b0 = b_lo; b0 < b_hi; b0 += kLaneValueBlocks) {
        const int b1 = std::min(b_hi, b0 + kLaneValueBlocks);
        if constexpr (!std::is_same_v<E, float>)
            for (int b = b0; b < b1; ++b)
                widen_rows<D>(kv_block<E>(a, a.v_cache, ik.table, b, kvh, D), stride, vwide + (b - b0) * BS * D);
        for (int d0 = 0; d0 < D; d0 += N)
            with_count<N>(std::min(N, D - d0), [&](auto C) {
                for (int g = 0; g < NG; g += RG)
                    lane_values<C.value, D, E, RG>(a, ik.table, kvh, b_lo, b_hi, b0, b1, gs + g, d0, vwide, g == 0);
            });
    }
    for (int g = 0; g < NG; ++g) {
        float* ls = gs[g].ls;
        for (int h = BS / 2; h >= 1; h /= 2)  // the sums' halving tree over the key lanes
            for (int j = 0; j < h; ++j) vstore(ls + j * kLanes, vadd(vload(ls + j * kLanes), vload(ls + (j + h) * kLanes)));
        // Each lane's sums divided by its sum of weights (1 where a row sees no key, not causal: its output is 0), 16
        // lanes a division (scalar divisions, one per output, took ~4% of a prefill's attention on AVX2), then the
        // rows out of the lanes.
        alignas(64) float lr[kLanes];
        for (int l = 0; l < kLanes; ++l) lr[l] = ls[l] > 0.0f ? ls[l] : 1.0f;
        float* const acc = gs[g].acc;
        const VF lrv = vload(lr);
        for (int d = 0; d < D; ++d) vstore(acc + d * kLanes, vdiv(vload(acc + d * kLanes), lrv));
        for (int l = 0; l < rows[g]; ++l) {
            const int r = r0 + g * kLanes + l;
            const int64_t oo = (static_cast<int64_t>(ik.tok0 + r / G) * a.heads + kvh * G + r % G) * D;
            for (int d = 0; d < D; ++d) store<kDtypeF32>(a.out, oo + d, acc[d * kLanes + l]);
        }
    }
}

// ---- float32 with the keys in the lanes: 16-key blocks, head_dim a multiple of 16, items of few rows ----
//
// The generic path's arithmetic again, element for element, laid out for a decode: a GQA group of 3 rows in 16
// row lanes (attend_lanes) leaves 13 lanes idle, and the generic loops transpose each block's keys element by
// element. Here a block's 16 keys are a vector's 16 lanes:
//   - scores: the block's keys are transposed with shuffles (kt[d] holds dim d of its 16 keys), and a row's
//     16 scores are fma(q[d], kt[d], s) over d in order from 0: each lane the same fma chain as the generic
//     path's;
//   - max: per key lane in block order, then the lanes' halving tree (exact in any order anyway);
//   - weights exp_nonpos(score - max), hidden keys exactly 0, summed per key lane in block order (a vector add
//     per block is that), then the same halving tree;
//   - output: 16 dims in a vector, fma(weight, value, o) key by key in position order over the keys the row
//     sees (the others left out), divided by the sum at the end.

// kt[d * 16 + j] = kb[j * stride + d]: a block's 16 keys (rows of D elements, stride apart), transposed, 8 keys x 4
// dims at a time in ymm registers on AVX2 and AVX512 (the tiers that take attend_keys: kKeyRowsMax); plain loops
// elsewhere. Keys i and i + 4 share a register from the load ([key i | key i + 4], 4 dims each), so that the
// shuffles after it stay inside 128-bit lanes: no cross-lane permute (vperm2f128, several micro-ops on CPUs whose
// 256-bit units are two 128-bit halves, Zen 1's). A Zen 1 EPYC (attention_bench --dtype float32 --baseline, 2
// threads, against an 8 x 8 transpose with 8 such permutes): decodes 1.03x to 1.08x, the rest within noise.
#if defined(BRINE_SIMD_AVX2) || defined(BRINE_SIMD_AVX512)
inline __m256 load4x2_kv(const float* lo, const float* hi) {  // [lo[0..4) | hi[0..4)]
    return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(lo)), _mm_loadu_ps(hi), 1);
}
inline __m256 load4x2_kv(const uint16_t* lo, const uint16_t* hi) {
    const __m128i l = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(lo));
    const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(hi));
    return _mm256_cvtph_ps(_mm_unpacklo_epi64(l, h));
}
// a, b, c, d: four rows' 4 columns in each 128-bit lane; out: column k of those rows in c[k], lane by lane.
inline void transpose4x4_lanes(__m256 a, __m256 b, __m256 c, __m256 d, __m256* out) {
    const __m256 t0 = _mm256_unpacklo_ps(a, b), t1 = _mm256_unpackhi_ps(a, b);
    const __m256 t2 = _mm256_unpacklo_ps(c, d), t3 = _mm256_unpackhi_ps(c, d);
    out[0] = _mm256_shuffle_ps(t0, t2, 0x44);
    out[1] = _mm256_shuffle_ps(t0, t2, 0xee);
    out[2] = _mm256_shuffle_ps(t1, t3, 0x44);
    out[3] = _mm256_shuffle_ps(t1, t3, 0xee);
}
#endif

template <int D, typename E>
inline void transpose_keys(const E* kb, int64_t stride, float* kt) {
#if defined(BRINE_SIMD_AVX2) || defined(BRINE_SIMD_AVX512)
    for (int d0 = 0; d0 < D; d0 += 4)
        for (int j0 = 0; j0 < 16; j0 += 8) {
            const E* p = kb + j0 * stride + d0;
            __m256 r[4], c[4];
            for (int i = 0; i < 4; ++i) r[i] = load4x2_kv(p + i * stride, p + (i + 4) * stride);
            transpose4x4_lanes(r[0], r[1], r[2], r[3], c);
            for (int k = 0; k < 4; ++k) _mm256_storeu_ps(kt + (d0 + k) * 16 + j0, c[k]);
        }
#else
    for (int j = 0; j < 16; ++j)
        for (int d = 0; d < D; ++d) kt[d * 16 + j] = widen(kb[j * stride + d]);
#endif
}

// Items of up to this many rows take attend_keys. AVX2 (a Zen 3 EPYC, one thread, attention_bench --baseline
// --dtype float32 against attend_lanes, quiet): a decode over 2,000 tokens 1.91x faster (in DRAM 1.87x), over
// 8,000 in DRAM 1.89x, verify chunks of 3 and 5 tokens (9 and 15 rows) 1.33x and 1.10x; same bits. More rows
// stay in attend_lanes, whose score buffer is 16 rows at a time. A step of few such units spreads each unit over
// the threads: run_split_units. AVX512 (without BF16: float32 is that tier's
// dtype; the same Zen 4, the avx512 build, attention_bench --dtype float32 --baseline, 2 threads), against its
// generic loops: a decode over 2,000 tokens 2.02x (in DRAM 1.57x), over 8,000 in DRAM 1.37x, verify chunks of 3,
// 5 and 9 tokens 1.61x, 1.35x and 1.26x, the 13-token question 1.28x, prefills unchanged; same bits. The
// portable build is unmeasured and keeps its paths.
//
// Items at the end of a long context take attend_keys up to kKeyRowsTail rows: a question after a cached document,
// a speculative verify chunk, a prompt whose start was cached. That context was written by earlier steps and comes
// from DRAM, where reading it once (attend_keys) rather than once per 16 rows (attend_lanes) pays. A Zen 4 EPYC
// under the avx2 build, attention_bench --dtype float32 --baseline, 2 threads (and 1): 13 tokens (39 rows) over
// 2,016 cached 1.24x (1.24x), a verify chunk of 9 tokens 1.28x (1.27x), a 16-token chunk over 2,000 keys in the
// CPU's caches 1.17x (0.92x), prefills 1.01x to 1.04x (0.99x to 1.01x). Inside a long prompt's prefill the
// context was written by the same step and sits in the CPU's caches, where attend_lanes' denser arithmetic wins
// (a 2,048-token prefill 0.92x with every item on attend_keys): only the items of its last kKeyTailTokens tokens
// take attend_keys there. Either path gives the same bits.
#if defined(BRINE_SIMD_AVX2) || defined(BRINE_SIMD_AVX512)
constexpr int kKeyRowsMax = 16;
constexpr int kKeyRowsTail = 64;
#else
constexpr int kKeyRowsMax = 0;
constexpr int kKeyRowsTail = 0;
#endif
constexpr int kKeyTailTokens = 64;     // an item's first token at most this far from the end of its context,
constexpr int kKeyTailContext = 512;  // and at least this far from its start
inline bool at_context_tail(const ItemKeys& ik) {  // the two rules above
    return ik.ctx - ik.pos0 <= kKeyTailTokens && ik.pos0 >= kKeyTailContext;
}
constexpr int kKeyRowGroup = 4;  // rows whose scores are computed together: independent fma chains
// The value walk's register block: kKeyValueRows rows (a decode's GQA group is 3 in the default model) times
// kKeyOutVecs output vectors of 16 dims each; every value vector is loaded (and widened from float16) once and
// used by all the rows. AVX2's 16 ymm: 3 x 2 VF = 12 accumulators (two ymm per VF), the rows' 3 weights and the
// operand; AVX512's 32 zmm: 4 x 4 = 16.
#if defined(BRINE_SIMD_AVX512)
constexpr int kKeyValueRows = 4;
constexpr int kKeyOutVecs = 4;
#else
constexpr int kKeyValueRows = 3;
constexpr int kKeyOutVecs = 2;
#endif

template <int N>
inline void key_scores(const float* q, int D, const float* kt, simd::VF* s) {  // s[i] = the 16 keys' scores, row i
    using namespace simd;
    for (int i = 0; i < N; ++i) s[i] = vzero();
    for (int d = 0; d < D; ++d) {
        const VF k = vload(kt + d * kLanes);
        for (int i = 0; i < N; ++i) s[i] = vfmadd(vset1(q[i * D + d]), k, s[i]);
    }
}

#if defined(BRINE_SIMD_AVX2) || defined(BRINE_SIMD_AVX512)
inline simd::VF vf_of_halves(__m256 lo, __m256 hi) {  // keys 0..7 and 8..15 as one VF
#if defined(BRINE_SIMD_AVX512)
    const __m512d both = _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1);
    return {_mm512_castpd_ps(both)};
#else
    return {lo, hi};
#endif
}

// key_scores straight from a block's keys as stored, for N <= kKeyRowGroup rows (a decode's GQA group): each 4
// dims of 8 keys are transposed in registers and used at once, with no transposed copy stored and read back (at
// head_dim 64 a block's copy is 256 stores of 16 bytes, Zen 1's store width, against 384 ymm fmas for 3 rows).
// Each lane's chain is the same: fma over d in order from 0. Both halves of the block go together: 2N
// independent chains hide the fma latency that N alone would wait on. A Zen 1 EPYC (attention_bench --baseline
// --kv-float16 --cases decode, the same bits): a decode over 2,000 keys in the CPU's caches 1.10x faster on one
// thread, 1.07x on two; from DRAM 1.01x to 1.04x (the reads dominate there). Items of more rows transpose each
// block once for all their row groups (transpose_keys).
template <int N, int D, typename E>
inline void key_scores_direct(const float* q, const E* kb, int64_t stride, simd::VF* s) {
    __m256 lo[N], hi[N];
    for (int i = 0; i < N; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int d0 = 0; d0 < D; d0 += 4) {
        __m256 cl[4], ch[4];
        const E* p = kb + d0;
        transpose4x4_lanes(load4x2_kv(p, p + 4 * stride), load4x2_kv(p + stride, p + 5 * stride),
                           load4x2_kv(p + 2 * stride, p + 6 * stride), load4x2_kv(p + 3 * stride, p + 7 * stride), cl);
        p += 8 * stride;
        transpose4x4_lanes(load4x2_kv(p, p + 4 * stride), load4x2_kv(p + stride, p + 5 * stride),
                           load4x2_kv(p + 2 * stride, p + 6 * stride), load4x2_kv(p + 3 * stride, p + 7 * stride), ch);
        for (int k = 0; k < 4; ++k)
            for (int i = 0; i < N; ++i) {
                const __m256 qd = _mm256_broadcast_ss(q + i * D + d0 + k);
                lo[i] = _mm256_fmadd_ps(qd, cl[k], lo[i]);
                hi[i] = _mm256_fmadd_ps(qd, ch[k], hi[i]);
            }
    }
    for (int i = 0; i < N; ++i) s[i] = vf_of_halves(lo[i], hi[i]);
}
#else
template <int N, int D, typename E>
inline void key_scores_direct(const float* q, const E* kb, int64_t stride, simd::VF* s) {
    alignas(64) float kt[D * kLanes];
    transpose_keys<D>(kb, stride, kt);
    key_scores<N>(q, D, kt, s);
}
#endif

// Output dims [d0, d0 + 16 N) of NR rows over blocks [b0, b1): o = fma(w[key], v[key][dim], o), key by key over
// the keys [klo[i], khi[i]) row i sees, continuing from acc[i]. A key every row sees is loaded once for all of
// them; one only some rows see (the edges of a causal chunk's or a window's ranges) is added to those rows alone,
// in the same key order, so each row's chain is the one it walks alone: its own keys in position order, hidden
// ones left out as on every path (not added with weight 0, which an inf or NaN value would turn into NaN).
// Against one row per walk (a Zen 1 EPYC, attention_bench --baseline --kv-float16, 2 threads, the same bits):
// a decode over 2,000 keys 1.18x (in DRAM 1.07x), verify chunks of 3 to 9 tokens 1.19x to 1.25x, the 13-token
// question 1.28x, a 16-token chunk over 2,000 1.30x, prefills within noise.
template <int NR, int N, typename E>
inline void key_values(const Args& a, const int32_t* table, int kvh, int D, int b0, int b1, int b_lo, const int* klo,
                       const int* khi, const float* const* w, int d0, float* const* acc) {
    using namespace simd;
    constexpr int BS = 16;
    const int64_t stride = static_cast<int64_t>(a.kv_heads) * D;
    VF o[NR][N];
    int all_lo = klo[0], all_hi = khi[0], any_lo = klo[0], any_hi = khi[0];
    for (int i = 0; i < NR; ++i) {
        for (int n = 0; n < N; ++n) o[i][n] = vload(acc[i] + d0 + 16 * n);
        all_lo = std::max(all_lo, klo[i]), all_hi = std::min(all_hi, khi[i]);
        any_lo = std::min(any_lo, klo[i]), any_hi = std::max(any_hi, khi[i]);
    }
    for (int b = b0; b < b1; ++b) {
        const E* vb = kv_block<E>(a, a.v_cache, table, b, kvh, D) + d0;
        const int off = (b - b_lo) * BS, jlo = std::max(any_lo - BS * b, 0), jhi = std::min(any_hi - BS * b, BS);
        const int slo = all_lo - BS * b, shi = all_hi - BS * b;
        for (int j = jlo; j < jhi; ++j) {
            if (j >= slo && j < shi) {
                VF p[NR];
                for (int i = 0; i < NR; ++i) p[i] = vset1(w[i][off + j]);
                for (int n = 0; n < N; ++n) {
                    const VF v = vload_kv(vb + j * stride + 16 * n);
                    for (int i = 0; i < NR; ++i) o[i][n] = vfmadd(p[i], v, o[i][n]);
                }
            } else {
                for (int i = 0; i < NR; ++i)
                    if (BS * b + j >= klo[i] && BS * b + j < khi[i]) {
                        const VF p = vset1(w[i][off + j]);
                        for (int n = 0; n < N; ++n) o[i][n] = vfmadd(p, vload_kv(vb + j * stride + 16 * n), o[i][n]);
                    }
            }
        }
    }
    for (int i = 0; i < NR; ++i)
        for (int n = 0; n < N; ++n) vstore(acc[i] + d0 + 16 * n, o[i][n]);
}

// One (item, KV head) of attend_keys, in three phases over its own memory, so that a step of few units (a lone
// decode: 3 units for 2 threads) can spread each unit's phases over the threads (kSplitParts below):
//   1. scores of blocks [b0, b1), with each row's max per key lane over them (into that part's maxima);
//   2. weights of blocks [b0, b1): the row's max (every part's lane maxima, then a halving tree: exact, as a
//      max is in any order), exp_nonpos(score - max), hidden keys exactly 0;
//   3. output dims [d0, d1): weights x values key by key in position order, the sum of weights per key lane in
//      block order and its halving tree, the division.
// Each score, weight and output dim is the same fma chain whichever blocks or dims a call covers, so a unit run
// whole and a unit run in parts give the same bits.
struct KeyUnit {
    ItemKeys ik;
    int kvh = 0, R = 0, span = 0, parts = 1;
    float* qf = nullptr;   // [R, D] scaled queries
    float* w = nullptr;    // [R, span] scores, then weights
    float* acc = nullptr;  // [R, D] weighted sums of values
    float* mx = nullptr;   // [parts][R, 16] max per key lane over that part's blocks
};

template <int D>
KeyUnit key_unit(const Args& a, const ItemKeys& ik, int kvh, int parts, std::vector<float>& buf) {
    using namespace simd;
    KeyUnit u;
    u.ik = ik, u.kvh = kvh, u.parts = parts;
    const int G = a.heads / a.kv_heads;
    u.R = ik.ntok * G, u.span = (ik.b_hi - ik.b_lo) * 16;
    const int R = u.R;
    buf.resize(static_cast<size_t>(R) * (2 * D + u.span + parts * kLanes));
    u.qf = buf.data(), u.w = u.qf + R * D, u.acc = u.w + static_cast<int64_t>(R) * u.span, u.mx = u.acc + R * D;
    for (int r = 0; r < R; ++r) {
        const int64_t qo = (ik.tok0 + r / G) * a.q_stride_t + (kvh * G + r % G) * a.q_stride_h;
        for (int d = 0; d < D; ++d) u.qf[r * D + d] = load<kDtypeF32>(a.q, qo + d) * a.scale;
    }
    for (int i = 0; i < R * D; ++i) u.acc[i] = 0.0f;
    for (int i = 0; i < parts * R; ++i) vstore(u.mx + i * kLanes, vset1(-INFINITY));
    return u;
}

// Phase 1. kt: [D, 16] scratch for one block's keys, transposed.
template <int D, typename E>
void key_unit_scores(const Args& a, const KeyUnit& u, int part, int b0, int b1, float* kt) {
    using namespace simd;
    constexpr int BS = 16;
    const ItemKeys& ik = u.ik;
    const int G = a.heads / a.kv_heads, R = u.R;
    float* mx = u.mx + static_cast<int64_t>(part) * R * kLanes;
    alignas(64) float iota[kLanes];
    for (int j = 0; j < kLanes; ++j) iota[j] = static_cast<float>(j);
    const VF lane = vload(iota);
    const int64_t stride = static_cast<int64_t>(a.kv_heads) * D;
    const auto prefetch = [&](int b) { prefetch_kv_block<E>(a, a.k_cache, ik.table, b, u.kvh, D); };
    const bool direct = R <= kKeyRowGroup;  // one row group: key_scores_direct, no transposed copy
    for (int b = b0; b < std::min(b1, b0 + kLanePrefetch); ++b) prefetch(b);
    for (int b = b0; b < b1; ++b) {
        if (b + kLanePrefetch < b1) prefetch(b + kLanePrefetch);
        const E* kb = kv_block<E>(a, a.k_cache, ik.table, b, u.kvh, D);
        if (!direct) transpose_keys<D>(kb, stride, kt);
        const VF pos = vadd(lane, vset1(static_cast<float>(BS * b)));
        for (int r0 = 0; r0 < R; r0 += kKeyRowGroup)
            with_count<kKeyRowGroup>(std::min(kKeyRowGroup, R - r0), [&](auto N) {
                VF s[N.value];
                if (direct)
                    key_scores_direct<N.value, D>(u.qf + r0 * D, kb, stride, s);
                else
                    key_scores<N.value>(u.qf + r0 * D, D, kt, s);
                for (int i = 0; i < N.value; ++i) {
                    const int r = r0 + i, t = r / G;
                    vstore(u.w + static_cast<int64_t>(r) * u.span + (b - ik.b_lo) * BS, s[i]);
                    const VF m = vload(mx + r * kLanes);
                    const VF lo = vset1(static_cast<float>(ik.first_key(a, t))), hi = vset1(static_cast<float>(ik.end_key(a, t)));
                    vstore(mx + r * kLanes, vkeep(pos, lo, hi, vmax(s[i], m), m));
                }
            });
    }
}

// Phase 2.
inline void key_unit_weights(const Args& a, const KeyUnit& u, int b0, int b1) {
    using namespace simd;
    constexpr int BS = 16;
    const ItemKeys& ik = u.ik;
    const int G = a.heads / a.kv_heads, R = u.R;
    alignas(64) float iota[kLanes], mr[kLanes];
    for (int j = 0; j < kLanes; ++j) iota[j] = static_cast<float>(j);
    const VF lane = vload(iota);
    for (int r = 0; r < R; ++r) {
        VF m = vload(u.mx + r * kLanes);
        for (int part = 1; part < u.parts; ++part) m = vmax(vload(u.mx + (static_cast<int64_t>(part) * R + r) * kLanes), m);
        vstore(mr, m);
        for (int h = kLanes / 2; h >= 1; h /= 2)
            for (int j = 0; j < h; ++j) mr[j] = mr[j] > mr[j + h] ? mr[j] : mr[j + h];
        const int t = r / G, klo = ik.first_key(a, t), khi = ik.end_key(a, t);
        const VF mv = vset1(mr[0]), lo = vset1(static_cast<float>(klo)), hi = vset1(static_cast<float>(khi));
        for (int b = b0; b < b1; ++b) {
            float* p = u.w + static_cast<int64_t>(r) * u.span + (b - ik.b_lo) * BS;
            const VF e = exp_nonpos_lanes(vsub(vload(p), mv));
            vstore(p, (klo <= BS * b && khi >= BS * b + BS) ? e : vkeep(vadd(lane, vset1(static_cast<float>(BS * b))), lo, hi, e, vzero()));
        }
    }
}

// Phase 3: dims [d0, d1), multiples of 16, in runs of kValueBlocks blocks (a run's values come from memory for
// the first row, from L1 for the rest).
template <int D, typename E>
void key_unit_values(const Args& a, const KeyUnit& u, int d0, int d1) {
    using namespace simd;
    constexpr int BS = 16;
    const ItemKeys& ik = u.ik;
    const int G = a.heads / a.kv_heads, R = u.R, b_lo = ik.b_lo, b_hi = ik.b_hi;
    constexpr int64_t kBytes = sizeof(E);
    const auto prefetch = [&](int b) { prefetch_kv_block<E>(a, a.v_cache, ik.table, b, u.kvh, D, d0 * kBytes, d1 * kBytes); };
    for (int b0 = b_lo; b0 < b_hi; b0 += kValueBlocks) {
        const int b1 = std::min(b_hi, b0 + kValueBlocks);
        for (int b = b1; b < std::min(b_hi, b1 + kValueBlocks); ++b) prefetch(b);
        if (b0 == b_lo)
            for (int b = b0; b < b1; ++b) prefetch(b);
        for (int r0 = 0; r0 < R; r0 += kKeyValueRows) {
            const int nr = std::min(kKeyValueRows, R - r0);
            int klo[kKeyValueRows], khi[kKeyValueRows];
            const float* w[kKeyValueRows];
            float* acc[kKeyValueRows];
            for (int i = 0; i < nr; ++i) {
                const int r = r0 + i, t = r / G;
                klo[i] = ik.first_key(a, t), khi[i] = ik.end_key(a, t);
                w[i] = u.w + static_cast<int64_t>(r) * u.span, acc[i] = u.acc + r * D;
            }
            for (int dc = d0; dc < d1; dc += 16 * kKeyOutVecs)
                with_count<kKeyValueRows>(nr, [&](auto NR) {
                    with_count<kKeyOutVecs>(std::min(kKeyOutVecs, (d1 - dc) / 16), [&](auto N) {
                        key_values<NR.value, N.value, E>(a, ik.table, u.kvh, D, b0, b1, b_lo, klo, khi, w, dc, acc);
                    });
                });
        }
    }
    for (int r = 0; r < R; ++r) {
        // The weights' sums per key lane, in block order. Each dim part of a split unit sums them again itself:
        // a vector add per block, cheaper than a barrier to share one part's.
        VF sum = vzero();
        for (int b = b_lo; b < b_hi; ++b) sum = vadd(sum, vload(u.w + static_cast<int64_t>(r) * u.span + (b - b_lo) * BS));
        alignas(64) float lr[kLanes];
        vstore(lr, sum);
        for (int h = kLanes / 2; h >= 1; h /= 2)  // the sums' halving tree over the key lanes
            for (int j = 0; j < h; ++j) lr[j] += lr[j + h];
        const float s = lr[0] > 0.0f ? lr[0] : 1.0f;  // a row that sees no key (not causal): 0
        const int64_t oo = (static_cast<int64_t>(ik.tok0 + r / G) * a.heads + u.kvh * G + r % G) * D;
        for (int d = d0; d < d1; ++d) store<kDtypeF32>(a.out, oo + d, u.acc[r * D + d] / s);
    }
}

template <int DC, typename E>
void attend_keys(const Args& a, const ItemKeys& ik, int kvh, std::vector<float>& buf) {
    constexpr int D = DC;
    alignas(64) float kt[D * kLanes];
    const KeyUnit u = key_unit<D>(a, ik, kvh, 1, buf);
    key_unit_scores<D, E>(a, u, 0, ik.b_lo, ik.b_hi, kt);
    key_unit_weights(a, u, ik.b_lo, ik.b_hi);
    key_unit_values<D, E>(a, u, 0, D);
}

// A step of few attend_keys units over long contexts, such as a lone request's decode or a warm request's one
// new token: 3 units (the default model's KV heads) on 2 threads leave one thread idle for a third of the walk.
// Each unit is then run in kSplitParts parts per phase (its blocks' halves, then its dims' halves), each phase's
// parts spread over the threads, with the same bits as whole (KeyUnit). Taken when parts spread the units' work
// more evenly over the threads than whole units do, and every item is a key-lanes item with at least
// kSplitMinKeys keys. A Zen 1 EPYC (AVX2; attention_bench --baseline, 2 threads, the same bits): a decode over
// 2,000 keys in DRAM 1.14x faster over a float32 cache and 1.26x over a float16 one, over 8,000 1.17x and 1.28x,
// verify chunks of 3 and 5 tokens 1.12x to 1.19x; the engine's warm step (one token over 2,029 cached, float16
// cache) 23.5 -> 21.2 ms. At 128 keys it measured the same as whole units (1.00x): short contexts stay whole.
// Measured on that Zen 1 only: splits of this kind tried on a Zen 4 (session 17) gave decodes 1.06x to 1.10x in
// DRAM and verify chunks down to 0.8x; an AVX512 machine should rerun attention_bench --baseline.
constexpr int kSplitParts = 2;
constexpr int kSplitMinKeys = 512;
// Items at the end of a long context (the tail rule of kKeyRowsTail: a speculative verify chunk, a question after
// a cached document) are split too up to this many rows, where measured faster. The AVX2 build on a Zen 4 EPYC
// (session 31; attention_bench --dtype float32 --baseline, 2 threads, the same bits): a verify chunk of 9 tokens
// (27 rows) over 2,000 keys in DRAM 1.22x faster over a float32 cache and over a float16 one, the 13-token
// question (39 rows) 1.21-1.22x, the rest unchanged. The AVX512 build (float32) on the same CPU measured 1.11x
// then 0.83x for the 9 tokens, 0.98x then 0.79x for the question, and keeps whole units past kKeyRowsMax.
#if defined(BRINE_SIMD_AVX2)
constexpr int kSplitRowsTail = kKeyRowsTail;
#else
constexpr int kSplitRowsTail = kKeyRowsMax;
#endif

template <int D, typename E>
bool run_split_units(const Args& a, int threads) {
    static_assert(D % (16 * kSplitParts) == 0, "dims split in whole vectors");
    const int64_t work = a.num_items * a.kv_heads;
    const auto rounds = [&](int64_t tasks) { return (tasks + threads - 1) / threads; };
    if (threads < 2 || work > 4 * threads || rounds(kSplitParts * work) >= kSplitParts * rounds(work)) return false;
    std::vector<ItemKeys> iks(static_cast<size_t>(a.num_items));
    for (int64_t i = 0; i < a.num_items; ++i) {
        iks[i] = ItemKeys(a, i, 16);
        const int rows = iks[i].ntok * (a.heads / a.kv_heads);
        const bool keys_path = rows <= kKeyRowsMax || (at_context_tail(iks[i]) && rows <= kSplitRowsTail);
        if (!keys_path || (iks[i].b_hi - iks[i].b_lo) * 16 < kSplitMinKeys) return false;
    }
    std::vector<std::vector<float>> bufs(static_cast<size_t>(work));
    std::vector<KeyUnit> units(static_cast<size_t>(work));
    for (int64_t w = 0; w < work; ++w)
        units[w] = key_unit<D>(a, iks[w / a.kv_heads], static_cast<int>(w % a.kv_heads), kSplitParts, bufs[w]);
    const int64_t tasks = work * kSplitParts;
    const auto share = [](int lo, int hi, int part) { return lo + (hi - lo) * part / kSplitParts; };
#pragma omp parallel num_threads(threads)
    {
        alignas(64) float kt[D * kLanes];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; ++t) {
            const KeyUnit& u = units[t / kSplitParts];
            const int part = static_cast<int>(t % kSplitParts);
            key_unit_scores<D, E>(a, u, part, share(u.ik.b_lo, u.ik.b_hi, part), share(u.ik.b_lo, u.ik.b_hi, part + 1), kt);
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; ++t) {
            const KeyUnit& u = units[t / kSplitParts];
            const int part = static_cast<int>(t % kSplitParts);
            key_unit_weights(a, u, share(u.ik.b_lo, u.ik.b_hi, part), share(u.ik.b_lo, u.ik.b_hi, part + 1));
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tasks; ++t) {
            const int part = static_cast<int>(t % kSplitParts);
            key_unit_values<D, E>(a, units[t / kSplitParts], share(0, D, part), share(0, D, part + 1));
        }
    }
    return true;
}

template <int DT, int KT, int BSC, int DC>
void run_items(const Args& a, int threads) {
#if BRINE_BF16_SCORES
    if constexpr (DT == kDtypeBF16 && KT == kDtypeBF16 && BSC == 16 && DC > 0 && DC % 32 == 0) {
        return run_bf16_items<DC>(a, threads);
    }
#endif
    if constexpr (DT == kDtypeF32 && (KT == kDtypeF32 || KT == kDtypeF16) && BSC == 16 && DC > 0 &&
                  DC % (16 * kSplitParts) == 0 && kKeyRowsMax > 0) {
        if (run_split_units<DC, typename CacheElem<KT>::type>(a, threads)) return;
    }
    // The work units KV head by KV head, each head's items last first: a thread's units then read one head's
    // keys and values (a long prompt's: 1 MB per head at the default model's float32 shape, which a 2 MB L2 holds)
    // rather than every head's in turn, and a causal prefill's heaviest items (its last tokens, which see the
    // most keys) go first instead of last, where one thread finished its last while the other waited. Which
    // thread runs a unit, and when, changes none of its bits. The default model in process, emulated AVX512,
    // float32, a cold 2,029-token prompt: 3% faster; attention_bench --dtype float32, prefill 2,048: 1.07x.
    const int64_t work = a.num_items * a.kv_heads;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < work; ++w) {
            const int64_t item = a.num_items - 1 - w % a.num_items;
            const int kvh = static_cast<int>(w / a.num_items);
            if constexpr (DT == kDtypeF32 && (KT == kDtypeF32 || KT == kDtypeF16) && BSC == 16 && DC > 0 && DC % 16 == 0) {
                using E = typename CacheElem<KT>::type;
                const ItemKeys ik(a, item, 16);
                const int rows = ik.ntok * (a.heads / a.kv_heads);
                if (rows <= kKeyRowsMax || (at_context_tail(ik) && rows <= kKeyRowsTail)) {
                    attend_keys<DC, E>(a, ik, kvh, buf);
                    continue;
                }
                if (rows >= kLaneRowsMin) {
                    for (int r0 = 0; r0 < rows;) {
                        // Groups of 16 rows left; four go as two and two, not three and one: one group alone
                        // shares no broadcast (and AVX512 otherwise takes only items of more than 16 rows here)
                        const int left = (rows - r0 + kLanes - 1) / kLanes;
                        with_count<kLaneGroups>(std::min(kLaneGroups, left == 4 ? 2 : left), [&](auto NG) {
                            attend_lanes<DC, E, NG.value>(a, ik, kvh, r0, buf);
                            r0 += kLanes * NG.value;
                        });
                    }
                    continue;
                }
            }
            attend_item<DT, KT, BSC, DC>(a, item, kvh, buf);
        }
    }
}

template <int DT, int KT>
void run(const Args& a, int threads) {
    if (a.block_size == 16 && a.head_dim == 64) return run_items<DT, KT, 16, 64>(a, threads);
    if (a.block_size == 16 && a.head_dim == 128) return run_items<DT, KT, 16, 128>(a, threads);
    run_items<DT, KT, 0, 0>(a, threads);
}

}  // namespace

extern "C" {

// Bumped whenever the arguments change: the loader refuses a library that says otherwise.
int brine_paged_attention_abi() { return 2; }

// dtype: q's and out's; kv_dtype: the caches', the same, or float16 under float32 (`--kv-cache-dtype float16`).
int brine_paged_attention(int dtype, int kv_dtype, const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k_cache,
                          const void* v_cache, void* out, const int32_t* items, int64_t num_items,
                          const int32_t* tables, int64_t table_width, int heads, int kv_heads, int head_dim,
                          int block_size, int causal, int window, float scale, int threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || head_dim <= 0 || head_dim > kMaxDim || block_size <= 0 ||
        block_size > kMaxBlock || threads <= 0)
        return 1;
    Args a{q,     q_stride_t, q_stride_h, k_cache,  v_cache,  out,        items,     num_items, tables,
           table_width, heads,      kv_heads,   head_dim, block_size, causal, window, scale};
    if (kv_dtype != dtype) {
        if (dtype != kDtypeF32 || kv_dtype != kDtypeF16) return 2;
        run<kDtypeF32, kDtypeF16>(a, threads);
        return 0;
    }
    switch (dtype) {
        case kDtypeF32: run<kDtypeF32, kDtypeF32>(a, threads); return 0;
        case kDtypeBF16: run<kDtypeBF16, kDtypeBF16>(a, threads); return 0;
        case kDtypeF16: run<kDtypeF16, kDtypeF16>(a, threads); return 0;
        default: return 2;
    }
}

}  // extern "C"
