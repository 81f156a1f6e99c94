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
// on AVX2), where vpmaddubsw / vpdpbusd take 4 inputs of 8 (ymm) or 16 (zmm) columns per instruction. The cost
// is the rounding of x to 8 bits per block, measured against transformers in docs/determinism.md (about
// bfloat16's).
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

// Rows per group: each row keeps one integer sum per column vector (AVX512: one zmm; AVX2: two ymm) through a
// block's quads, beside the quad's weights and its x. 12 rows on AVX512 and 5 or 6 on AVX2 measured no faster. AVX2
// takes 3: its 16 ymm then hold the 6 sums, the quad's 2 weight vectors, the broadcast x and the products with room
// to spare (the emulated AVX2 build, two threads, the default model's four Q4_1 linears of a layer at 2,048 rows,
// variants alternated in one process: 39.6 ms with 4 rows, 35.6 with 3, 39.4 with 2, 42.5 with 5; keeping the
// float totals in registers as well, 35.4). A row's arithmetic is the same in any group, so the same bits.
#if defined(BRINE_SIMD_AVX512)
constexpr int kQ8Rows = 8;
#else
constexpr int kQ8Rows = 3;
#endif
// Tiles (16 columns each) a row group takes at once. AVX512: two, 16 integer sums in registers, so each row's input
// broadcast (a load) feeds two dot products, not one: a thread's loads had kept the loop at ~half the dot
// products' peak (a standalone copy of the loop, in L1, on the AMX Xeon: 4.0 -> 5.0 G vpdpbusd/s). AVX2's 16 ymm
// hold one tile's (two ymm per row), and the portable build has no such loop.
#if defined(BRINE_SIMD_AVX512)
constexpr int kQ8Tiles = 2;
#else
constexpr int kQ8Tiles = 1;
#endif

// x as Q8, in row groups (RowGroups: a group's rows are r0 .. r0 + R - 1): the group's blocks one after the
// other, each as its R rows' 32 bytes, so the kernel reads one stream at constant offsets from one pointer (it
// ran out of general registers with a pointer per row). Row r's block b: q[32 (r0 blocks + b R + r - r0) ...],
// d[r0 blocks + b R + r - r0], s likewise.
struct Q8Rows {
    int8_t* q;
    float* d;
    float* s;
    int64_t blocks;
    int64_t at(int64_t r0, int64_t rows, int64_t r, int64_t b) const { return r0 * blocks + b * rows + r - r0; }
};

// One row quantized, block by block, in IEEE float arithmetic (scalar, or 8 lanes of the same steps): the same
// bytes on every tier. A block holding a NaN or an infinity gets d = s = NaN (and q = 0), so its rows come out
// NaN, as the float path's do.
#if defined(BRINE_SIMD_AVX512) || defined(BRINE_SIMD_AVX2)
inline __m256 load8_widened(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8_widened(const uint16_t* p) {  // bfloat16: its bits are a float32's top half
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 hmax8(__m256 v) {  // every lane the max of v's 8 (exact, in any order)
    v = _mm256_max_ps(v, _mm256_permute2f128_ps(v, v, 1));
    v = _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0x4e));
    return _mm256_max_ps(v, _mm256_shuffle_ps(v, v, 0xb1));
}
inline int32_t hsum8(__m256i v) {  // exact
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
// The scalar code's steps, 8 lanes at a time: the max is exact in any order, 127 / amax is the same IEEE division in
// every lane, vcvtps2dq rounds half to even as nearbyint does, and integer sums are exact. Everything stays in
// registers: an earlier version copied x into a buffer and reduced the max and the sum through stores and scalar
// loads, ~190 cycles a block (6% of a cold q8 prefill on the emulated AVX2 build); this one made that prefill
// 2,245 -> 2,164 ms (in process, q8 and a float16 cache, alternated in one process), the same bytes.
template <typename T>
inline void quantize_row(const T* x, const Q8Rows& out, int64_t r0, int64_t rows, int64_t r) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256 inf = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // packs work in 128-bit lanes: dwords back in order
    for (int64_t b = 0; b < out.blocks; ++b) {
        const int64_t at = out.at(r0, rows, r, b);
        int8_t* q = out.q + at * kBlock;
        __m256 vs[4], a[4], bad[4];
        for (int i = 0; i < 4; ++i) {
            vs[i] = load8_widened(x + b * kBlock + 8 * i);
            a[i] = _mm256_and_ps(vs[i], magnitude);
            bad[i] = _mm256_cmp_ps(a[i], inf, _CMP_NLT_UQ);  // NaN or infinite
        }
        const __m256 amax = hmax8(_mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3])));
        const bool finite = _mm256_movemask_ps(_mm256_or_ps(_mm256_or_ps(bad[0], bad[1]), _mm256_or_ps(bad[2], bad[3]))) == 0;
        const float amax1 = _mm256_cvtss_f32(amax);
        if (!finite || amax1 == 0.0f) {
            std::memset(q, 0, kBlock);
            out.d[at] = out.s[at] = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
            continue;
        }
        const __m256 scale = _mm256_div_ps(_mm256_set1_ps(127.0f), amax);
        __m256i qi[4];
        for (int i = 0; i < 4; ++i) qi[i] = _mm256_cvtps_epi32(_mm256_mul_ps(vs[i], scale));  // |v scale| <= 127 (+ rounding)
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(qi[0], qi[1]), _mm256_packs_epi32(qi[2], qi[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm256_permutevar8x32_epi32(packed, order));
        const int32_t sum = hsum8(_mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3])));
        const float d = amax1 / 127.0f;
        out.d[at] = d;
        out.s[at] = d * static_cast<float>(sum);
    }
}
#else
template <typename T>
inline void quantize_row(const T* x, const Q8Rows& out, int64_t r0, int64_t rows, int64_t r) {
    for (int64_t b = 0; b < out.blocks; ++b) {
        float v[kBlock];
        for (int i = 0; i < kBlock; ++i) v[i] = widen(x[b * kBlock + i]);
        const int64_t at = out.at(r0, rows, r, b);
        int8_t* q = out.q + at * kBlock;
        float amax = 0.0f;
        bool finite = true;
        for (int i = 0; i < kBlock; ++i) {
            finite = finite && std::isfinite(v[i]);
            const float a = std::fabs(v[i]);
            amax = a > amax ? a : amax;
        }
        if (!finite || amax == 0.0f) {
            std::memset(q, 0, kBlock);
            out.d[at] = out.s[at] = finite ? 0.0f : std::numeric_limits<float>::quiet_NaN();
            continue;
        }
        const float scale = 127.0f / amax;
        int sum = 0;
        for (int i = 0; i < kBlock; ++i) {
            const int qi = static_cast<int>(std::nearbyint(v[i] * scale));  // |v scale| <= 127 (+ rounding)
            q[i] = static_cast<int8_t>(qi);
            sum += qi;
        }
        const float d = amax / 127.0f;
        out.d[at] = d;
        out.s[at] = d * static_cast<float>(sum);
    }
}
#endif

// A record's d and m (or d0 and d1) as a panel holds them, 16 float32 each: a kQ8Block's tail, or group_q8_simd's
// kDirect copy of them.
inline void unpack_scales(const uint8_t* rec, Kind kind, float* out) {
    VF dm[2];
    load_scales(rec, kind, dm);
    vstore(out, dm[0]);
    vstore(out + kTile, dm[1]);
}

#if defined(BRINE_SIMD_AVX512) || defined(BRINE_SIMD_AVX2)
// The integer dot products per tier. A vector holds kCols columns of a quad (4 inputs each); `u4` takes q in
// 0..15 as vpmaddubsw's unsigned operand, `s8` moves signed q's sign onto x and takes |q| (<= 128, and
// |x| <= 127, so vpmaddubsw's int16 pair sums, at most 2 x 128 x 127 = 32512, never saturate).
#if defined(BRINE_SIMD_AVX512)
struct Q8Isa {  // one zmm: the tile's 16 columns
    using I = __m512i;
    using F = __m512;
    static constexpr int kVecs = 1;
    static I zero() { return _mm512_setzero_si512(); }
    static I load(const uint8_t* p) { return _mm512_load_si512(p); }
    static void store(uint8_t* p, I v) { _mm512_store_si512(p, v); }
    static I broadcast(int32_t four) { return _mm512_set1_epi32(four); }
#if defined(__AVX512VNNI__)
    static constexpr bool kWide = true;  // vpdpbusd: int32 sums directly
    static I u4(I acc, I w, I x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
    static constexpr bool kWide = false;  // int16 sums, widened once per block (see group_q8)
    static I u4(I acc, I w, I x) { return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, x)); }
#endif
    static I s8(I acc, I w, I x) {
        const I xs = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(w), _mm512_setzero_si512(), x);  // -x where q < 0
#if defined(__AVX512VNNI__)
        return _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(w), xs);
#else
        return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), xs),
                                                       _mm512_set1_epi16(1)));
#endif
    }
    static I widen(I s16) { return _mm512_madd_epi16(s16, _mm512_set1_epi16(1)); }
    static F loadf(const float* p) { return _mm512_load_ps(p); }
    static void storef(float* p, F v) { _mm512_store_ps(p, v); }
    static F set1(float v) { return _mm512_set1_ps(v); }
    static F to_float(I v) { return _mm512_cvtepi32_ps(v); }  // exact: |sum| < 2^24
    static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
};
#else
struct Q8Isa {  // two ymm: columns 0-7, then 8-15
    using I = __m256i;
    using F = __m256;
    static constexpr int kVecs = 2;
    static constexpr bool kWide = false;
    static I zero() { return _mm256_setzero_si256(); }
    static I load(const uint8_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }
    static void store(uint8_t* p, I v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }
    static I broadcast(int32_t four) { return _mm256_set1_epi32(four); }
    static I u4(I acc, I w, I x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)); }
    static I s8(I acc, I w, I x) {
        return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)),
                                                       _mm256_set1_epi16(1)));
    }
    static I widen(I s16) { return _mm256_madd_epi16(s16, _mm256_set1_epi16(1)); }
    static F loadf(const float* p) { return _mm256_load_ps(p); }
    static void storef(float* p, F v) { _mm256_store_ps(p, v); }
    static F set1(float v) { return _mm256_set1_ps(v); }
    static F to_float(I v) { return _mm256_cvtepi32_ps(v); }
    static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
    static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
};
#endif

// Quad j of a record's q as the dot products take it, in registers: unpack_q8 stores them into a panel at 64 j (+ 32
// per ymm), group_q8_simd's kDirect uses them as made. Quads 2i and 2i + 1 of a 4-bit record are the low and high
// nibbles of its 64-byte chunk i: in each 16-byte lane (4 columns), bytes 2c, 2c + 1, 8 + 2c, 9 + 2c are column c's
// inputs 8i .. 8i + 3 (low nibbles) and 8i + 4 .. 8i + 7 (high nibbles). An int8 record's pairs 2j and 2j + 1 have
// their 16-bit (q, q) words interleaved per column.
inline void quad_weights(const uint8_t* qs, bool int8, int j, Q8Isa::I* wj) {
    __m256i half[2];
    if (!int8) {
        const __m256i order = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15, 0, 1, 8, 9, 2, 3,
                                               10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
        const __m256i low4 = _mm256_set1_epi8(0x0f);
        for (int s = 0; s < 2; ++s) {
            __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * (j / 2) + 32 * s));
            if (j % 2) v = _mm256_srli_epi16(v, 4);
            half[s] = _mm256_shuffle_epi8(_mm256_and_si256(v, low4), order);
        }
    } else {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * j));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64 * j + 32));
        const __m256i lo = _mm256_unpacklo_epi16(a, b), hi = _mm256_unpackhi_epi16(a, b);
        half[0] = _mm256_permute2x128_si256(lo, hi, 0x20), half[1] = _mm256_permute2x128_si256(lo, hi, 0x31);
    }
#if defined(BRINE_SIMD_AVX512)
    wj[0] = _mm512_inserti64x4(_mm512_castsi256_si512(half[0]), half[1], 1);
#else
    wj[0] = half[0], wj[1] = half[1];
#endif
}

// One row group against one tile's unpacked blocks (panel: blocks x kQ8Block), with the header's arithmetic.
// Registers: a group's integer sums (R x kVecs per tile) and a quad's weight vectors stay in registers through
// the quad loop; the float totals live in memory, read and written once per block and segment (AVX2's 16
// registers cannot hold both). A block's two scales (halves) are two segments, each finished before the next starts.
// The float steps per row and column are the header's, in its order, so every tier has the same bits.
//
// kDirect: the weights come from the tile's records as stored (rec), each quad made in registers as it is used
// (quad_weights), instead of from a panel unpack_q8 wrote: for a step of one row group (a decode, a warm
// prompt's last token), whose panel would be read once, that saves the panel's stores and loads. The same
// vectors, so the same sums and bits.
//
// kTiles: tiles tile .. tile + kTiles - 1 at once, their panels one after the other (x.blocks x kQ8Block apart):
// each row's broadcast input then feeds a dot product per tile (kQ8Tiles). Per column the same operations in the
// same order as one tile at a time, so the same bits.
template <int R, bool kInt8, int kSegments, bool kDirect = false, int kTiles = 1>
void group_q8_simd(const Args& a, const Q8Rows& x, const uint8_t* panel, int64_t tile, int64_t r0) {
    using I = Q8Isa::I;
    constexpr int kV = Q8Isa::kVecs, kPer = kQuads / kSegments, kLane = kTile / kV;
    static_assert(!kDirect || kTiles == 1, "kDirect reads one tile's records");
    const bool min = a.kind.min();
    const int64_t bytes = a.kind.bytes(), scales_bytes = a.kind.scales_bytes();
    const int64_t panel_bytes = x.blocks * kQ8Block;
    alignas(64) float tot[kTiles][R][kTile] = {};
    alignas(64) float direct_scales[2 * kTile];
    for (int64_t b = 0; b < x.blocks; ++b) {
        const uint8_t* w = kDirect ? panel + b * bytes : panel + b * kQ8Block;  // tile i's: w + i panel_bytes
        const float* scales = reinterpret_cast<const float*>(w + kQ8Scales);
        if constexpr (kDirect) {
            prefetch_record(w, a.kind);
            unpack_scales(w, a.kind, direct_scales);
            scales = direct_scales;
        }
        const int8_t* xb = x.q + x.at(r0, R, r0, b) * kBlock;  // row r0 + r's block: xb + 32 r
        const float* dx_b = x.d + x.at(r0, R, r0, b);          // its scale: dx_b[r]
        const float* sx_b = x.s + x.at(r0, R, r0, b);
        const auto tile_scales = [&](int i) {  // tile i's d and m (or d0 and d1)
            return reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(scales) + i * panel_bytes);
        };
        for (int s = 0; s < kSegments; ++s) {
            I acc[kTiles][R][kV];
            for (int i = 0; i < kTiles; ++i)
                for (int r = 0; r < R; ++r)
                    for (int c = 0; c < kV; ++c) acc[i][r][c] = Q8Isa::zero();
#pragma GCC unroll 8
            for (int j = s * kPer; j < (s + 1) * kPer; ++j) {
                I wj[kTiles][kV];
                if constexpr (kDirect)
                    quad_weights(w + scales_bytes, kInt8, j, wj[0]);
                else
                    for (int i = 0; i < kTiles; ++i)
                        for (int c = 0; c < kV; ++c) wj[i][c] = Q8Isa::load(w + i * panel_bytes + 64 * j + 32 * c);
                for (int r = 0; r < R; ++r) {
                    int32_t four;
                    std::memcpy(&four, xb + kBlock * r + 4 * j, 4);
                    const I xv = Q8Isa::broadcast(four);
                    for (int i = 0; i < kTiles; ++i)
                        for (int c = 0; c < kV; ++c) {
                            // 4-bit q: 8 int16 pair sums of <= 2 x 15 x 127 each fit (30480), widened per block
                            acc[i][r][c] = kInt8 ? Q8Isa::s8(acc[i][r][c], wj[i][c], xv)
                                                 : Q8Isa::u4(acc[i][r][c], wj[i][c], xv);
                            // Integer sums reassociate freely, and GCC turned each chain into a tree whose
                            // products were all live at once (spilled to the stack); an empty asm keeps the sum a
                            // register ("v": any of AVX512's 32, where "x" is the first 16).
#if defined(BRINE_SIMD_AVX512)
                            asm("" : "+v"(acc[i][r][c]));
#else
                            asm("" : "+x"(acc[i][r][c]));
#endif
                        }
                }
            }
            for (int i = 0; i < kTiles; ++i) {
                const float* sc = tile_scales(i);
                for (int r = 0; r < R; ++r) {
                    const Q8Isa::F dx = Q8Isa::set1(dx_b[r]);
                    for (int c = 0; c < kV; ++c) {
                        const I p = kInt8 || Q8Isa::kWide ? acc[i][r][c] : Q8Isa::widen(acc[i][r][c]);
                        const Q8Isa::F d = Q8Isa::loadf(sc + s * kTile + kLane * c);  // d, or d0 then d1
                        float* t = tot[i][r] + kLane * c;
                        Q8Isa::storef(t, Q8Isa::fmadd(Q8Isa::mul(d, dx), Q8Isa::to_float(p), Q8Isa::loadf(t)));
                    }
                }
            }
        }
        if (min)
            for (int i = 0; i < kTiles; ++i) {
                const float* sc = tile_scales(i);
                for (int r = 0; r < R; ++r) {
                    const Q8Isa::F sx = Q8Isa::set1(sx_b[r]);
                    for (int c = 0; c < kV; ++c) {
                        float* t = tot[i][r] + kLane * c;
                        Q8Isa::storef(t, Q8Isa::fmadd(Q8Isa::loadf(sc + kTile + kLane * c), sx, Q8Isa::loadf(t)));
                    }
                }
            }
    }
    for (int i = 0; i < kTiles; ++i) {
        VF total[R];
        for (int r = 0; r < R; ++r) total[r] = vload(tot[i][r]);
        store_rows<R>(a, total, tile + i, r0);
    }
}

template <int R, bool kDirect = false, int kTiles = 1>
void group_q8(const Args& a, const Q8Rows& x, const uint8_t* panel, int64_t tile, int64_t r0) {
    if (!a.kind.int8()) group_q8_simd<R, false, 1, kDirect, kTiles>(a, x, panel, tile, r0);
    else if (!a.kind.halves()) group_q8_simd<R, true, 1, kDirect, kTiles>(a, x, panel, tile, r0);
    else group_q8_simd<R, true, 2, kDirect, kTiles>(a, x, panel, tile, r0);
}
constexpr bool kQ8Direct = true;
#else
// The portable build: the block's P (P0 and P1 for two scales) for R rows, then the header's arithmetic.
template <int R>
inline void block_p(const uint8_t* w, Kind kind, const Q8Rows& x, int64_t r0, int64_t b, VF (*p)[2]) {
    const bool halves = kind.halves();
    const auto sum = [&](const auto* q, const int8_t* xr, int i0, int i1) {
        int32_t sums[kTile] = {};
        for (int i = i0; i < i1; ++i)
            for (int c = 0; c < kTile; ++c) sums[c] += static_cast<int32_t>(q[i * kTile + c]) * xr[i];
        alignas(64) float out[kTile];
        for (int c = 0; c < kTile; ++c) out[c] = static_cast<float>(sums[c]);
        return vload(out);
    };
    for (int r = 0; r < R; ++r) {
        const int8_t* xr = x.q + x.at(r0, R, r0 + r, b) * kBlock;
        p[r][1] = vzero();
        if (!kind.int8()) p[r][0] = sum(w, xr, 0, kBlock);
        else if (!halves) p[r][0] = sum(reinterpret_cast<const int8_t*>(w), xr, 0, kBlock);
        else {
            p[r][0] = sum(reinterpret_cast<const int8_t*>(w), xr, 0, kBlock / 2);
            p[r][1] = sum(reinterpret_cast<const int8_t*>(w), xr, kBlock / 2, kBlock);
        }
    }
}

template <int R, bool kDirect = false, int kTiles = 1>
void group_q8(const Args& a, const Q8Rows& x, const uint8_t* panel, int64_t tile, int64_t r0) {
    static_assert(!kDirect, "the portable panel is no reordering of the records (kQ8Direct)");
    static_assert(kTiles == 1, "the portable build takes one tile at a time (kQ8Tiles)");
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
            const VF dx = vset1(x.d[x.at(r0, R, r0 + r, b)]);
            total[r] = vfmadd(vmul(d, dx), p[r][0], total[r]);
            if (halves) total[r] = vfmadd(vmul(m, dx), p[r][1], total[r]);
            else if (min) total[r] = vfmadd(m, vset1(x.s[x.at(r0, R, r0 + r, b)]), total[r]);
        }
    }
    store_rows<R>(a, total, tile, r0);
}
constexpr bool kQ8Direct = false;  // its panel is [input][column], not a reordering of the records' bytes
#endif

// One record into a kQ8Block. 4-bit: input 2p + e of column 4 L + c is nibble (p % 4) / 2 of byte 64 (p / 4) +
// 8 (p % 2) + 16 L + 2 c + e; int8: byte 32 p + 2 c + e (quant_linear.cpp's header).
inline void unpack_q8(const uint8_t* rec, Kind kind, uint8_t* out) {
    unpack_scales(rec, kind, reinterpret_cast<float*>(out + kQ8Scales));
    const uint8_t* qs = rec + kind.scales_bytes();
#if defined(BRINE_SIMD_AVX512) || defined(BRINE_SIMD_AVX2)
    for (int j = 0; j < kQuads; ++j) {
        Q8Isa::I wj[Q8Isa::kVecs];
        quad_weights(qs, kind.int8(), j, wj);
        for (int c = 0; c < Q8Isa::kVecs; ++c) Q8Isa::store(out + 64 * j + 32 * c, wj[c]);
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

// The threads quantize the rows together, then share out the tiles (runs of neighbouring tiles, as the float
// path does); each unpacks a tile's records and runs a chunk of row groups over them, chunk after chunk.
template <typename T>
void run_q8(const Args& a, const T* x, int64_t x_stride, const uint8_t* w, int threads) {
    const int64_t blocks = a.k / kBlock, tiles = (a.n + kTile - 1) / kTile, bytes = a.kind.bytes();
    uint8_t* mem = scratch(static_cast<size_t>(a.m * a.k + 2 * a.m * blocks * 4 + 64));
    float* d = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(mem + a.m * a.k) + 63) & ~uintptr_t{63});
    const Q8Rows q{reinterpret_cast<int8_t*>(mem), d, d + a.m * blocks, blocks};
    // A step of up to kQ8DirectRows rows is one group, read straight from the records (below); more rows go in groups of
    // kQ8Rows. AVX2's 3-row groups made a 4-row step (a decode of four streams) two groups and ~7% slower.
    constexpr int kQ8DirectRows = kQ8Direct ? std::max(kQ8Rows, 4) : kQ8Rows;
    const RowGroups groups(a.m, a.m <= kQ8DirectRows ? kQ8DirectRows : kQ8Rows);
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups.count; ++g)
            for (int64_t r = groups.first(g); r < groups.first(g) + groups.rows(g); ++r)
                quantize_row(x + r * x_stride, q, groups.first(g), groups.rows(g), r);
        // (past the omp for's barrier: every row is quantized)
        const int64_t team = omp_get_num_threads(), me = omp_get_thread_num();
        if (kQ8Direct && groups.count == 1) {
            // One row group: each record is read once, straight (group_q8_simd's kDirect). A Zen 1 EPYC, 2 threads,
            // quant_q8_bench's one-row Q4_1 linears: 0.24-0.29 -> 0.21 ms, the same bits.
            for (int64_t t = tiles * me / team; t < tiles * (me + 1) / team; ++t)
                with_rows<1, kQ8DirectRows>(groups.rows(0), [&](auto R) {
                    group_q8<R.value, kQ8Direct>(a, q, w + t * blocks * bytes, t, 0);
                });
        } else {
            // A thread's kQ8Tiles tiles of unpacked blocks, one after the other, kept across calls as the float
            // path's panels are (kQ8Block is 10 VF-sized, 64-byte units)
            static thread_local Panel storage;
            uint8_t* panel = reinterpret_cast<uint8_t*>(storage.resize(kQ8Tiles * blocks * kQ8Block / sizeof(VF)));
            const int64_t t_end = tiles * (me + 1) / team;
            // Chunk by chunk of rows (kChunkBytes of Q8 rows: k bytes and two scales per block each), every tile of the
            // thread's over each chunk, so that the chunk's rows stay in L2 across the tiles (each unpacked again per
            // chunk). Streaming all the rows per tile read them from L3 or memory once per tile: at 2,048 rows of 576
            // inputs they are 1.4 MB. The emulated AVX2 build, the default model with q8 activations and a float16
            // cache, a cold 2,029-token prompt in process: 2,349 -> 2,184 ms (384-512 KB chunks measured alike, 256 KB
            // and less slower); the AVX512-VNNI build within noise (1-2%). Each (group, tile) is the same call, so
            // the same bits. Unlike the float path's rows, these are chunked from kChunkBytes, not kChunkFrom.
            const int64_t row_bytes = a.k + 2 * blocks * static_cast<int64_t>(sizeof(float));
            const int64_t chunk = chunk_groups(a.m, row_bytes, kQ8Rows, groups.count, kChunkBytes);
            for (int64_t g0 = 0; g0 < groups.count; g0 += chunk) {
                const int64_t g1 = std::min(groups.count, g0 + chunk);
                for (int64_t t = tiles * me / team; t < t_end;) {
                    const int n = static_cast<int>(std::min<int64_t>(kQ8Tiles, t_end - t));
                    for (int i = 0; i < n; ++i) {
                        const uint8_t* rec = w + (t + i) * blocks * bytes;
                        for (int64_t b = 0; b < blocks; ++b) {
                            prefetch_record(rec + b * bytes, a.kind);
                            unpack_q8(rec + b * bytes, a.kind, panel + (i * blocks + b) * kQ8Block);
                        }
                    }
                    for (int64_t g = g0; g < g1; ++g) {
                        const int64_t r0 = groups.first(g);
                        with_rows<1, kQ8Rows>(groups.rows(g), [&](auto R) {
                            if (n == kQ8Tiles) group_q8<R.value, false, kQ8Tiles>(a, q, panel, t, r0);
                            else group_q8<R.value>(a, q, panel, t, r0);
                        });
                    }
                    t += n;
                }
            }
        }
    }
}
