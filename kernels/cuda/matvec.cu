// Quantized matrix-vector products for small batches (decode): weights stay in their GGML
// blocks on the device, activations are quantized to Q8_1 once per step, and each 32-element
// block product is integer arithmetic with dp4a. Numerics: kernels/src/quant.rs (Q8_1
// quantization, bit for bit) and kernels/src/dot.rs (block dot products; f32 sums in another
// order, so results agree to rounding).

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

// One block of a weight row against `batch` Q8_1 activation blocks (xb, stride xs bytes),
// added into acc[0..batch).
template <int TY>
DEVICE void block_products(const uint8_t* __restrict__ wb, const uint8_t* __restrict__ xb,
                           long long xs, int batch, float* acc) {
    int lo[4], hi[4], w8[8];
    float dw = f16_to_f32(load_u16(wb)), mw = 0.0f;
    if (TY == GGML_Q4_0) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int q = load_i32_a2(wb + 2 + 4 * i);
            lo[i] = q & 0x0F0F0F0F;
            hi[i] = (q >> 4) & 0x0F0F0F0F;
        }
    } else if (TY == GGML_Q4_1) {
        mw = f16_to_f32(load_u16(wb + 2));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int q = load_i32_a4(wb + 4 + 4 * i);
            lo[i] = q & 0x0F0F0F0F;
            hi[i] = (q >> 4) & 0x0F0F0F0F;
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) w8[i] = load_i32_a2(wb + 2 + 4 * i);
    }
#pragma unroll
    for (int j = 0; j < MV_MAX_BATCH; ++j) {
        if (j < batch) {
            const uint8_t* x = xb + j * xs;
            const float dx = f16_to_f32(load_u16(x));
            int xq[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) xq[i] = load_i32_a4(x + 4 + 4 * i);
            int sumi = 0;
            if (TY == GGML_Q8_0) {
#pragma unroll
                for (int i = 0; i < 8; ++i) sumi = dp4a(w8[i], xq[i], sumi);
                acc[j] += dw * dx * (float)sumi;
            } else {
                // Low nibbles are elements 0..16 (activation words 0..3), high ones 16..32.
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    sumi = dp4a(lo[i], xq[i], sumi);
                    sumi = dp4a(hi[i], xq[4 + i], sumi);
                }
                if (TY == GGML_Q4_0) {
                    // (q - 8) . x exactly: the -8 offset times the exact integer sum of x.
                    int sumx = 0;
#pragma unroll
                    for (int i = 0; i < 8; ++i) sumx = dp4a(0x01010101, xq[i], sumx);
                    acc[j] += dw * dx * (float)(sumi - 8 * sumx);
                } else {
                    // The CPU's block-sum form: d_w d_x sum(q_w q_x) + m_w s_x.
                    const float sx = f16_to_f32(load_u16(x + 2));
                    acc[j] += fmaf(dw * dx, (float)sumi, mw * sx);
                }
            }
        }
    }
}

// out[j][r] = W[r] . x[j] for j < batch <= MV_MAX_BATCH: one warp per weight row, lanes over
// the row's blocks. x is [batch][cols/32] Q8_1 blocks. Grid ceil(rows / MV_WARPS), block
// MV_THREADS.
template <int TY, int BYTES>
DEVICE void matvec_q(float* __restrict__ out, const uint8_t* __restrict__ w,
                     const uint8_t* __restrict__ x, int rows, int cols, int batch) {
    const int row = blockIdx.x * MV_WARPS + threadIdx.x / WARP;
    const int lane = threadIdx.x % WARP;
    if (row >= rows) return;  // uniform over the warp
    const int nb = cols / 32;
    const uint8_t* wr = w + (long long)row * nb * BYTES;
    const long long xs = (long long)nb * Q8_1_BYTES;
    float acc[MV_MAX_BATCH];
#pragma unroll
    for (int j = 0; j < MV_MAX_BATCH; ++j) acc[j] = 0.0f;
    for (int b = lane; b < nb; b += WARP) {
        block_products<TY>(wr + b * BYTES, x + (long long)b * Q8_1_BYTES, xs, batch, acc);
    }
#pragma unroll
    for (int j = 0; j < MV_MAX_BATCH; ++j) {
        if (j < batch) {
            const float s = warp_sum(acc[j]);
            if (lane == 0) out[(long long)j * rows + row] = s;
        }
    }
}

#define MATVEC_Q(name, TY, BYTES)                                                        \
    KERNEL void __launch_bounds__(MV_THREADS)                                             \
        name(float* __restrict__ out, const uint8_t* __restrict__ w,                       \
             const uint8_t* __restrict__ x, int rows, int cols, int batch) {               \
        matvec_q<TY, BYTES>(out, w, x, rows, cols, batch);                                 \
    }

MATVEC_Q(matvec_q4_0, GGML_Q4_0, Q4_0_BYTES)
MATVEC_Q(matvec_q4_1, GGML_Q4_1, Q4_1_BYTES)
MATVEC_Q(matvec_q8_0, GGML_Q8_0, Q8_0_BYTES)

// F16 weights: activations rounded to f16 first, as ggml's F16 vec_dot type; f32 products.
// Same grid and block as the quantized kernels; x is [batch][cols] f32.
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
