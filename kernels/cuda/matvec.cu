// Quantized matrix-vector products for small batches (decode): weights stay in their GGML
// blocks on the device, activations are quantized to Q8_1 once per step, and each 32-element
// block product is integer arithmetic with dp4a (qdot.cuh, shared with the tiled kernels of
// mmq.cu). Numerics: kernels/src/quant.rs (Q8_1 quantization, bit for bit) and
// kernels/src/dot.rs (block dot products; f32 sums in another order, so results agree to
// rounding).
//
// K-quant weights (Q4_K, Q5_K, Q6_K: 256-element super-blocks) also take Q8_1 activations, as
// llama.cpp's CUDA backend does, where the CPU path quantizes them to Q8_K (one scale per 256
// values): the products are the same up to the activations' rounding, which is finer here.

// x (rows of a multiple of 32 values, contiguous) to Q8_1 blocks: d = amax/127, q = round half
// to even of x*127/amax, s = d*sum(q), d and s stored as f16. One warp per block.
// Grid ceil(n_blocks / (blockDim/32)), block a multiple of 32.
KERNEL void quantize_q8_1(uint8_t* __restrict__ out, const float* __restrict__ x,
                          long long n_blocks) {
    const long long b = (long long)blockIdx.x * (blockDim.x / WARP) + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (b >= n_blocks) return;  // uniform over the warp
    const float v = x[b * 32 + lane];
    const float amax = warp_max_f(fabsf(v));
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    const int q = (int)fminf(fmaxf(rintf(v * id), -128.0f), 127.0f);
    const int sum = warp_sum(q);
    uint8_t* ob = out + b * Q8_1_BYTES;
    if (lane == 0) {
        reinterpret_cast<uint16_t*>(ob)[0] = f32_to_f16(d);
        reinterpret_cast<uint16_t*>(ob)[1] = f32_to_f16(d * (float)sum);
    }
    ob[4 + lane] = (uint8_t)(int8_t)q;
}

#define MV_WARPS 4
#define MV_THREADS (MV_WARPS * WARP)
#define MV_MAX_BATCH 8

// out[j][r] = W[r] . x[j] for j < batch <= MV_MAX_BATCH: one warp per weight row, lanes over
// the row's 32-element blocks (for K-quants, SUB = 8 sub-blocks of each super-block, so a
// lane's block b is sub-block b % 8 of super-block b / 8). x is [batch][cols/32] Q8_1 blocks.
// Grid ceil(rows / MV_WARPS), block MV_THREADS.
template <int TY, int BYTES, int SUB>
DEVICE void matvec_q(float* __restrict__ out, const uint8_t* __restrict__ w,
                     const uint8_t* __restrict__ x, int rows, int cols, int batch) {
    const int row = blockIdx.x * MV_WARPS + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (row >= rows) return;  // uniform over the warp
    const int nb = cols / 32;
    const uint8_t* wr = w + (long long)row * (nb / SUB) * BYTES;
    const long long xs = (long long)nb * Q8_1_BYTES;
    float acc[MV_MAX_BATCH];
#pragma unroll
    for (int j = 0; j < MV_MAX_BATCH; ++j) acc[j] = 0.0f;
    // Lane l adds blocks l, l + 32, l + 64, ... in that order; the tiled kernels (mmq.cu)
    // keep exactly this order per output, and the same warp_sum tree, for bit identity.
    for (int b = lane; b < nb; b += WARP) {
        const uint8_t* xb = x + (long long)b * Q8_1_BYTES;
        WBlock wq;
        unpack_block<TY>(wr + (b / SUB) * BYTES, b % SUB, wq);
#pragma unroll
        for (int j = 0; j < MV_MAX_BATCH; ++j) {
            if (j < batch) acc[j] = block_dot<TY>(wq, xb + j * xs, acc[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < MV_MAX_BATCH; ++j) {
        if (j < batch) {
            const float s = warp_sum(acc[j]);
            if (lane == 0) out[(long long)j * rows + row] = s;
        }
    }
}

#define MATVEC_Q(name, TY, BYTES, SUB)                                                   \
    KERNEL void __launch_bounds__(MV_THREADS)                                             \
        name(float* __restrict__ out, const uint8_t* __restrict__ w,                       \
             const uint8_t* __restrict__ x, int rows, int cols, int batch) {               \
        matvec_q<TY, BYTES, SUB>(out, w, x, rows, cols, batch);                            \
    }

MATVEC_Q(matvec_q4_0, GGML_Q4_0, Q4_0_BYTES, 1)
MATVEC_Q(matvec_q4_1, GGML_Q4_1, Q4_1_BYTES, 1)
MATVEC_Q(matvec_q5_0, GGML_Q5_0, Q5_0_BYTES, 1)
MATVEC_Q(matvec_q5_1, GGML_Q5_1, Q5_1_BYTES, 1)
MATVEC_Q(matvec_q8_0, GGML_Q8_0, Q8_0_BYTES, 1)
MATVEC_Q(matvec_q4_k, GGML_Q4_K, Q4_K_BYTES, QK_K / 32)
MATVEC_Q(matvec_q5_k, GGML_Q5_K, Q5_K_BYTES, QK_K / 32)
MATVEC_Q(matvec_q6_k, GGML_Q6_K, Q6_K_BYTES, QK_K / 32)

// F16 weights: activations rounded to f16 first, as ggml's F16 vec_dot type; f32 products.
// Same grid and block as the quantized kernels; x is [batch][cols] f32. Steps of more rows go
// through the tiled mm_f16 (mmq.cu), which keeps exactly this per-lane fmaf order and
// warp_sum tree for bit identity.
KERNEL void __launch_bounds__(MV_THREADS)
    matvec_f16(float* __restrict__ out, const uint16_t* __restrict__ w,
               const float* __restrict__ x, int rows, int cols, int batch) {
    const int row = blockIdx.x * MV_WARPS + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (row >= rows) return;  // uniform over the warp
    const uint16_t* wr = w + (long long)row * cols;
    float acc[MV_MAX_BATCH];
#pragma unroll
    for (int j = 0; j < MV_MAX_BATCH; ++j) acc[j] = 0.0f;
    for (int c = lane; c < cols; c += WARP) {
        const float wv = f16_to_f32(wr[c]);
#pragma unroll
        for (int j = 0; j < MV_MAX_BATCH; ++j) {
            if (j < batch) acc[j] = fmaf(wv, round_f16(x[(long long)j * cols + c]), acc[j]);
        }
    }
#pragma unroll
    for (int j = 0; j < MV_MAX_BATCH; ++j) {
        if (j < batch) {
            const float s = warp_sum(acc[j]);
            if (lane == 0) out[(long long)j * rows + row] = s;
        }
    }
}
