// The Q8-activation path of quant_linear.cpp (wtype bit kQ8Act), included inside its anonymous namespace: it
// uses that file's Kind, Args, Panel, load_scales, prefetch_record, store_rows, RowGroups, with_rows, scratch
// and widen.
//
// What: llama.cpp's CPU route. Each row of x is cut into the GGUF's blocks of 32 inputs and quantized per block
// to int8 (dx = amax / 127, qx = round-half-even(x * 127 / amax), so |qx| <= 127), and every block's dot
// product with the weights' q is an exact integer:
//   P = sum over the block's 32 inputs of q[n][i] qx[i]                        (int32, exact)
//   total = fma(d[n][b] * dx[b], P, total); total = fma(m[n][b], sx[b], total)  (sx = dx * sum of qx)
//   (two scales: P0 over inputs 0-15 and P1 over 16-31, total = fma(d0 dx, P0, total), then fma(d1 dx, P1, total))
//   y = round(total + bias[n]) to the output dtype
// Why: on CPUs without AVX512-BF16 the float32 path is bound by its fmas (a 32-input block is 64 of them per row
// on AVX2), where vpmaddubsw / vpdpbusd take 4 inputs of 8 columns per instruction. The cost is the rounding of
// x to 8 bits per block, measured against transformers in docs/determinism.md (about bfloat16's).
// Invariance: the integer sums are exact and every float step is the same IEEE operation on every tier, in the
// same order per row, so a row's bits depend on nothing but its own x and the weights, and are the same on the
// AVX512, AVX2 and portable builds alike.
#pragma once

constexpr int kQuads = kBlock / 4;  // 4 inputs of one column side by side: one vpmaddubsw / vpdpbusd operand
// A tile's block as the dot products read it: q as [quad][column][4] bytes (the portable build: [input][column])
// (u8 0..15 for 4-bit kinds, int8 for the others), then d (or d0) and m (or d1) as 16 float32 each.
constexpr int64_t kQ8Scales = kQuads * kTile * 4;
constexpr int64_t kQ8Block = kQ8Scales + 2 * kTile * 4;
static_assert(kQ8Block % sizeof(VF) == 0, "a block's panel is whole VF units (Panel's storage)");

// Rows per group: each row keeps two 256-bit integer sums per block (four for two scales) beside its float
// total; AVX512's 32 registers hold more of them.
#if defined(BRINE_SIMD_AVX512)
constexpr int kQ8Rows = 8;
#else
constexpr int kQ8Rows = 4;
#endif

// x as Q8: row r's block b is q[r k + 32 b ...], d[r blocks + b], s[r blocks + b].
struct Q8Rows {
    int8_t* q;
    float* d;
    float* s;
    int64_t k, blocks;
};

// One row quantized, block by block, in scalar IEEE float arithmetic: the same bytes on every tier. A block
// holding a NaN or an infinity gets d = s = NaN (and q = 0), so its rows come out NaN, as the float path's do.
template <typename T>
inline void quantize_row(const T* x, const Q8Rows& out, int64_t r) {
    for (int64_t b = 0; b < out.blocks; ++b) {
        float v[kBlock];
        float amax = 0.0f;
        bool finite = true;
        for (int i = 0; i < kBlock; ++i) {
            v[i] = widen(x[b * kBlock + i]);
            finite = finite && std::isfinite(v[i]);
            const float a = std::fabs(v[i]);
            amax = a > amax ? a : amax;
        }
        int8_t* q = out.q + r * out.k + b * kBlock;
        float& d = out.d[r * out.blocks + b];
        float& s = out.s[r * out.blocks + b];
        if (!finite || amax == 0.0f) {
            std::memset(q, 0, kBlock);
            d = s = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
            continue;
        }
        const float scale = 127.0f / amax;
        int sum = 0;
        for (int i = 0; i < kBlock; ++i) {
            const int qi = static_cast<int>(std::nearbyint(v[i] * scale));  // |v scale| <= 127 (+ rounding)
            q[i] = static_cast<int8_t>(qi);
            sum += qi;
        }
        d = amax / 127.0f;
        s = d * static_cast<float>(sum);
    }
}

// One record into a kQ8Block. 4-bit: input 2p + e of column 4 L + c is nibble (p % 4) / 2 of byte 64 (p / 4) +
// 8 (p % 2) + 16 L + 2 c + e; int8: byte 32 p + 2 c + e (quant_linear.cpp's header).
inline void unpack_q8(const uint8_t* rec, Kind kind, uint8_t* out) {
    VF dm[2];
    load_scales(rec, kind, dm);
    vstore(reinterpret_cast<float*>(out + kQ8Scales), dm[0]);
    vstore(reinterpret_cast<float*>(out + kQ8Scales) + kTile, dm[1]);
    const uint8_t* qs = rec + kind.scales_bytes();
#if defined(BRINE_SIMD_AVX512) || defined(BRINE_SIMD_AVX2)
    if (!kind.int8()) {
        // A 64-byte chunk j holds inputs 8j .. 8j + 7; in each 16-byte lane (4 columns), bytes 2c, 2c + 1, 8 + 2c,
        // 9 + 2c are column c's inputs 8j .. 8j + 3 (low nibbles) and 8j + 4 .. 8j + 7 (high nibbles).
        const __m256i order = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3,
                                               10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
        const __m256i low4 = _mm256_set1_epi8(0x0f);
        for (int j = 0; j < 4; ++j)
            for (int s = 0; s < 2; ++s) {  // columns 0-7, then 8-15
                const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * j + 32 * s));
                const __m256i lo = _mm256_shuffle_epi8(_mm256_and_si256(v, low4), order);
                const __m256i hi = _mm256_shuffle_epi8(_mm256_and_si256(_mm256_srli_epi16(v, 4), low4), order);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * (2 * j) + 32 * s), lo);
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * (2 * j + 1) + 32 * s), hi);
            }
        return;
    }
    for (int j = 0; j < kQuads; ++j) {  // pairs 2j and 2j + 1: their 16-bit (q, q) words interleaved per column
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * j));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * j + 32));
        const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);  // columns 0-3 8-11, 4-7 12-15
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * j), _mm256_permute2x128_si256(lo, hi, 0x20));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * j + 32), _mm256_permute2x128_si256(lo, hi, 0x31));
    }
#else
    // The portable build's own order, [input][column]: its plain loops then run over 16 adjacent columns.
    for (int i = 0; i < kBlock; ++i) {
        const int p = i / 2, e = i % 2;
        for (int c = 0; c < kTile; ++c) {
            uint8_t v;
            if (kind.int8()) {
                v = qs[32 * p + 2 * c + e];
            } else {
                const uint8_t byte = qs[64 * (p / 4) + 8 * (p % 2) + 16 * (c / 4) + 2 * (c % 4) + e];
                v = static_cast<uint8_t>((byte >> (4 * ((p % 4) / 2))) & 0x0f);
            }
            out[i * kTile + c] = v;
        }
    }
#endif
}

#if defined(BRINE_SIMD_AVX512) || defined(BRINE_SIMD_AVX2)
inline VF to_vf(__m256i lo, __m256i hi) {  // int32 sums of columns 0-7 and 8-15, exact as float32 (< 2^24)
#if defined(BRINE_SIMD_AVX512)
    return {_mm512_insertf32x8(_mm512_castps256_ps512(_mm256_cvtepi32_ps(lo)), _mm256_cvtepi32_ps(hi), 1)};
#else
    return {_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi)};
#endif
}

// u8 a times s8 b, 4 at a time, added to the int32 lanes of acc, exactly: a = |q| <= 128 and |b| <= 127, so
// vpmaddubsw's int16 pair sums (at most 2 x 128 x 127 = 32512) never saturate.
inline __m256i dot4(__m256i acc, __m256i a, __m256i b) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1)));
#endif
}
#endif

// The block's P (P0 and P1 for two scales) for R rows, as float32 vectors: p[r][0], p[r][1].
template <int R>
inline void block_p(const uint8_t* w, Kind kind, const Q8Rows& x, int64_t r0, int64_t b, VF (*p)[2]) {
    const bool halves = kind.halves();
#if defined(BRINE_SIMD_AVX512) || defined(BRINE_SIMD_AVX2)
    const int8_t* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = x.q + (r0 + r) * x.k + b * kBlock;
    __m256i acc[R][2][2];  // [row][half of the block's inputs][columns 0-7, 8-15]
    for (int r = 0; r < R; ++r)
        for (int h = 0; h < 2; ++h) acc[r][h][0] = acc[r][h][1] = _mm256_setzero_si256();
    // f(j, r, w0, w1, xv) for each quad j of the block and each row r: the quad's q for columns 0-7 and 8-15,
    // and row r's 4 inputs broadcast to every column
    const auto quads = [&](auto&& f) {
        for (int j = 0; j < kQuads; ++j) {
            const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j));
            const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 64 * j + 32));
            for (int r = 0; r < R; ++r) {
                int32_t four;
                std::memcpy(&four, xr[r] + 4 * j, 4);
                f(j, r, w0, w1, _mm256_set1_epi32(four));
            }
        }
    };
    if (!kind.int8()) {  // q in 0..15: vpmaddubsw's unsigned operand as it is
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        quads([&](int, int r, __m256i w0, __m256i w1, __m256i xv) {
            acc[r][0][0] = _mm256_dpbusd_epi32(acc[r][0][0], w0, xv);
            acc[r][0][1] = _mm256_dpbusd_epi32(acc[r][0][1], w1, xv);
        });
#else
        // 8 pair sums of <= 2 x 15 x 127 each fit int16 (30480): widen once per block
        __m256i s16[R][2];
        for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
        quads([&](int, int r, __m256i w0, __m256i w1, __m256i xv) {
            s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_maddubs_epi16(w0, xv));
            s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_maddubs_epi16(w1, xv));
        });
        const __m256i ones = _mm256_set1_epi16(1);
        for (int r = 0; r < R; ++r) {
            acc[r][0][0] = _mm256_madd_epi16(s16[r][0], ones);
            acc[r][0][1] = _mm256_madd_epi16(s16[r][1], ones);
        }
#endif
    } else {  // signed q: |q| as the unsigned operand, q's sign moved onto x
        quads([&](int j, int r, __m256i w0, __m256i w1, __m256i xv) {
            const int h = halves && j >= kQuads / 2 ? 1 : 0;
            acc[r][h][0] = dot4(acc[r][h][0], _mm256_abs_epi8(w0), _mm256_sign_epi8(xv, w0));
            acc[r][h][1] = dot4(acc[r][h][1], _mm256_abs_epi8(w1), _mm256_sign_epi8(xv, w1));
        });
    }
    for (int r = 0; r < R; ++r) {
        p[r][0] = to_vf(acc[r][0][0], acc[r][0][1]);
        p[r][1] = halves ? to_vf(acc[r][1][0], acc[r][1][1]) : vzero();
    }
#else
    const auto sum = [&](const auto* q, const int8_t* xr, int i0, int i1, float* out) {
        int32_t sums[kTile] = {};
        for (int i = i0; i < i1; ++i)
            for (int c = 0; c < kTile; ++c) sums[c] += static_cast<int32_t>(q[i * kTile + c]) * xr[i];
        for (int c = 0; c < kTile; ++c) out[c] = static_cast<float>(sums[c]);
    };
    for (int r = 0; r < R; ++r) {
        const int8_t* xr = x.q + (r0 + r) * x.k + b * kBlock;
        p[r][1] = vzero();
        if (!kind.int8()) sum(w, xr, 0, kBlock, p[r][0].v);
        else if (!halves) sum(reinterpret_cast<const int8_t*>(w), xr, 0, kBlock, p[r][0].v);
        else {
            sum(reinterpret_cast<const int8_t*>(w), xr, 0, kBlock / 2, p[r][0].v);
            sum(reinterpret_cast<const int8_t*>(w), xr, kBlock / 2, kBlock, p[r][1].v);
        }
    }
#endif
}

// One row group against one tile's unpacked blocks (panel: blocks x kQ8Block), with the header's arithmetic.
template <int R>
void group_q8(const Args& a, const Q8Rows& x, const uint8_t* panel, int64_t tile, int64_t r0) {
    VF total[R];
    for (int r = 0; r < R; ++r) total[r] = vzero();
    const bool halves = a.kind.halves(), min = a.kind.min();
    for (int64_t b = 0; b < x.blocks; ++b) {
        const uint8_t* w = panel + b * kQ8Block;
        VF p[R][2];
        block_p<R>(w, a.kind, x, r0, b, p);
        const VF d = vload(reinterpret_cast<const float*>(w + kQ8Scales));
        const VF m = vload(reinterpret_cast<const float*>(w + kQ8Scales) + kTile);
        for (int r = 0; r < R; ++r) {
            const VF dx = vset1(x.d[(r0 + r) * x.blocks + b]);
            total[r] = vfmadd(vmul(d, dx), p[r][0], total[r]);
            if (halves) total[r] = vfmadd(vmul(m, dx), p[r][1], total[r]);
            else if (min) total[r] = vfmadd(m, vset1(x.s[(r0 + r) * x.blocks + b]), total[r]);
        }
    }
    store_rows<R>(a, total, tile, r0);
}

// The threads quantize the rows together, then share out the tiles (runs of neighbouring tiles, as the float
// path does); each unpacks a tile's records once and runs every row group over them.
template <typename T>
void run_q8(const Args& a, const T* x, int64_t x_stride, const uint8_t* w, int threads) {
    const int64_t blocks = a.k / kBlock, tiles = (a.n + kTile - 1) / kTile, bytes = a.kind.bytes();
    uint8_t* mem = scratch(static_cast<size_t>(a.m * a.k + 2 * a.m * blocks * 4 + 64));
    float* d = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(mem + a.m * a.k) + 63) & ~uintptr_t{63});
    const Q8Rows q{reinterpret_cast<int8_t*>(mem), d, d + a.m * blocks, a.k, blocks};
    const RowGroups groups(a.m, kQ8Rows);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < a.m; ++r) quantize_row(x + r * x_stride, q, r);
        // (past the omp for's barrier: every row is quantized)
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        // A thread's tile of unpacked blocks, kept across calls as the float path's panels are (kQ8Block is
        // 10 VF-sized, 64-byte units)
        static thread_local Panel storage;
        uint8_t* panel = reinterpret_cast<uint8_t*>(storage.resize(blocks * kQ8Block / sizeof(VF)));
        for (int64_t t = tiles * me / team; t < tiles * (me + 1) / team; ++t) {
            const uint8_t* rec = w + t * blocks * bytes;
            for (int64_t b = 0; b < blocks; ++b) {
                prefetch_record(rec + b * bytes, a.kind);
                unpack_q8(rec + b * bytes, a.kind, panel + b * kQ8Block);
            }
            for (int64_t g = 0; g < groups.count; ++g) {
                const int64_t r0 = groups.first(g);
                with_rows<1, kQ8Rows>(groups.rows(g), [&](auto R) { group_q8<R.value>(a, q, panel, t, r0); });
            }
        }
    }
}
