// The decoder layers of a step as one native call (engine/model/native_stack.py).
//
// Why: a decode step on one row is ~10 kernel calls per layer, each a few microseconds of arithmetic, and from
// Python each call cost ~5-7 us more (module dispatch, tensor allocation, ctypes' argument conversion):
// ~2 ms of a ~10 ms step. Here the same kernels run in the same order with the same arguments, straight
// from C, on buffers allocated once per step; so the bits are the Python path's (the tests compare them).
//
// Per layer, as LlamaForCausalLM's DecoderLayer with the native attention and quantized linears:
//   x = norm_in(h)                      (layer 0; later layers get x from the previous layer's last step)
//   qkv = x Wqkv^T; q = rope(q), k = rope(k) -> cache, v -> cache
//   o = attention(q, cache); attn = o Wo^T
//   h = h + attn; x = norm_post(h)
//   gu = x Wgu^T; act = silu(gate) * up; mlp = act Wdown^T
//   h = h + mlp; x = norm_in of the next layer (the final norm after the last layer)
// In the last layer, with the step's kept rows (keep): the first two lines for every row, the rest for those rows.
// The last two lines are one add_rms_norm call: the sum is rounded to the model dtype before the norm reads
// it, as torch's add followed by the norm does.

#include <cstdint>
#include <cstring>

#include "entry_points.h"

namespace {

// Every integer is int64 and every real a double, so that ctypes' mirror (native_stack.py) has no padding to
// get wrong.
struct Part {
    const uint8_t* records;  // quant_linear's repacked tiles
    int64_t wtype;           // the record kind (quant_linear.cpp's header)
    int64_t n;               // its output features: columns [sum of the earlier parts' n, + n)
};

struct Linear {  // one layer, of 1 to 3 parts side by side in the output (a fused q/k/v of mixed types)
    Part parts[3];
    int64_t num_parts;
    const float* bias;  // [all parts' n] or null
};

struct Layer {
    const void* input_norm;  // [hidden], model dtype
    const void* post_norm;
    Linear qkv, o, gate_up, down;
    void* k_cache;  // [blocks, block_size, kv_heads, head_dim], of kv_dtype
    void* v_cache;
    int64_t window;  // sliding window, 0 for none
};

struct Args {
    // the model; kv_dtype: the caches' (dtype, or float16 under float32: `--kv-cache-dtype float16`)
    int64_t dtype, kv_dtype, num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    double eps, scale;
    const Layer* layers;
    const void* final_norm;
    // the step
    int64_t tokens;
    void* h;  // [T, hidden]: the embeddings in, the last residual out
    void* x;  // [T, hidden]: the final norm of every row, out (of the kept rows only: keep, below)
    const void* cos;  // [T, head_dim / 2], model dtype
    const void* sin;
    const int64_t* slots;  // [T]
    const int32_t* items;  // the attention plan (native_attention.NativePlan)
    int64_t num_items;
    const int32_t* tables;
    int64_t table_width;
    int64_t causal;
    // scratch, model dtype: [T, qkv width], [T, heads * head_dim] twice, [T, hidden], [T, 2 I], [T, I], [T, hidden]
    void *qkv, *q, *o, *attn, *gate_up, *act, *mlp;
    int64_t threads;
    // the layers of this call: [first_layer, end_layer). A step may run its layers in several calls (so that the
    // engine can run another, short step between two of them); h and x carry the state from one call to the
    // next: x holds the next layer's input norm, as this loop leaves it after each layer.
    int64_t first_layer, end_layer;
    // The rows whose final norm is wanted (the step's logits rows), strictly increasing, and the attention plan
    // of those rows alone; null: every row. With them the last layer computes its keys and values for every row
    // (later steps read them) and the rest of the layer only for these rows, and x gets their final norms,
    // [num_keep, hidden] in keep order. A row's arithmetic is its own in every kernel here (none depends on the
    // other rows or on the row count), so a kept row has the bits it has when every row goes through.
    const int64_t* keep;
    int64_t num_keep;
    const int32_t* keep_items;
    int64_t num_keep_items;
};

int linear(const Args& a, const Linear& w, int64_t n, int64_t k, const void* x, void* out, int64_t m) {
    const int dt = static_cast<int>(a.dtype);
    const int64_t bytes = dt == 0 ? 4 : 2;
    int64_t col = 0;
    for (int64_t i = 0; i < w.num_parts; ++i) {
        const Part& p = w.parts[i];
        const int rc = brine_quant_linear(static_cast<int>(p.wtype), p.records, p.n, k, dt, x, m, k,
                                          w.bias ? w.bias + col : nullptr, static_cast<char*>(out) + col * bytes,
                                          n, dt, static_cast<int>(a.threads));
        if (rc) return rc;
        col += p.n;
    }
    return col == n ? 0 : 4;  // the parts must cover the layer's outputs
}

// Rows keep[0..n) of a [rows, width] buffer moved to rows 0..n, in place: keep is strictly increasing, so
// keep[i] >= i and no row is overwritten before it is moved.
void compact_rows(void* buf, int64_t width_bytes, const int64_t* keep, int64_t n) {
    char* b = static_cast<char*>(buf);
    for (int64_t i = 0; i < n; ++i)
        if (keep[i] != i) std::memmove(b + i * width_bytes, b + keep[i] * width_bytes, width_bytes);
}

}  // namespace

extern "C" {

int brine_decoder_stack_abi() { return 5; }

// Returns 0, or 1 + the index of the layer whose kernel refused its arguments (what it wrote up to there is
// garbage then); -1 for a layer range outside [0, num_layers] or kept rows that are not strictly increasing
// rows of the step.
int brine_decoder_stack(const Args* args) {
    const Args& a = *args;
    const int dt = static_cast<int>(a.dtype), kdt = static_cast<int>(a.kv_dtype), th = static_cast<int>(a.threads);
    const int heads = static_cast<int>(a.heads), kvh = static_cast<int>(a.kv_heads), d = static_cast<int>(a.head_dim);
    const float eps = static_cast<float>(a.eps);
    const int64_t t = a.tokens, hidden = a.hidden, inter = a.intermediate;
    const int64_t q_size = a.heads * a.head_dim, qkv_n = q_size + 2 * a.kv_heads * a.head_dim;
    if (a.first_layer < 0 || a.first_layer > a.end_layer || a.end_layer > a.num_layers) return -1;
    if (a.keep) {  // -1 as for a bad layer range: the call is refused before anything runs
        if (a.num_keep < 0 || a.num_keep > t || a.num_keep_items < 0) return -1;
        for (int64_t k = 0; k < a.num_keep; ++k)
            if (a.keep[k] < (k ? a.keep[k - 1] + 1 : 0) || a.keep[k] >= t) return -1;
    }
    if (a.first_layer == 0 && t > 0 &&
        brine_add_rms_norm(dt, a.h, nullptr, nullptr, a.layers[0].input_norm, a.x, t, hidden, eps, th))
        return 1;
    const int64_t bytes = dt == 0 ? 4 : 2;
    for (int64_t i = a.first_layer; i < a.end_layer && t > 0; ++i) {
        const Layer& l = a.layers[i];
        const bool last = i + 1 == a.num_layers;
        const void* next_norm = last ? a.final_norm : a.layers[i + 1].input_norm;
        int rc = linear(a, l.qkv, qkv_n, hidden, a.x, a.qkv, t);
        rc = rc ? rc : brine_rope_write(dt, kdt, a.qkv, qkv_n, a.cos, a.sin, a.slots, l.k_cache, l.v_cache, a.q, t, heads,
                                        kvh, d, th);
        // The last layer's rows from here: the kept ones (their outputs of the attention, then their residuals,
        // moved to the first rows), or all.
        const bool prune = last && a.keep;
        const int64_t m = prune ? a.num_keep : t;
        if (!rc && m == 0) continue;  // no row wants this layer's outputs: its keys and values are all it gives
        const int32_t* items = prune ? a.keep_items : a.items;
        const int64_t num_items = prune ? a.num_keep_items : a.num_items;
        rc = rc ? rc : brine_paged_attention(dt, kdt, a.q, q_size, d, l.k_cache, l.v_cache, a.o, items, num_items,
                                             a.tables, a.table_width, heads, kvh, d, static_cast<int>(a.block_size),
                                             static_cast<int>(a.causal), static_cast<int>(l.window),
                                             static_cast<float>(a.scale), th);
        if (!rc && prune) {
            compact_rows(a.o, q_size * bytes, a.keep, m);
            compact_rows(a.h, hidden * bytes, a.keep, m);
        }
        rc = rc ? rc : linear(a, l.o, hidden, q_size, a.o, a.attn, m);
        rc = rc ? rc : brine_add_rms_norm(dt, a.h, a.attn, a.h, l.post_norm, a.x, m, hidden, eps, th);
        rc = rc ? rc : linear(a, l.gate_up, 2 * inter, hidden, a.x, a.gate_up, m);
        rc = rc ? rc : brine_silu_mul(dt, a.gate_up, a.act, m, inter, th);
        rc = rc ? rc : linear(a, l.down, hidden, inter, a.act, a.mlp, m);
        rc = rc ? rc : brine_add_rms_norm(dt, a.h, a.mlp, a.h, next_norm, a.x, m, hidden, eps, th);
        if (rc) return static_cast<int>(i) + 1;
    }
    return 0;
}

}  // extern "C"
