// One digest of the kernels' outputs on fixed pseudo-random inputs, to compare builds for different CPUs
// (tests/engine/test_kernel_tiers.py: this machine's tiers against an ARM64 build run under qemu). Every C entry
// point a model step calls: the quantized linears (every record kind, float32 and Q8 activations, 1 to 60 rows),
// the attention (float32 and float16 caches, causal and windowed, prefill items, a decode, a short chunk; one and
// two threads), RMSNorm, SiLU x mul and RoPE with the cache write (both cache dtypes). Printed as 16 hex digits.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "entry_points.h"  // engine/model/kernels/csrc

namespace {

uint64_t state = 88172645463325252ull;
uint32_t next() {  // xorshift64: the same sequence on every machine
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return static_cast<uint32_t>(state);
}
float uniform(float scale) { return static_cast<float>(static_cast<int>(next() % 20001) - 10000) * 1e-4f * scale; }
std::vector<float> floats(size_t n, float scale = 1.0f) {
    std::vector<float> v(n);
    for (auto& x : v) x = uniform(scale);
    return v;
}

uint64_t digest = 1469598103934665603ull;  // FNV-1a over the outputs' bytes
template <typename T>
void eat(const std::vector<T>& v) {
    const auto* p = reinterpret_cast<const uint8_t*>(v.data());
    for (size_t i = 0; i < v.size() * sizeof(T); ++i) digest = (digest ^ p[i]) * 1099511628211ull;
}
void check(int rc, const char* what) {
    if (rc != 0) {
        std::printf("%s refused its arguments (%d)\n", what, rc);
        std::exit(1);
    }
}

void linears() {
    const int64_t n = 40, k = 256, tiles = (n + 15) / 16, blocks = k / 32;  // the last tile partial
    // Q4 (+ min), Q4 with float32 scales, int8 (+ min), int8 with two scales per block
    for (int wtype : {0, 2, 2 | 4, 1, 3, 1 | 8}) {
        const bool int8 = wtype & 1, two = (wtype & 2) || (wtype & 8), f32 = wtype & 4;
        const int64_t scales = 16 * (two ? 2 : 1), bytes = scales * (f32 ? 4 : 2) + (int8 ? 512 : 256);
        std::vector<uint8_t> w(static_cast<size_t>(tiles * blocks * bytes));
        for (int64_t r = 0; r < tiles * blocks; ++r) {
            uint8_t* p = w.data() + r * bytes;
            for (int64_t i = 0; i < scales; ++i) {
                if (f32) {
                    const float s = uniform(0.1f);
                    std::memcpy(p + 4 * i, &s, 4);
                } else {  // a normal float16 of either sign
                    const auto h = static_cast<uint16_t>((next() & 0x8000u) | ((5 + next() % 10) << 10) | (next() & 0x3ffu));
                    std::memcpy(p + 2 * i, &h, 2);
                }
            }
            for (int64_t i = scales * (f32 ? 4 : 2); i < bytes; ++i) p[i] = static_cast<uint8_t>(next());
        }
        for (int m : {1, 3, 7, 60}) {
            const auto x = floats(static_cast<size_t>(m * k)), bias = floats(n, 0.1f);
            std::vector<float> out(static_cast<size_t>(m * n));
            for (int q8 : {0, 16}) {
                if (q8 && f32) continue;  // Q8 activations take float16 scales only
                check(brine_quant_linear(wtype | q8, w.data(), n, k, 0, x.data(), m, k, bias.data(), out.data(), n, 0, 2),
                      "brine_quant_linear");
                eat(out);
            }
        }
    }
}

void attention() {
    const int H = 9, KVH = 3, D = 64, BS = 16, ctx = 150, nb = (ctx + BS - 1) / BS + 1;
    const auto kc = floats(static_cast<size_t>(nb * BS * KVH * D)), vc = floats(kc.size());
    std::vector<uint16_t> kh(kc.size()), vh(kc.size());  // float16 in [0.125, 1) of either sign
    for (size_t i = 0; i < kc.size(); ++i)
        kh[i] = static_cast<uint16_t>(0x3000u | (next() & 0x83ffu)), vh[i] = static_cast<uint16_t>(0x3000u | (next() & 0x83ffu));
    std::vector<int32_t> table(nb);
    for (int i = 0; i < nb; ++i) table[i] = nb - 1 - i;  // blocks scattered
    for (int kv16 = 0; kv16 < 2; ++kv16)
        for (int window : {0, 40}) {
            // a prefill in items of 16 tokens (the last shorter), one decode token, a 3-token chunk
            std::vector<int32_t> items;
            int tok = 0;
            for (int p = 0; p < ctx; p += 16) {
                const int n = std::min(16, ctx - p);
                items.insert(items.end(), {tok, n, p, p + n, 0});
                tok += n;
            }
            items.insert(items.end(), {tok, 1, ctx - 1, ctx, 0});
            items.insert(items.end(), {tok + 1, 3, ctx - 3, ctx, 0});
            tok += 4;
            const auto q = floats(static_cast<size_t>(tok * H * D));
            std::vector<float> out(q.size());
            const void* k = kv16 ? static_cast<const void*>(kh.data()) : kc.data();
            const void* v = kv16 ? static_cast<const void*>(vh.data()) : vc.data();
            for (int threads : {1, 2}) {
                check(brine_paged_attention(0, kv16 ? 2 : 0, q.data(), H * D, D, k, v, out.data(), items.data(),
                                            static_cast<int64_t>(items.size() / 5), table.data(), nb, H, KVH, D, BS, 1,
                                            window, 0.125f, threads),
                      "brine_paged_attention");
                eat(out);
            }
        }
}

void elementwise() {
    const int64_t rows = 7, n = 96;
    const auto h = floats(rows * n), delta = floats(rows * n), weight = floats(n), gate_up = floats(rows * 2 * n, 8.0f);
    std::vector<float> sum(rows * n), out(rows * n);
    check(brine_add_rms_norm(0, h.data(), delta.data(), sum.data(), weight.data(), out.data(), rows, n, 1e-5f, 2),
          "brine_add_rms_norm");
    eat(sum), eat(out);
    check(brine_silu_mul(0, gate_up.data(), out.data(), rows, n, 2), "brine_silu_mul");
    eat(out);
    const int heads = 9, kv_heads = 3, dim = 64, tokens = 5, width = (heads + 2 * kv_heads) * dim;
    const auto qkv = floats(tokens * width), cos = floats(tokens * dim / 2), sin = floats(tokens * dim / 2);
    const std::vector<int64_t> slots = {4, 0, 3, 1, 2};
    std::vector<float> q_out(tokens * heads * dim), k32(tokens * kv_heads * dim), v32(k32.size());
    std::vector<uint16_t> k16(k32.size()), v16(k32.size());
    check(brine_rope_write(0, 0, qkv.data(), width, cos.data(), sin.data(), slots.data(), k32.data(), v32.data(),
                           q_out.data(), tokens, heads, kv_heads, dim, 2),
          "brine_rope_write");
    eat(q_out), eat(k32), eat(v32);
    check(brine_rope_write(0, 2, qkv.data(), width, cos.data(), sin.data(), slots.data(), k16.data(), v16.data(),
                           q_out.data(), tokens, heads, kv_heads, dim, 2),
          "brine_rope_write (float16 cache)");
    eat(q_out), eat(k16), eat(v16);
}

}  // namespace

int main() {
    linears();
    attention();
    elementwise();
    std::printf("%016llx\n", static_cast<unsigned long long>(digest));
    return 0;
}
