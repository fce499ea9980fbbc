// Quantized matrix-vector products for small batches (decode): weights stay in their GGML
// blocks on the device, activations are quantized to Q8_1 once per step, and each 32-element
// block product is integer arithmetic with dp4a. Numerics: kernels/src/quant.rs (Q8_1
// quantization, bit for bit) and kernels/src/dot.rs (block dot products; f32 sums in another
// order, so results agree to rounding).
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
    } else if (TY == GGML_Q5_0 || TY == GGML_Q5_1) {
        // Element k's fifth bit is bit k of qh (Q5_0: d, qh, qs; Q5_1: d, m, qh, qs).
        uint32_t qh;
        if (TY == GGML_Q5_0) {
            qh = (uint32_t)load_i32_a2(wb + 2);
        } else {
            mw = f16_to_f32(load_u16(wb + 2));
            qh = (uint32_t)load_i32_a4(wb + 4);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int q = TY == GGML_Q5_0 ? load_i32_a2(wb + 6 + 4 * i)
                                          : load_i32_a4(wb + 8 + 4 * i);
            lo[i] = (q & 0x0F0F0F0F) | spread_bit4(qh >> (4 * i));
            hi[i] = ((q >> 4) & 0x0F0F0F0F) | spread_bit4(qh >> (16 + 4 * i));
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) w8[i] = load_i32_a2(wb + 2 + 4 * i);
    }
#pragma unroll
    for (int j = 0; j < MV_MAX_BATCH; ++j) {
        if (j < batch) {
            const uint8_t* x = xb + j * xs;
            int xq[8];
            const float dx = load_q8_1_values(x, xq);
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
                if (TY == GGML_Q4_0 || TY == GGML_Q5_0) {
                    // (q - 8) . x exactly (Q5_0: q - 16): the offset times the exact integer
                    // sum of x.
                    int sumx = 0;
#pragma unroll
                    for (int i = 0; i < 8; ++i) sumx = dp4a(0x01010101, xq[i], sumx);
                    const int offset = TY == GGML_Q4_0 ? 8 : 16;
                    acc[j] += dw * dx * (float)(sumi - offset * sumx);
                } else {
                    // The CPU's block-sum form: d_w d_x sum(q_w q_x) + m_w s_x.
                    const float sx = f16_to_f32(load_u16(x + 2));
                    acc[j] += fmaf(dw * dx, (float)sumi, mw * sx);
                }
            }
        }
    }
}

// Sub-block `sub` (32 elements, 0..8) of a K-quant super-block against `batch` Q8_1 activation
// blocks (xb: the one covering the same 32 elements; stride xs bytes), added into acc[0..batch).
// Every sum inside a sub-block is exact in integers (the minimum and Q6_K's -32 offset through
// the exact sum of the activation quants); one f32 product per sub-block and row.
template <int TY>
DEVICE void kblock_products(const uint8_t* __restrict__ wb, int sub,
                            const uint8_t* __restrict__ xb, long long xs, int batch, float* acc) {
    int w8[8];
    float d, dmin = 0.0f;
    int sc = 0, m = 0, sc0 = 0, sc1 = 0;
    if (TY == GGML_Q4_K || TY == GGML_Q5_K) {
        // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]. Sub-block 2p + h is nibble h of
        // qs[32p .. 32p + 32]; Q5_K's fifth bit of element l is bit `sub` of qh[l].
        d = f16_to_f32(load_u16(wb));
        dmin = f16_to_f32(load_u16(wb + 2));
        scale_min_k4(wb + 4, sub, &sc, &m);
        const uint8_t* qs = wb + (TY == GGML_Q4_K ? 16 : 48) + 32 * (sub / 2);
        const int shift = 4 * (sub % 2);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            w8[i] = (load_i32_a4(qs + 4 * i) >> shift) & 0x0F0F0F0F;
            if (TY == GGML_Q5_K) {
                w8[i] |= ((load_i32_a4(wb + 16 + 4 * i) >> sub) & 0x01010101) << 4;
            }
        }
    } else {
        // Q6_K: ql[128], qh[64], scales[16] (i8, one per 16 elements), d; 2-byte aligned.
        // Half h = sub / 4, run r = sub % 4: low nibbles of ql[64h + 32(r % 2) + l] (high ones
        // for r >= 2) and bits 2r, 2r + 1 of qh[32h + l]; values 0..64, offset -32.
        d = f16_to_f32(load_u16(wb + 208));
        const int half = sub / 4, r = sub % 4;
        const uint8_t* ql = wb + 64 * half + 32 * (r % 2);
        const uint8_t* qh = wb + 128 + 32 * half;
        const int shift = 4 * (r / 2);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            w8[i] = ((load_i32_a2(ql + 4 * i) >> shift) & 0x0F0F0F0F) |
                    (((load_i32_a2(qh + 4 * i) >> (2 * r)) & 0x03030303) << 4);
        }
        sc0 = (int)(int8_t)wb[192 + 2 * sub];
        sc1 = (int)(int8_t)wb[192 + 2 * sub + 1];
    }
#pragma unroll
    for (int j = 0; j < MV_MAX_BATCH; ++j) {
        if (j < batch) {
            const uint8_t* x = xb + j * xs;
            int xq[8];
            const float dx = load_q8_1_values(x, xq);
            int sumi0 = 0, sumi1 = 0, sumx0 = 0, sumx1 = 0;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                sumi0 = dp4a(w8[i], xq[i], sumi0);
                sumi1 = dp4a(w8[4 + i], xq[4 + i], sumi1);
                sumx0 = dp4a(0x01010101, xq[i], sumx0);
                sumx1 = dp4a(0x01010101, xq[4 + i], sumx1);
            }
            if (TY == GGML_Q6_K) {
                // Two 16-element groups, each with its own scale: sc * (q - 32) . x.
                const int s = sc0 * (sumi0 - 32 * sumx0) + sc1 * (sumi1 - 32 * sumx1);
                acc[j] += d * dx * (float)s;
            } else {
                // d sc q . x - dmin m sum(x), per sub-block.
                acc[j] += dx * (d * (float)(sc * (sumi0 + sumi1)) -
                                dmin * (float)(m * (sumx0 + sumx1)));
            }
        }
    }
}

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
    for (int b = lane; b < nb; b += WARP) {
        const uint8_t* xb = x + (long long)b * Q8_1_BYTES;
        if constexpr (SUB == 1) {
            block_products<TY>(wr + b * BYTES, xb, xs, batch, acc);
        } else {
            kblock_products<TY>(wr + (b / SUB) * BYTES, b % SUB, xb, xs, batch, acc);
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
