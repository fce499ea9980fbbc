// Tiled matrix-matrix products for large batches (prefill): one thread block computes a tile
// of weight rows x activation rows, so each weight element is read from global memory once per
// tile of activation rows instead of once per MV_MAX_BATCH (the matvec kernels re-read every
// weight matrix batch / 8 times). Quantized weights (mmq_*): a tile is MMQ_ROWS weight rows x
// MMQ_COLS activation rows; the Q8_1 activation blocks of the tile are staged in shared memory,
// MMQ_DEPTH blocks along K at a time, and read there by every warp; products are the integer
// dp4a block products of qdot.cuh with f32 accumulation. F16 weights (mm_f16, at the end of
// this file): the same scheme over single columns instead of 32-element blocks, with f32
// activations rounded to f16.
//
// Bit identity with matvec.cu (batch invariance: a row's result must not depend on which
// kernel its step size selects). An output of the matvec kernel is the warp_sum, over lanes
// 0..32, of lane l's f32 partial: block_dot over blocks l, l + 32, l + 64, ... in that order.
// Here each warp owns MMQ_WARP_ROWS weight rows, and lane l of it again handles exactly the
// blocks b with b % 32 == l, in increasing order (a stage covers blocks c0 .. c0 + 32, c0 a
// multiple of 32, lane l takes c0 + l), keeping one partial per (row, activation row) of the
// tile — the partial the matvec lane l keeps for that output, operation for operation (same
// qdot.cuh functions, explicit fmaf). The 32 partials of an output are then combined by the
// same butterfly tree as warp_sum (see warp_sum_scatter), so the result is the same float.
// Weight blocks are not staged in shared memory: each is read by exactly one lane, which
// keeps it unpacked in registers for all MMQ_COLS activation rows.

#define MMQ_WARPS 8
#define MMQ_THREADS (MMQ_WARPS * WARP)
// Weight rows per warp (and register tile height: MMQ_WARP_ROWS x MMQ_COLS partials a lane).
#define MMQ_WARP_ROWS 2
#define MMQ_ROWS (MMQ_WARPS * MMQ_WARP_ROWS)
// Activation rows per block: one per lane after the reduce-scatter.
#define MMQ_COLS WARP
// Blocks along K per shared-memory stage: one per lane (the matvec lane mapping).
#define MMQ_DEPTH WARP
#define MMQ_STAGE_WORDS (MMQ_DEPTH * Q8_1_BYTES / 4)
#define MMQ_SMEM_BYTES (MMQ_COLS * MMQ_DEPTH * Q8_1_BYTES)

// v[k] is this lane's partial of output k (32 outputs); returns the total of output `lane`
// over the warp. The pairings are warp_sum's: step o adds the partials of lanes l and l ^ o
// as `own + other`, for o = 16, 8, 4, 2, 1. In warp_sum every lane computes every output;
// here a lane keeps only the half of its outputs whose bit log2(o) matches its own lane bit
// and sends its partner the other half, so each output is the same sums of the same values
// (float addition is commutative, so lane l's own + other equals lane l ^ o's), in 31
// shuffles for 32 outputs instead of 160.
DEVICE float warp_sum_scatter(float (&v)[WARP]) {
    const int lane = threadIdx.x % WARP;
#pragma unroll
    for (int o = WARP / 2; o > 0; o >>= 1) {
        const bool upper = (lane & o) != 0;
#pragma unroll
        for (int k = 0; k < o; ++k) {
            const float keep = upper ? v[k + o] : v[k];
            const float send = upper ? v[k] : v[k + o];
            v[k] = keep + SHFL_XOR(send, o);
        }
    }
    return v[0];
}

// out[j][r] = W[r] . x[j] for all r < rows, j < batch. x is [batch][cols/32] Q8_1 blocks
// (4-byte aligned rows). Grid (ceil(rows / MMQ_ROWS), ceil(batch / MMQ_COLS)), block
// MMQ_THREADS, MMQ_SMEM_BYTES of dynamic shared memory. For K-quants SUB = 8 sub-blocks per
// super-block, as in matvec_q.
template <int TY, int BYTES, int SUB>
DEVICE void mmq(float* __restrict__ out, const uint8_t* __restrict__ w,
                const uint8_t* __restrict__ x, int rows, int cols, int batch) {
    DYN_SMEM(uint32_t, mmq_x);  // [MMQ_COLS][MMQ_DEPTH] Q8_1 blocks of this stage
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int row0 = blockIdx.x * MMQ_ROWS + warp * MMQ_WARP_ROWS;
    const int j0 = blockIdx.y * MMQ_COLS;
    const int jn = min(MMQ_COLS, batch - j0);
    const int nb = cols / 32;
    const long long x_row_words = (long long)nb * (Q8_1_BYTES / 4);
    const uint32_t* xw = reinterpret_cast<const uint32_t*>(x) + (long long)j0 * x_row_words;
    float acc[MMQ_WARP_ROWS][MMQ_COLS];
#pragma unroll
    for (int r = 0; r < MMQ_WARP_ROWS; ++r) {
#pragma unroll
        for (int j = 0; j < MMQ_COLS; ++j) acc[r][j] = 0.0f;
    }
    for (int c0 = 0; c0 < nb; c0 += MMQ_DEPTH) {
        const int cn = min(MMQ_DEPTH, nb - c0);
        const int words = cn * (Q8_1_BYTES / 4);
        __syncthreads();  // every warp is done with the previous stage
        // Row j's blocks c0 .. c0 + cn are `words` contiguous words: coalesced copies.
        for (int i = threadIdx.x; i < jn * words; i += MMQ_THREADS) {
            const int j = i / words, k = i % words;
            mmq_x[j * MMQ_STAGE_WORDS + k] = xw[j * x_row_words + c0 * (Q8_1_BYTES / 4) + k];
        }
        __syncthreads();
        if (lane < cn) {
            const int b = c0 + lane;
            WBlock wq[MMQ_WARP_ROWS];
#pragma unroll
            for (int r = 0; r < MMQ_WARP_ROWS; ++r) {
                if (row0 + r < rows) {
                    const uint8_t* wr = w + (long long)(row0 + r) * (nb / SUB) * BYTES;
                    unpack_block<TY>(wr + (b / SUB) * BYTES, b % SUB, wq[r]);
                }
            }
            // Stride 36 bytes between lanes: nine words, odd, so no bank conflicts.
            const uint8_t* xs = reinterpret_cast<const uint8_t*>(mmq_x) + lane * Q8_1_BYTES;
#pragma unroll
            for (int j = 0; j < MMQ_COLS; ++j) {
                if (j < jn) {
                    const uint8_t* xb = xs + j * (MMQ_STAGE_WORDS * 4);
#pragma unroll
                    for (int r = 0; r < MMQ_WARP_ROWS; ++r) {
                        if (row0 + r < rows) acc[r][j] = block_dot<TY>(wq[r], xb, acc[r][j]);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MMQ_WARP_ROWS; ++r) {
        if (row0 + r < rows) {  // uniform over the warp: every lane reaches the shuffles
            const float s = warp_sum_scatter(acc[r]);
            if (lane < jn) out[(long long)(j0 + lane) * rows + row0 + r] = s;
        }
    }
}

#define MMQ_Q(name, TY, BYTES, SUB)                                                      \
    KERNEL void __launch_bounds__(MMQ_THREADS)                                            \
        name(float* __restrict__ out, const uint8_t* __restrict__ w,                       \
             const uint8_t* __restrict__ x, int rows, int cols, int batch) {               \
        mmq<TY, BYTES, SUB>(out, w, x, rows, cols, batch);                                 \
    }

MMQ_Q(mmq_q4_0, GGML_Q4_0, Q4_0_BYTES, 1)
MMQ_Q(mmq_q4_1, GGML_Q4_1, Q4_1_BYTES, 1)
MMQ_Q(mmq_q5_0, GGML_Q5_0, Q5_0_BYTES, 1)
MMQ_Q(mmq_q5_1, GGML_Q5_1, Q5_1_BYTES, 1)
MMQ_Q(mmq_q8_0, GGML_Q8_0, Q8_0_BYTES, 1)
MMQ_Q(mmq_q4_k, GGML_Q4_K, Q4_K_BYTES, QK_K / 32)
MMQ_Q(mmq_q5_k, GGML_Q5_K, Q5_K_BYTES, QK_K / 32)
MMQ_Q(mmq_q6_k, GGML_Q6_K, Q6_K_BYTES, QK_K / 32)

// F16 weights: matvec_f16's arithmetic, tiled. An output of matvec_f16 is the warp_sum of lane
// l's partial `acc = fmaf(f16_to_f32(w[c]), round_f16(x[j][c]), acc)` from 0.0f over columns
// c = l, l + 32, l + 64, ... in increasing order. Here each warp owns MMF_WARP_ROWS weight
// rows of an MMF_ROWS x MMF_COLS tile; a stage covers MMF_DEPTH = MMF_STEPS * 32 columns from
// c0 (a multiple of 32), and lane l takes its columns c0 + l + 32 s for s = 0 .. MMF_STEPS in
// that order, so it runs exactly the matvec lane's fmaf chain for each of its MMF_WARP_ROWS x
// MMF_COLS outputs (the same operands: the staged activations are round_f16(x), the very
// floats matvec_f16 feeds fmaf), and warp_sum_scatter combines the 32 partials of an output
// with warp_sum's tree. Columns past `cols` (any cols works; the loader only ever passes
// multiples of 32) are skipped, so each partial is exactly matvec's fmaf chain with nothing
// to argue about padding.
//
// Staging: the tile's activations of a stage, rounded to f16 and kept as f32, lane-major
// ([activation row][lane][step]), so a lane's MMF_STEPS values of one activation row are one
// 16-byte shared load (consecutive lanes, consecutive 16 bytes: no bank conflicts); the copy
// in reads them from global memory in coalesced 128-byte rows. Weights are not staged: each
// weight element is used by exactly one lane, which loads it (a warp reads 64 contiguous bytes
// of a row per load) into registers for all MMF_COLS activation rows.

#define MMF_WARPS 8
#define MMF_THREADS (MMF_WARPS * WARP)
// Weight rows per warp (register tile: MMF_WARP_ROWS x MMF_COLS partials a lane).
#define MMF_WARP_ROWS 2
#define MMF_ROWS (MMF_WARPS * MMF_WARP_ROWS)
// Activation rows per block: one per lane after the reduce-scatter.
#define MMF_COLS WARP
// Columns per lane per stage (one 16-byte shared load of f32), and columns per stage.
#define MMF_STEPS 4
#define MMF_DEPTH (MMF_STEPS * WARP)
#define MMF_SMEM_BYTES (MMF_COLS * MMF_DEPTH * 4)

struct alignas(16) f32x4 {
    float v[MMF_STEPS];
};

// out[j][r] = W[r] . x[j] for all r < rows, j < batch; W is [rows][cols] f16, x [batch][cols]
// f32. Grid (ceil(rows / MMF_ROWS), ceil(batch / MMF_COLS)), block MMF_THREADS,
// MMF_SMEM_BYTES of dynamic shared memory (16-byte aligned).
KERNEL void __launch_bounds__(MMF_THREADS)
    mm_f16(float* __restrict__ out, const uint16_t* __restrict__ w,
           const float* __restrict__ x, int rows, int cols, int batch) {
    DYN_SMEM(f32x4, mmf_x);  // [MMF_COLS][WARP]: round_f16(x[j][c0 + l + 32 s]) at [j][l].v[s]
    const int warp = threadIdx.x / WARP, lane = threadIdx.x % WARP;
    const int row0 = blockIdx.x * MMF_ROWS + warp * MMF_WARP_ROWS;
    const int j0 = blockIdx.y * MMF_COLS;
    const int jn = min(MMF_COLS, batch - j0);
    const float* xt = x + (long long)j0 * cols;
    float acc[MMF_WARP_ROWS][MMF_COLS];
#pragma unroll
    for (int r = 0; r < MMF_WARP_ROWS; ++r) {
#pragma unroll
        for (int j = 0; j < MMF_COLS; ++j) acc[r][j] = 0.0f;
    }
    for (int c0 = 0; c0 < cols; c0 += MMF_DEPTH) {
        // This lane's columns of the stage, c0 + lane + 32 s for s < sn.
        const int sn = min(MMF_STEPS, max(0, (cols - c0 - lane + WARP - 1) / WARP));
        // Its weights, loaded before the barriers so the loads overlap the staging.
        float wv[MMF_WARP_ROWS][MMF_STEPS];
#pragma unroll
        for (int r = 0; r < MMF_WARP_ROWS; ++r) {
            const uint16_t* wr = w + (long long)(row0 + r) * cols + c0 + lane;
#pragma unroll
            for (int s = 0; s < MMF_STEPS; ++s) {
                wv[r][s] = row0 + r < rows && s < sn ? f16_to_f32(wr[s * WARP]) : 0.0f;
            }
        }
        __syncthreads();  // every warp is done with the previous stage
        for (int i = threadIdx.x; i < jn * WARP; i += MMF_THREADS) {
            const int j = i / WARP, l = i % WARP;
            const float* xj = xt + (long long)j * cols + c0 + l;
            f32x4 v;
#pragma unroll
            for (int s = 0; s < MMF_STEPS; ++s) {
                v.v[s] = c0 + l + s * WARP < cols ? round_f16(xj[s * WARP]) : 0.0f;
            }
            mmf_x[i] = v;
        }
        __syncthreads();
#pragma unroll
        for (int j = 0; j < MMF_COLS; ++j) {
            if (j < jn) {
                const f32x4 xv = mmf_x[j * WARP + lane];
#pragma unroll
                for (int s = 0; s < MMF_STEPS; ++s) {
                    if (s < sn) {
#pragma unroll
                        for (int r = 0; r < MMF_WARP_ROWS; ++r) {
                            acc[r][j] = fmaf(wv[r][s], xv.v[s], acc[r][j]);
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MMF_WARP_ROWS; ++r) {
        if (row0 + r < rows) {  // uniform over the warp: every lane reaches the shuffles
            const float s = warp_sum_scatter(acc[r]);
            if (lane < jn) out[(long long)(j0 + lane) * rows + row0 + r] = s;
        }
    }
}
