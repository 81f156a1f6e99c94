// Batch-invariant paged attention for CPU that reads the KV cache in place (engine/model/native_attention.py).
//
// One work item is (a few consecutive query tokens of one request, one KV head); its rows are (token, query
// head of the GQA group). It walks the request's block table from its first visible block to its last,
// twice: pass 1 converts each block's keys to float32 (transposed, so that 16 keys are one vector; in bfloat16
// with 16-key blocks, it pairs the keys' dimensions for AVX512-BF16 dot products instead) and keeps
// every row's scores and exact max; pass 2 converts each block's values and accumulates exp(score - max) x
// value and the weights' sum. Nothing is gathered into contiguous tensors first, so a cached context costs
// only its reads, and no running max is ever rescaled.
//
// Invariance: each row's arithmetic is a fixed sequence that depends only on its own query, its own visible
// keys (by absolute position) and the block size. Which other rows share its item, the batch, the chunking of
// its prompt, which physical blocks hold its keys and the thread count change none of it:
//   - a score is a dot product over head_dim in order (explicit fmaf; -ffp-contract=off keeps the compiler
//     from fusing anything else differently in different loops), or in bfloat16 with 16-key blocks, where
//     the CPU has AVX512-BF16, vdpbf16ps over dimension pairs in order, then times the scale;
//   - the max is exact in any order; hidden keys get weight exactly 0;
//   - weights are summed per key lane (a key's position mod the block size) in position order, then the
//     lanes by a fixed halving tree; weights x values are accumulated key by key in position order (in
//     bfloat16 with 16-key blocks and head_dim a multiple of 32, where the CPU has AVX512-BF16: the weights
//     rounded to bfloat16 first, and accumulated key pair by key pair with vdpbf16ps).
// So the tests compare rows computed alone, chunked, batched, on other blocks and threads bit for bit.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dtypes.h"

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
        return static_cast<float>(static_cast<const _Float16*>(p)[i]);
    }
}

template <int DT>
inline void store(void* p, int64_t i, float x) {
    if constexpr (DT == kDtypeF32) {
        static_cast<float*>(p)[i] = x;
    } else if constexpr (DT == kDtypeBF16) {
        static_cast<uint16_t*>(p)[i] = f32_to_bf16(x);
    } else {
        static_cast<_Float16*>(p)[i] = static_cast<_Float16>(x);
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
    float p = 1.9875691500e-4f;
    p = std::fma(p, r, 1.3981999507e-3f);
    p = std::fma(p, r, 8.3334519073e-3f);
    p = std::fma(p, r, 4.1665795894e-2f);
    p = std::fma(p, r, 1.6666665459e-1f);
    p = std::fma(p, r, 5.0000001201e-1f);
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

constexpr int kRowBlock = 4;    // rows whose scores are computed together: independent FMA chains, same bits
constexpr int kMaxBlock = 256;  // largest block size and head_dim of the generic instantiation
constexpr int kMaxDim = 512;

constexpr int pow2_at_least(int n) {
    int w = 1;
    while (w < n) w *= 2;
    return w;
}

// BSC, DC: block size and head_dim fixed at compile time (0: taken from the arguments). The fixed ones let the
// compiler keep a row block's scores and a row's output in registers; the arithmetic is the same.
//
// Two passes over the item's blocks, so that no running max has to be rescaled: the first computes every
// score (kept for the second) and each row's exact max; the second turns scores into weights and sums
// weights x values. Rows are (token, query head of the GQA group), a row's keys those its token may see.
template <int DT, int BSC, int DC>
void attend_item(const Args& a, int64_t item, int kvh, std::vector<float>& buf) {
    const int32_t* it = a.items + item * 5;
    const int tok0 = it[0], ntok = it[1], pos0 = it[2], ctx = it[3];
    const int32_t* table = a.tables + static_cast<int64_t>(it[4]) * a.table_width;
    const int G = a.heads / a.kv_heads, R = ntok * G;
    const int BS = BSC ? BSC : a.block_size, D = DC ? DC : a.head_dim;
    const int RP = (R + kRowBlock - 1) / kRowBlock * kRowBlock;  // rows padded with zero queries
    constexpr int BWC = BSC ? pow2_at_least(BSC) : 0;
    const int BW = BWC ? BWC : pow2_at_least(BS);  // block size rounded up to a power of two: lane count

    // The keys token t may see: positions [first_key(t), end_key(t)).
    auto first_key = [&](int t) { return a.window > 0 ? std::max(0, pos0 + t - a.window + 1) : 0; };
    auto end_key = [&](int t) { return a.causal ? pos0 + t + 1 : ctx; };
    int lo_all = ctx, hi_all = 0;  // the keys any row of the item sees
    for (int t = 0; t < ntok; ++t) {
        lo_all = std::min(lo_all, first_key(t));
        hi_all = std::max(hi_all, end_key(t));
    }
    const int b_lo = lo_all / BS, b_hi = (hi_all + BS - 1) / BS;
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
#if BRINE_BF16_SCORES
    // bfloat16 with 16-key blocks: the scores come from AVX512-BF16 dot products of the bfloat16 query and
    // keys (exact products, summed in float32 two dimensions at a time, in order), times the scale. Half the
    // instructions of float32 FMAs; a row's arithmetic still depends only on its own query and keys.
    constexpr bool bf16_scores = DT == kDtypeBF16 && BSC == 16 && DC > 0 && DC % 32 == 0;
    std::vector<uint32_t> qpairs, kpairs;  // [RP][D / 2] query dimension pairs; [D / 2][16] keys' pairs
    if constexpr (bf16_scores) {
        qpairs.assign(static_cast<size_t>(RP) * DC / 2, 0u);  // pad rows: zero queries
        kpairs.resize(static_cast<size_t>(DC / 2) * 16);
        for (int t = 0; t < ntok; ++t)
            for (int g = 0; g < G; ++g) {
                const int64_t qo = (tok0 + t) * a.q_stride_t + (kvh * G + g) * a.q_stride_h;
                std::memcpy(qpairs.data() + static_cast<size_t>(t * G + g) * DC / 2,
                            static_cast<const uint16_t*>(a.q) + qo, DC * 2);
            }
    }
#else
    constexpr bool bf16_scores = false;
#endif
    if constexpr (!bf16_scores) {  // float32 queries, scaled, for the FMA scores
        for (int t = 0; t < ntok; ++t) {
            for (int g = 0; g < G; ++g) {
                const int r = t * G + g;
                const int64_t qo = (tok0 + t) * a.q_stride_t + (kvh * G + g) * a.q_stride_h;
                for (int d = 0; d < D; ++d) qf[r * D + d] = load<DT>(a.q, qo + d) * a.scale;
            }
        }
        for (int i = R * D; i < RP * D; ++i) qf[i] = 0.0f;
    }
    // Pass 1: scores, s[r, k] = sum over d, in order, of q[r, d] k[k, d]; each row's max per lane.
    for (int b = b_lo; b < b_hi; ++b) {
        const int64_t base = (static_cast<int64_t>(table[b]) * BS * a.kv_heads + kvh) * D;
        const int col = (b - b_lo) * BS;
#if BRINE_BF16_SCORES
        if constexpr (bf16_scores) {
            // kpairs[pr][j] = key j's dimension pair pr: 16 x 16 dword transposes of the block's keys.
            const uint16_t* kc = static_cast<const uint16_t*>(a.k_cache);
            for (int c = 0; c < DC / 32; ++c) {
                __m512i rows[16];
                for (int j = 0; j < 16; ++j) rows[j] = _mm512_loadu_si512(kc + base + j * key_stride + 32 * c);
                transpose16x16(rows);
                for (int i = 0; i < 16; ++i) _mm512_storeu_si512(kpairs.data() + (16 * c + i) * 16, rows[i]);
            }
            const __m512 vscale = _mm512_set1_ps(a.scale);
            for (int r0 = 0; r0 < RP; r0 += kRowBlock) {
                __m512 acc[kRowBlock];
                for (int i = 0; i < kRowBlock; ++i) acc[i] = _mm512_setzero_ps();
                for (int pr = 0; pr < DC / 2; ++pr) {
                    const __m512bh kv = (__m512bh)_mm512_loadu_si512(kpairs.data() + pr * 16);
                    for (int i = 0; i < kRowBlock; ++i) {
                        const uint32_t qp = qpairs[static_cast<size_t>(r0 + i) * DC / 2 + pr];
                        acc[i] = _mm512_dpbf16_ps(acc[i], kv, (__m512bh)_mm512_set1_epi32(static_cast<int>(qp)));
                    }
                }
                for (int i = 0; i < kRowBlock; ++i)
                    _mm512_storeu_ps(sc + static_cast<int64_t>(r0 + i) * span + col, _mm512_mul_ps(acc[i], vscale));
            }
        }
#endif
        if constexpr (!bf16_scores) {
        for (int j = 0; j < BS; ++j)
            for (int d = 0; d < D; ++d) kt[d * BS + j] = load<DT>(a.k_cache, base + j * key_stride + d);
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
        }
        const int k0 = b * BS;
        for (int t = 0; t < ntok; ++t) {
            const int vhi = std::min(end_key(t), k0 + BS) - k0;  // visible in this block: [vlo, vhi)
            const int vlo = std::max(first_key(t), k0) - k0;
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
#if BRINE_BF16_SCORES
    // bfloat16 with 16-key blocks and head_dim a multiple of 32: the weights are rounded to bfloat16 (as
    // transformers rounds its probabilities before multiplying the values), summed as rounded, and weights x
    // values come from vdpbf16ps over key pairs (2i, 2i + 1) of the block, all 8 pairs in order (a hidden
    // key's weight is exactly 0). The accumulator's lanes hold the dimensions in unpack order (see below);
    // the output is written back in order.
    constexpr bool bf16_values = bf16_scores && DC % 32 == 0;
    // [8 key pairs][DC / 16]: (v[2i][d], v[2i + 1][d]) dwords (a plain array: std::vector would not keep
    // __m512i's 64-byte alignment)
    alignas(64) __m512i vpairs[bf16_values ? 8 * DC / 16 : 1];
#else
    constexpr bool bf16_values = false;
#endif
    for (int b = b_lo; b < b_hi; ++b) {
        const int64_t base = (static_cast<int64_t>(table[b]) * BS * a.kv_heads + kvh) * D;
        const int col = (b - b_lo) * BS;
        const int k0 = b * BS;
        if constexpr (bf16_values) {
#if BRINE_BF16_SCORES
            const uint16_t* vc = static_cast<const uint16_t*>(a.v_cache);
            for (int jp = 0; jp < 8; ++jp)
                for (int c = 0; c < DC / 32; ++c) {
                    const __m512i v0 = _mm512_loadu_si512(vc + base + (2 * jp) * key_stride + 32 * c);
                    const __m512i v1 = _mm512_loadu_si512(vc + base + (2 * jp + 1) * key_stride + 32 * c);
                    // lane i of lo: d = 32c + 8(i / 4) + i % 4; of hi: the same + 4
                    vpairs[jp * DC / 16 + 2 * c] = _mm512_unpacklo_epi16(v0, v1);
                    vpairs[jp * DC / 16 + 2 * c + 1] = _mm512_unpackhi_epi16(v0, v1);
                }
#endif
        } else {
            for (int j = 0; j < BS; ++j)
                for (int d = 0; d < D; ++d) vf[j * D + d] = load<DT>(a.v_cache, base + j * key_stride + d);
        }
        for (int t = 0; t < ntok; ++t) {
            const int vhi = std::min(end_key(t), k0 + BS) - k0;  // visible in this block: [vlo, vhi)
            const int vlo = std::max(first_key(t), k0) - k0;
            if (vhi <= vlo) continue;
            for (int g = 0; g < G; ++g) {
                const int r = t * G + g;
                const float* sr = sc + static_cast<int64_t>(r) * span + col;
                const float m = mx[r * BW];
                float* lr = ls + r * BW;
                float p[BSC ? BSC : kMaxBlock];
                uint16_t pb[bf16_values ? 16 : 1];  // bfloat16 weights: summed as they are multiplied
                for (int j = 0; j < BS; ++j) {
                    const float e = exp_nonpos(sr[j] - m);
                    p[j] = (j >= vlo && j < vhi) ? e : 0.0f;
                    if constexpr (bf16_values) {
                        pb[j] = f32_to_bf16(p[j]);
                        p[j] = bf16_to_f32(pb[j]);
                    }
                    lr[j] += p[j];
                }
                if constexpr (bf16_values) {
#if BRINE_BF16_SCORES
                    // Output += weights x values, key pair by key pair in order (all 8: hidden weights are 0).
                    __m512 o[DC / 16];
                    float* ar = acc + r * D;
                    for (int i = 0; i < DC / 16; ++i) o[i] = _mm512_loadu_ps(ar + 16 * i);
                    for (int jp = 0; jp < 8; ++jp) {
                        const uint32_t pair = pb[2 * jp] | (static_cast<uint32_t>(pb[2 * jp + 1]) << 16);
                        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pair));
                        for (int i = 0; i < DC / 16; ++i) o[i] = _mm512_dpbf16_ps(o[i], (__m512bh)vpairs[jp * DC / 16 + i], w);
                    }
                    for (int i = 0; i < DC / 16; ++i) _mm512_storeu_ps(ar + 16 * i, o[i]);
#endif
                } else {
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
    }
    for (int t = 0; t < ntok; ++t) {
        for (int g = 0; g < G; ++g) {
            const int r = t * G + g;
            const int64_t oo = (static_cast<int64_t>(tok0 + t) * a.heads + kvh * G + g) * D;
            float* lanes = ls + r * BW;  // the sum of weights: a fixed halving tree over the key lanes
            for (int w = BW / 2; w >= 1; w /= 2)
                for (int j = 0; j < w; ++j) lanes[j] += lanes[j + w];
            const float lr = lanes[0] > 0.0f ? lanes[0] : 1.0f;  // a row that sees no key (not causal): 0
            for (int d = 0; d < D; ++d) {
                int at = d;  // where dimension d accumulated
                if constexpr (bf16_values) {
                    const int c = d / 32, l = (d % 32) / 8, k = d % 8;
                    at = (2 * c + (k >= 4)) * 16 + 4 * l + k % 4;
                }
                store<DT>(a.out, oo + d, acc[r * D + at] / lr);
            }
        }
    }
}

template <int DT, int BSC, int DC>
void run_items(const Args& a, int threads) {
    const int64_t work = a.num_items * a.kv_heads;
#pragma omp parallel num_threads(threads)
    {
        std::vector<float> buf;
#pragma omp for schedule(dynamic, 1)
        for (int64_t w = 0; w < work; ++w)
            attend_item<DT, BSC, DC>(a, w / a.kv_heads, static_cast<int>(w % a.kv_heads), buf);
    }
}

template <int DT>
void run(const Args& a, int threads) {
    if (a.block_size == 16 && a.head_dim == 64) return run_items<DT, 16, 64>(a, threads);
    if (a.block_size == 16 && a.head_dim == 128) return run_items<DT, 16, 128>(a, threads);
    run_items<DT, 0, 0>(a, threads);
}

}  // namespace

extern "C" {

// Bumped whenever the arguments change: the loader refuses a library that says otherwise.
int brine_paged_attention_abi() { return 1; }

int brine_paged_attention(int dtype, const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k_cache,
                          const void* v_cache, void* out, const int32_t* items, int64_t num_items,
                          const int32_t* tables, int64_t table_width, int heads, int kv_heads, int head_dim,
                          int block_size, int causal, int window, float scale, int threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || head_dim <= 0 || head_dim > kMaxDim || block_size <= 0 ||
        block_size > kMaxBlock || threads <= 0)
        return 1;
    Args a{q,     q_stride_t, q_stride_h, k_cache,  v_cache,  out,        items,     num_items, tables,
           table_width, heads,      kv_heads,   head_dim, block_size, causal, window, scale};
    switch (dtype) {
        case kDtypeF32: run<kDtypeF32>(a, threads); return 0;
        case kDtypeBF16: run<kDtypeBF16>(a, threads); return 0;
        case kDtypeF16: run<kDtypeF16>(a, threads); return 0;
        default: return 2;
    }
}

}  // extern "C"
