// One translation unit with every kernel, compiled for the CPU emulator (see emu.h), and a C
// entry point per kernel for the Rust tests (kernels/src/cuda/emu.rs declares the same list).
#define KVGATE_CUDA_EMU 1
#include "../prelude.cuh"
#include "../elementwise.cu"
#include "../attention.cu"
#include "../qdot.cuh"
#include "../matvec.cu"
#include "../mmq.cu"

EMU_LAUNCHER(embed_rows,
             (float* out, const uint8_t* table, const int32_t* ids, int ty, int cols,
              long long row_bytes),
             (out, table, ids, ty, cols, row_bytes))
EMU_LAUNCHER(dequantize_f16,
             (uint16_t* out, const uint8_t* w, int ty, int cols, long long row_bytes,
              long long n_elems),
             (out, w, ty, cols, row_bytes, n_elems))
EMU_LAUNCHER(rms_norm, (float* out, const float* x, const float* w, int n, float eps),
             (out, x, w, n, eps))
EMU_LAUNCHER(rope_norm,
             (float* x, const int32_t* positions, int n_heads, int head_dim, int rope_dim,
              float freq_base),
             (x, positions, n_heads, head_dim, rope_dim, freq_base))
EMU_LAUNCHER(swiglu, (float* out, const float* gate, const float* up, long long n),
             (out, gate, up, n))
EMU_LAUNCHER(add_inplace, (float* x, const float* y, long long n), (x, y, n))
EMU_LAUNCHER(argmax_rows, (int32_t* out, const float* logits, int vocab), (out, logits, vocab))
EMU_LAUNCHER(write_kv,
             (uint16_t* k_cache, uint16_t* v_cache, const float* k, const float* v,
              const int32_t* slots, int n_kv_heads, int head_dim),
             (k_cache, v_cache, k, v, slots, n_kv_heads, head_dim))

#define EMU_ATTENTION(D)                                                                     \
    EMU_LAUNCHER(paged_attention_d##D,                                                       \
                 (float* out, float* part_out, float* part_stats, const float* q,            \
                  const uint16_t* k_cache, const uint16_t* v_cache,                          \
                  const int32_t* block_tables, const int32_t* row_seq,                       \
                  const int32_t* row_ctx, int max_blocks_per_seq, int n_kv_heads, int group, \
                  int max_parts, float scale),                                               \
                 (out, part_out, part_stats, q, k_cache, v_cache, block_tables, row_seq,     \
                  row_ctx, max_blocks_per_seq, n_kv_heads, group, max_parts, scale))
EMU_ATTENTION(32)
EMU_ATTENTION(64)
EMU_ATTENTION(128)
#define EMU_ATTENTION_TILED(D)                                                               \
    EMU_LAUNCHER(paged_attention_tiled_d##D,                                                 \
                 (float* out, float* part_out, float* part_stats, const float* q,            \
                  const uint16_t* k_cache, const uint16_t* v_cache,                          \
                  const int32_t* block_tables, const int32_t* row_seq,                       \
                  const int32_t* row_ctx, const int32_t* tiles, int max_blocks_per_seq,      \
                  int n_kv_heads, int group, int max_parts, float scale),                    \
                 (out, part_out, part_stats, q, k_cache, v_cache, block_tables, row_seq,     \
                  row_ctx, tiles, max_blocks_per_seq, n_kv_heads, group, max_parts, scale))
EMU_ATTENTION_TILED(32)
EMU_ATTENTION_TILED(64)
EMU_ATTENTION_TILED(128)
EMU_LAUNCHER(attention_reduce,
             (float* out, const float* part_out, const float* part_stats,
              const int32_t* row_ctx, int n_heads, int head_dim, int max_parts),
             (out, part_out, part_stats, row_ctx, n_heads, head_dim, max_parts))
EMU_LAUNCHER(quantize_q8_1, (uint8_t* out, const float* x, long long n_blocks),
             (out, x, n_blocks))
#define EMU_MATVEC(name, W)                                                                \
    EMU_LAUNCHER(name, (float* out, const W* w, const uint8_t* x, int rows, int cols, int batch), \
                 (out, w, x, rows, cols, batch))
EMU_MATVEC(matvec_q4_0, uint8_t)
EMU_MATVEC(matvec_q4_1, uint8_t)
EMU_MATVEC(matvec_q5_0, uint8_t)
EMU_MATVEC(matvec_q5_1, uint8_t)
EMU_MATVEC(matvec_q8_0, uint8_t)
EMU_MATVEC(matvec_q4_k, uint8_t)
EMU_MATVEC(matvec_q5_k, uint8_t)
EMU_MATVEC(matvec_q6_k, uint8_t)
EMU_MATVEC(mmq_q4_0, uint8_t)
EMU_MATVEC(mmq_q4_1, uint8_t)
EMU_MATVEC(mmq_q5_0, uint8_t)
EMU_MATVEC(mmq_q5_1, uint8_t)
EMU_MATVEC(mmq_q8_0, uint8_t)
EMU_MATVEC(mmq_q4_k, uint8_t)
EMU_MATVEC(mmq_q5_k, uint8_t)
EMU_MATVEC(mmq_q6_k, uint8_t)
EMU_LAUNCHER(matvec_f16,
             (float* out, const uint16_t* w, const float* x, int rows, int cols, int batch),
             (out, w, x, rows, cols, batch))
EMU_LAUNCHER(mm_f16,
             (float* out, const uint16_t* w, const float* x, int rows, int cols, int batch),
             (out, w, x, rows, cols, batch))

// Launch by kernel name with a cuLaunchKernel-style parameter array (params[i] points at the
// i-th argument's value), so one piece of Rust launch code drives both a real device and this
// emulator (kvgate_kernels::cuda::device::DeviceOps). Returns 0, or -1 for an unknown name.
#include <cstring>
#include <type_traits>
#include <utility>

namespace emu {

template <class... A, std::size_t... I>
void call_with(void (*kernel)(A...), void** params, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<A>*>(params[I])...);
}

template <class... A>
void launch_params(const Launch& l, void (*kernel)(A...), void** params) {
    launch(l, [&] { call_with(kernel, params, std::index_sequence_for<A...>{}); });
}

struct Entry {
    const char* name;
    void (*run)(const Launch&, void**);
};

#define EMU_ENTRY(k) Entry{#k, [](const Launch& l, void** p) { launch_params(l, &::k, p); }}

inline const Entry ENTRIES[] = {
    EMU_ENTRY(embed_rows),     EMU_ENTRY(dequantize_f16),      EMU_ENTRY(rms_norm),
    EMU_ENTRY(rope_norm),      EMU_ENTRY(swiglu),              EMU_ENTRY(add_inplace),
    EMU_ENTRY(argmax_rows),    EMU_ENTRY(write_kv),            EMU_ENTRY(paged_attention_d32),
    EMU_ENTRY(paged_attention_d64), EMU_ENTRY(paged_attention_d128), EMU_ENTRY(attention_reduce),
    EMU_ENTRY(paged_attention_tiled_d32), EMU_ENTRY(paged_attention_tiled_d64),
    EMU_ENTRY(paged_attention_tiled_d128),
    EMU_ENTRY(quantize_q8_1),  EMU_ENTRY(matvec_q4_0),         EMU_ENTRY(matvec_q4_1),
    EMU_ENTRY(matvec_q5_0),    EMU_ENTRY(matvec_q5_1),         EMU_ENTRY(matvec_q8_0),
    EMU_ENTRY(matvec_q4_k),    EMU_ENTRY(matvec_q5_k),         EMU_ENTRY(matvec_q6_k),
    EMU_ENTRY(matvec_f16),
    EMU_ENTRY(mmq_q4_0),       EMU_ENTRY(mmq_q4_1),            EMU_ENTRY(mmq_q5_0),
    EMU_ENTRY(mmq_q5_1),       EMU_ENTRY(mmq_q8_0),            EMU_ENTRY(mmq_q4_k),
    EMU_ENTRY(mmq_q5_k),       EMU_ENTRY(mmq_q6_k),            EMU_ENTRY(mm_f16),
};

}  // namespace emu

extern "C" int emu_launch(const char* name, const emu::Launch* l, void** params) {
    for (const emu::Entry& e : emu::ENTRIES) {
        if (std::strcmp(e.name, name) == 0) {
            e.run(*l, params);
            return 0;
        }
    }
    return -1;
}

// 1 when emu_launch knows kernel `name` (the Rust tests check every kernel of every program).
extern "C" int emu_has_kernel(const char* name) {
    for (const emu::Entry& e : emu::ENTRIES) {
        if (std::strcmp(e.name, name) == 0) return 1;
    }
    return 0;
}
