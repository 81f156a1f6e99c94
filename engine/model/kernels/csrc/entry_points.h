// The kernels' C entry points, declared once: decoder_stack.cpp chains them, each source that defines one
// includes this so that the compiler holds its definition to this signature, and the tests' cross-architecture
// digest (tests/engine/csrc/cross_arch_digest.cpp) calls them. Each one's arguments are described where it is
// defined; ctypes binds them in engine/model/kernels/build.py.
#pragma once

#include <cstdint>

extern "C" {
int brine_add_rms_norm(int dtype, const void* h, const void* delta, void* h_sum, const void* weight, void* out,
                       int64_t rows, int64_t n, float eps, int threads);
int brine_silu_mul(int dtype, const void* gate_up, void* out, int64_t rows, int64_t n, int threads);
int brine_rope_write(int dtype, int kv_dtype, const void* qkv, int64_t qkv_stride, const void* cos, const void* sin,
                     const int64_t* slots, void* k_cache, void* v_cache, void* q_out, int64_t tokens, int heads,
                     int kv_heads, int dim, int threads);
int brine_quant_linear(int wtype, const uint8_t* w, int64_t n, int64_t k, int x_dtype, const void* x, int64_t m,
                       int64_t x_stride, const float* bias, void* out, int64_t out_stride, int out_dtype,
                       int threads);
int brine_paged_attention(int dtype, int kv_dtype, const void* q, int64_t q_stride_t, int64_t q_stride_h, const void* k_cache,
                          const void* v_cache, void* out, const int32_t* items, int64_t num_items,
                          const int32_t* tables, int64_t table_width, int heads, int kv_heads, int head_dim,
                          int block_size, int causal, int window, float scale, int threads);
}
