// The paged KV cache on the device: the cache write through the slot mapping, and paged
// attention over 16-token f16 blocks read through block tables.
//
// Layout (per layer, K and V alike): [num_blocks][n_kv_heads][KV_BLOCK][head_dim] f16, so one
// (block, kv_head) is one contiguous run of KV_BLOCK * head_dim halves (4 KiB at head_dim 128).
// Slot s of the pool is token s % KV_BLOCK of block s / KV_BLOCK, as on the CPU.
//
// Numerics follow kernels/src/attention.rs (llama.cpp's non-flash path): q rounded to f16,
// scores = f16.f16 dots in f32 times scale, softmax in f32, probabilities rounded to f16,
// output = sum p.v in f32. Contexts longer than one partition (ATTN_PARTITION tokens) are
// split: each partition normalises its own probabilities, and attention_reduce merges the
// partitions with their max and sum. The partition size is a constant, so how a row is split
// depends on its context length only, never on the batch: a sequence's output does not depend
// on what else is in the step.
//
// Two attention kernels compute the same rows. paged_attention<D> takes one query row per
// block, which suits decode (a row per sequence) but makes a prefill chunk of N rows read its
// context's K/V N times. paged_attention_tiled<D> takes a tile of up to ATTN_TILE_HEADS / group
// consecutive rows of one sequence per block and reads each K/V token row once per tile. The
// CUDA step (runtime/src/backend/cuda/step.rs) runs steps with a prefill chunk through the
// tiled kernel and decode-only steps through the row kernel. The tiled kernel repeats the row
// kernel's float operations for every (row, head), in the same order, so both give the same
// bits (see paged_attention_tiled; the emulator tests compare them bit for bit): the choice
// never changes a result.

#define KV_BLOCK 16
#define ATTN_WARPS 4
#define ATTN_THREADS (ATTN_WARPS * WARP)
#define ATTN_PARTITION 512
#define ATTN_MAX_GROUP 8

// Writes each token's K and V (f32, [tokens][n_kv_heads * head_dim]) into its slot, rounded to
// f16. slots[t] < 0 marks a padding token and writes nothing. Grid (tokens), any block size.
KERNEL void write_kv(uint16_t* __restrict__ k_cache, uint16_t* __restrict__ v_cache,
                     const float* __restrict__ k, const float* __restrict__ v,
                     const int32_t* __restrict__ slots, int n_kv_heads, int head_dim) {
    const int t = blockIdx.x;
    const int slot = slots[t];
    if (slot < 0) return;
    const long long block = slot / KV_BLOCK;
    const int offset = slot % KV_BLOCK;
    const int width = n_kv_heads * head_dim;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        const int h = i / head_dim, d = i % head_dim;
        const long long at = ((block * n_kv_heads + h) * KV_BLOCK + offset) * head_dim + d;
        k_cache[at] = f32_to_f16(k[(long long)t * width + i]);
        v_cache[at] = f32_to_f16(v[(long long)t * width + i]);
    }
}

// The pieces both attention kernels run per (row, head), written once so that their float
// operations are the same by construction (the tiled kernel's bit identity rests on it).

// Lane `sl` of a token's LPT lanes: 8 halves (16 bytes) of K at position `pos` through the
// block table, as f32; zeros when `valid` is false (the lane still joins the shuffles).
template <int D>
DEVICE void load_k8(float (&k8)[8], bool valid, const uint16_t* __restrict__ k_cache,
                    const int32_t* __restrict__ table, int pos, int n_kv_heads, int kv_head,
                    int sl) {
    if (!valid) {
#pragma unroll
        for (int j = 0; j < 8; ++j) k8[j] = 0.0f;
        return;
    }
    const long long blk = table[pos / KV_BLOCK];
    const uint16_t* kp = k_cache + (blk * n_kv_heads + kv_head) * ((long long)KV_BLOCK * D) +
                         (pos % KV_BLOCK) * D + sl * 8;
    const u32x4 raw = *reinterpret_cast<const u32x4*>(kp);
    const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        k8[2 * j] = f16_to_f32((uint16_t)(words[j] & 0xffff));
        k8[2 * j + 1] = f16_to_f32((uint16_t)(words[j] >> 16));
    }
}

// One score before scaling: 8 sequential fmaf over this lane's dimensions, then the butterfly
// over the token's LPT lanes (every lane of them ends with the sum).
template <int LPT>
DEVICE float score_dot(const float (&k8)[8], const float* q8) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) acc = fmaf(k8[j], q8[j], acc);
#pragma unroll
    for (int o = LPT / 2; o > 0; o >>= 1) acc += SHFL_XOR(acc, o);
    return acc;
}

// One warp, one head, one partition: replaces the n scores in lg by exp(score - max) and writes
// (max, sum of the exponentials) to stat[0..2]. Lane-strided partial max and sum, then the
// warp's butterfly.
DEVICE void softmax_exps(float* lg, int n, float* stat, int lane) {
    float m = NEG_INF;
    for (int t = lane; t < n; t += WARP) m = fmaxf(m, lg[t]);
    m = warp_max_f(m);
    float s = 0.0f;
    for (int t = lane; t < n; t += WARP) {
        const float e = expf(lg[t] - m);
        lg[t] = e;
        s += e;
    }
    s = warp_sum(s);
    if (lane == 0) {
        stat[0] = m;
        stat[1] = s;
    }
}

// Dimension d of query head `head`'s output o: into `out` when its row has one partition,
// else into its partition's slot of part_out, with the partition's (max, sum) `stat` written
// once per head (d == 0) for attention_reduce.
template <int D>
DEVICE void store_output(float* __restrict__ out, float* __restrict__ part_out,
                         float* __restrict__ part_stats, long long head, int d, float o,
                         int n_parts, int part, int max_parts, const float* stat) {
    if (n_parts == 1) {
        out[head * D + d] = o;
        return;
    }
    part_out[(head * max_parts + part) * D + d] = o;
    if (d == 0) {
        part_stats[(head * max_parts + part) * 2] = stat[0];
        part_stats[(head * max_parts + part) * 2 + 1] = stat[1];
    }
}

// Dynamic shared memory of one attention block, in floats.
//   q_s     [group][D]                     the group's queries, rounded to f16
//   logits  [group][ATTN_PARTITION]        scores, then probabilities
//   red     [ATTN_WARPS][group][D]         per-warp partial outputs
//   stats   [group][2]                     max and sum of each head's exponentials
// attention_smem_bytes() on the host computes the same size.

// One query row against one KV head's group of query heads over one partition of its context.
// Grid (n_kv_heads, rows, max_parts), block ATTN_THREADS. A row is one query token: a decode
// step has one per sequence; a prefill chunk has one per token, each with context_len =
// position + 1 (causal) over the same block table, so chunked prefill reads earlier chunks
// from the cache.
template <int D>
DEVICE void paged_attention(float* __restrict__ out, float* __restrict__ part_out,
                            float* __restrict__ part_stats, const float* __restrict__ q,
                            const uint16_t* __restrict__ k_cache,
                            const uint16_t* __restrict__ v_cache,
                            const int32_t* __restrict__ block_tables,
                            const int32_t* __restrict__ row_seq,
                            const int32_t* __restrict__ row_ctx, int max_blocks_per_seq,
                            int n_kv_heads, int group, int max_parts, float scale) {
    static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head_dim must be 32..256, a multiple of 32");
    const int kv_head = blockIdx.x, row = blockIdx.y, part = blockIdx.z;
    const int ctx = row_ctx[row];
    const int n_parts = (ctx + ATTN_PARTITION - 1) / ATTN_PARTITION;
    if (part >= n_parts) return;  // uniform over the block
    const int start = part * ATTN_PARTITION;
    const int n = min(ctx - start, ATTN_PARTITION);
    const int n_heads = n_kv_heads * group;
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;

    DYN_SMEM(float, smem);
    float* q_s = smem;
    float* logits = q_s + group * D;
    float* red = logits + group * ATTN_PARTITION;
    float* stats = red + ATTN_WARPS * group * D;

    const float* q_row = q + ((long long)row * n_heads + (long long)kv_head * group) * D;
    for (int i = tid; i < group * D; i += ATTN_THREADS) q_s[i] = round_f16(q_row[i]);
    __syncthreads();

    const int32_t* table = block_tables + (long long)row_seq[row] * max_blocks_per_seq;
    const long long head_stride = (long long)KV_BLOCK * D;

    // Scores: LPT lanes share a token, each loading 8 halves (16 bytes) of its K row, so K is
    // read once for the whole query group.
    constexpr int LPT = D / 8;
    constexpr int TPW = WARP / LPT;
    const int sub = lane / LPT, sl = lane % LPT;
    for (int base = warp * TPW; base < n; base += ATTN_WARPS * TPW) {
        const int t = base + sub;
        const bool valid = t < n;
        float k8[8];
        load_k8<D>(k8, valid, k_cache, table, start + t, n_kv_heads, kv_head, sl);
        for (int g = 0; g < group; ++g) {
            const float acc = score_dot<LPT>(k8, q_s + g * D + sl * 8);
            if (valid && sl == 0) logits[g * ATTN_PARTITION + t] = acc * scale;
        }
    }
    __syncthreads();

    // Softmax over the partition, one warp per query head.
    for (int g = warp; g < group; g += ATTN_WARPS) {
        softmax_exps(logits + g * ATTN_PARTITION, n, stats + 2 * g, lane);
    }
    __syncthreads();
    for (int i = tid; i < group * n; i += ATTN_THREADS) {
        const int g = i / n, t = i % n;
        float* p = logits + g * ATTN_PARTITION + t;
        *p = round_f16(*p * (1.0f / stats[2 * g + 1]));
    }
    __syncthreads();

    // Output: each warp takes every ATTN_WARPS-th token, each lane D/32 dimensions of its V row.
    constexpr int DPL = D / WARP;
    float acc[ATTN_MAX_GROUP][DPL];
#pragma unroll
    for (int g = 0; g < ATTN_MAX_GROUP; ++g)
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[g][j] = 0.0f;
    for (int t = warp; t < n; t += ATTN_WARPS) {
        const int pos = start + t;
        const long long blk = table[pos / KV_BLOCK];
        const uint16_t* vp = v_cache + (blk * n_kv_heads + kv_head) * head_stride +
                             (pos % KV_BLOCK) * D + lane * DPL;
        float vv[DPL];
#pragma unroll
        for (int j = 0; j < DPL; ++j) vv[j] = f16_to_f32(vp[j]);
#pragma unroll
        for (int g = 0; g < ATTN_MAX_GROUP; ++g) {
            if (g < group) {
                const float p = logits[g * ATTN_PARTITION + t];
#pragma unroll
                for (int j = 0; j < DPL; ++j) acc[g][j] = fmaf(p, vv[j], acc[g][j]);
            }
        }
    }
#pragma unroll
    for (int g = 0; g < ATTN_MAX_GROUP; ++g) {
        if (g < group) {
#pragma unroll
            for (int j = 0; j < DPL; ++j) red[(warp * group + g) * D + lane * DPL + j] = acc[g][j];
        }
    }
    __syncthreads();
    for (int i = tid; i < group * D; i += ATTN_THREADS) {
        float o = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) o += red[w * group * D + i];
        const int g = i / D, d = i % D;
        const long long head = (long long)row * n_heads + (long long)kv_head * group + g;
        store_output<D>(out, part_out, part_stats, head, d, o, n_parts, part, max_parts,
                        stats + 2 * g);
    }
}

#define PAGED_ATTENTION(D)                                                                       \
    KERNEL void __launch_bounds__(ATTN_THREADS) paged_attention_d##D(                            \
        float* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_stats,   \
        const float* __restrict__ q, const uint16_t* __restrict__ k_cache,                       \
        const uint16_t* __restrict__ v_cache, const int32_t* __restrict__ block_tables,          \
        const int32_t* __restrict__ row_seq, const int32_t* __restrict__ row_ctx,                \
        int max_blocks_per_seq, int n_kv_heads, int group, int max_parts, float scale) {         \
        paged_attention<D>(out, part_out, part_stats, q, k_cache, v_cache, block_tables,         \
                           row_seq, row_ctx, max_blocks_per_seq, n_kv_heads, group, max_parts,   \
                           scale);                                                               \
    }

PAGED_ATTENTION(32)
PAGED_ATTENTION(64)
PAGED_ATTENTION(128)

// Query heads (tile rows x group) of one tiled attention block: the bound of its register
// accumulators (ATTN_TILE_HEADS x D/32 floats a lane, as the row kernel's ATTN_MAX_GROUP x D/32)
// and of its shared memory. A tile has ATTN_TILE_HEADS / group rows (16 at group 1, 2 at
// group 8); attention_tile_rows() on the host computes the same.
#define ATTN_TILE_HEADS 16

// Dynamic shared memory of one tiled block, in 4-byte words, laid out for ATTN_TILE_HEADS
// heads whatever the group (attention_tiled_smem_bytes() on the host computes the same size):
//   q_s     [ATTN_TILE_HEADS][D]               the tile's queries, rounded to f16
//   logits  [ATTN_TILE_HEADS][ATTN_PARTITION]  scores, then probabilities
//   red     [ATTN_WARPS][ATTN_TILE_HEADS][D]   per-warp partial outputs
//   stats   [ATTN_TILE_HEADS][2]               max and sum of each head's exponentials
//   n_s     [ATTN_TILE_HEADS] (int)            tokens of this partition each head's row sees

// paged_attention for a tile of consecutive query rows of ONE sequence (a prefill chunk, or a
// part of one): grid (n_kv_heads, tiles, max_parts), block ATTN_THREADS; tiles[2 * i] is the
// first row of tile i and tiles[2 * i + 1] its row count (the host never puts two sequences in
// a tile: every row uses the block table of the tile's first row). Each K and V token row of
// the partition is read from global memory once per tile and used, from registers, by every
// (row, query head) of the tile: `heads` = rows x group "heads" h = r * group + g.
//
// Bit-identical to paged_attention<D> for every row, by construction: each (row, head) goes
// through exactly the row kernel's float operations in the row kernel's order, only more
// (row, head) pairs share each loaded K/V row.
//  * scores: the same LPT lanes per token, the same 8 fmaf per lane over the same q_s / k8
//    values, the same SHFL_XOR butterfly, `* scale`; a token t counts for row r when
//    t < n_r = min(ctx_r - start, ATTN_PARTITION), the row kernel's n;
//  * softmax: one warp per head with the row kernel's code over that head's n;
//  * output: warp w again takes the tokens t = w, w + ATTN_WARPS, ... < n_r in increasing
//    order, lane l the dimensions l * D/32 .., with the same fmaf chain from 0.0f per (head,
//    dimension); red[w] is summed over w = 0..ATTN_WARPS as there.
// Only which (row, head) pairs a block handles changes, never an operation or its operands.
// The emulator tests compare the two kernels bit for bit.
template <int D>
DEVICE void paged_attention_tiled(float* __restrict__ out, float* __restrict__ part_out,
                                  float* __restrict__ part_stats, const float* __restrict__ q,
                                  const uint16_t* __restrict__ k_cache,
                                  const uint16_t* __restrict__ v_cache,
                                  const int32_t* __restrict__ block_tables,
                                  const int32_t* __restrict__ row_seq,
                                  const int32_t* __restrict__ row_ctx,
                                  const int32_t* __restrict__ tiles, int max_blocks_per_seq,
                                  int n_kv_heads, int group, int max_parts, float scale) {
    static_assert(D % 32 == 0 && D >= 32 && D <= 256, "head_dim must be 32..256, a multiple of 32");
    const int kv_head = blockIdx.x, tile = blockIdx.y, part = blockIdx.z;
    const int row0 = tiles[2 * tile];
    // Clamped so that a malformed table cannot index past the shared arrays (the host's
    // attention_tile_rows() never exceeds it).
    const int rows = min(tiles[2 * tile + 1], ATTN_TILE_HEADS / group);
    const int heads = rows * group;
    const int start = part * ATTN_PARTITION;
    const int n_heads = n_kv_heads * group;
    const int tid = threadIdx.x, warp = tid / WARP, lane = tid % WARP;

    DYN_SMEM(float, smem);
    float* q_s = smem;
    float* logits = q_s + ATTN_TILE_HEADS * D;
    float* red = logits + ATTN_TILE_HEADS * ATTN_PARTITION;
    float* stats = red + ATTN_WARPS * ATTN_TILE_HEADS * D;
    int* n_s = reinterpret_cast<int*>(stats + 2 * ATTN_TILE_HEADS);

    // Tokens of this partition each head's row attends to (0 when its context ends before the
    // partition: the row kernel's block for it returns at once and writes nothing).
    if (tid < heads) {
        const int ctx = row_ctx[row0 + tid / group];
        n_s[tid] = max(0, min(ctx - start, ATTN_PARTITION));
    }
    const float* q_tile = q + ((long long)row0 * n_heads + (long long)kv_head * group) * D;
    for (int i = tid; i < heads * D; i += ATTN_THREADS) {
        // Head h = i / D is query head g = h % group of row r = h / group.
        const int r = i / (group * D), rest = i % (group * D);
        q_s[i] = round_f16(q_tile[(long long)r * n_heads * D + rest]);
    }
    __syncthreads();
    int n_max = 0;
    for (int h = 0; h < heads; ++h) n_max = max(n_max, n_s[h]);
    if (n_max == 0) return;  // uniform over the block

    const int32_t* table = block_tables + (long long)row_seq[row0] * max_blocks_per_seq;
    const long long head_stride = (long long)KV_BLOCK * D;

    // Scores: as the row kernel, LPT lanes share a token's K row (8 halves, 16 bytes, each),
    // loaded once for every head of the tile.
    constexpr int LPT = D / 8;
    constexpr int TPW = WARP / LPT;
    const int sub = lane / LPT, sl = lane % LPT;
    for (int base = warp * TPW; base < n_max; base += ATTN_WARPS * TPW) {
        const int t = base + sub;
        float k8[8];
        load_k8<D>(k8, t < n_max, k_cache, table, start + t, n_kv_heads, kv_head, sl);
        for (int h = 0; h < heads; ++h) {
            const int n = n_s[h];
            // Rows whose context ends before this warp's tokens (the causal triangle at the
            // end of a prefill tile): skipped by the whole warp, so every lane still reaches
            // each shuffle it takes part in.
            if (n <= base) continue;
            const float acc = score_dot<LPT>(k8, q_s + h * D + sl * 8);
            if (t < n && sl == 0) logits[h * ATTN_PARTITION + t] = acc * scale;
        }
    }
    __syncthreads();

    // Softmax over the partition, one warp per head: the row kernel's code over the head's n.
    for (int h = warp; h < heads; h += ATTN_WARPS) {
        softmax_exps(logits + h * ATTN_PARTITION, n_s[h], stats + 2 * h, lane);
    }
    __syncthreads();
    for (int h = 0; h < heads; ++h) {
        const int n = n_s[h];
        for (int t = tid; t < n; t += ATTN_THREADS) {
            float* p = logits + h * ATTN_PARTITION + t;
            *p = round_f16(*p * (1.0f / stats[2 * h + 1]));
        }
    }
    __syncthreads();

    // Output: each warp takes every ATTN_WARPS-th token, each lane D/32 dimensions of its V
    // row, loaded once and accumulated into every head whose row sees the token.
    constexpr int DPL = D / WARP;
    float acc[ATTN_TILE_HEADS][DPL];
#pragma unroll
    for (int h = 0; h < ATTN_TILE_HEADS; ++h)
#pragma unroll
        for (int j = 0; j < DPL; ++j) acc[h][j] = 0.0f;
    // Each head's token count in registers (0 past `heads`), one guard per (token, head); read
    // from shared memory in the loop instead, ptxas spilled at sm_80 (d32, d64).
    int n_h[ATTN_TILE_HEADS];
#pragma unroll
    for (int h = 0; h < ATTN_TILE_HEADS; ++h) n_h[h] = h < heads ? n_s[h] : 0;
    for (int t = warp; t < n_max; t += ATTN_WARPS) {
        const int pos = start + t;
        const long long blk = table[pos / KV_BLOCK];
        const uint16_t* vp = v_cache + (blk * n_kv_heads + kv_head) * head_stride +
                             (pos % KV_BLOCK) * D + lane * DPL;
        float vv[DPL];
#pragma unroll
        for (int j = 0; j < DPL; ++j) vv[j] = f16_to_f32(vp[j]);
#pragma unroll
        for (int h = 0; h < ATTN_TILE_HEADS; ++h) {
            if (t < n_h[h]) {
                const float p = logits[h * ATTN_PARTITION + t];
#pragma unroll
                for (int j = 0; j < DPL; ++j) acc[h][j] = fmaf(p, vv[j], acc[h][j]);
            }
        }
    }
#pragma unroll
    for (int h = 0; h < ATTN_TILE_HEADS; ++h) {
        if (h < heads) {
#pragma unroll
            for (int j = 0; j < DPL; ++j)
                red[(warp * ATTN_TILE_HEADS + h) * D + lane * DPL + j] = acc[h][j];
        }
    }
    __syncthreads();
    for (int i = tid; i < heads * D; i += ATTN_THREADS) {
        const int h = i / D, d = i % D;
        if (n_s[h] == 0) continue;  // this row's context ends before the partition
        float o = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) o += red[w * ATTN_TILE_HEADS * D + i];
        const int row = row0 + h / group;
        const int n_parts = (row_ctx[row] + ATTN_PARTITION - 1) / ATTN_PARTITION;
        const long long head = (long long)row * n_heads + (long long)kv_head * group + h % group;
        store_output<D>(out, part_out, part_stats, head, d, o, n_parts, part, max_parts,
                        stats + 2 * h);
    }
}

#define PAGED_ATTENTION_TILED(D)                                                                 \
    KERNEL void __launch_bounds__(ATTN_THREADS) paged_attention_tiled_d##D(                      \
        float* __restrict__ out, float* __restrict__ part_out, float* __restrict__ part_stats,   \
        const float* __restrict__ q, const uint16_t* __restrict__ k_cache,                       \
        const uint16_t* __restrict__ v_cache, const int32_t* __restrict__ block_tables,          \
        const int32_t* __restrict__ row_seq, const int32_t* __restrict__ row_ctx,                \
        const int32_t* __restrict__ tiles, int max_blocks_per_seq, int n_kv_heads, int group,    \
        int max_parts, float scale) {                                                            \
        paged_attention_tiled<D>(out, part_out, part_stats, q, k_cache, v_cache, block_tables,   \
                                 row_seq, row_ctx, tiles, max_blocks_per_seq, n_kv_heads, group, \
                                 max_parts, scale);                                              \
    }

PAGED_ATTENTION_TILED(32)
PAGED_ATTENTION_TILED(64)
PAGED_ATTENTION_TILED(128)

// Merges the partitions of rows whose context spans more than one: M = max m_p,
// w_p = l_p * exp(m_p - M), out = sum w_p o_p / sum w_p, in partition order (deterministic).
// Rows with one partition were written directly and are skipped. Grid (n_heads, rows), any block.
KERNEL void attention_reduce(float* __restrict__ out, const float* __restrict__ part_out,
                             const float* __restrict__ part_stats,
                             const int32_t* __restrict__ row_ctx, int n_heads, int head_dim,
                             int max_parts) {
    const int head = blockIdx.x, row = blockIdx.y;
    const int n_parts = (row_ctx[row] + ATTN_PARTITION - 1) / ATTN_PARTITION;
    if (n_parts <= 1) return;
    const long long h = (long long)row * n_heads + head;
    const float* stats = part_stats + h * max_parts * 2;
    float m = NEG_INF;
    for (int p = 0; p < n_parts; ++p) m = fmaxf(m, stats[2 * p]);
    float total = 0.0f;
    for (int p = 0; p < n_parts; ++p) total += stats[2 * p + 1] * expf(stats[2 * p] - m);
    const float inv = 1.0f / total;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float o = 0.0f;
        for (int p = 0; p < n_parts; ++p) {
            const float w = stats[2 * p + 1] * expf(stats[2 * p] - m);
            o = fmaf(w, part_out[(h * max_parts + p) * head_dim + d], o);
        }
        out[h * head_dim + d] = o * inv;
    }
}
