// Row-wise and element-wise ops of the llama forward pass. Numerics follow kernels/src/ops.rs
// and quant.rs (the CPU backend), see DESIGN.md "Seam 1".

// One element of a GGML row: `row` points at the row's first byte, `j` is the element index.
DEVICE float dequant_element(const uint8_t* row, int ty, int j) {
    switch (ty) {
    case GGML_F32:
        return reinterpret_cast<const float*>(row)[j];
    case GGML_F16:
        return f16_to_f32(reinterpret_cast<const uint16_t*>(row)[j]);
    case GGML_Q4_0: {
        const uint8_t* b = row + (j / 32) * Q4_0_BYTES;
        const int k = j % 32;
        const uint8_t q = b[2 + (k % 16)];
        const int nib = k < 16 ? (q & 15) : (q >> 4);
        return (float)(nib - 8) * f16_to_f32(load_u16(b));
    }
    case GGML_Q4_1: {
        const uint8_t* b = row + (j / 32) * Q4_1_BYTES;
        const int k = j % 32;
        const uint8_t q = b[4 + (k % 16)];
        const int nib = k < 16 ? (q & 15) : (q >> 4);
        return fmaf((float)nib, f16_to_f32(load_u16(b)), f16_to_f32(load_u16(b + 2)));
    }
    case GGML_Q8_0: {
        const uint8_t* b = row + (j / 32) * Q8_0_BYTES;
        return (float)(int8_t)b[2 + j % 32] * f16_to_f32(load_u16(b));
    }
    case GGML_Q5_0:
    case GGML_Q5_1: {
        // d, (Q5_1: m), qh (bit k = element k's fifth bit), qs nibbles as Q4_0/Q4_1.
        const bool q51 = ty == GGML_Q5_1;
        const uint8_t* b = row + (j / 32) * (q51 ? Q5_1_BYTES : Q5_0_BYTES);
        const int k = j % 32;
        const uint8_t* qh = b + (q51 ? 4 : 2);
        const uint8_t q = qh[4 + (k % 16)];
        const int nib = k < 16 ? (q & 15) : (q >> 4);
        const int v = nib | (((qh[k / 8] >> (k % 8)) & 1) << 4);
        const float d = f16_to_f32(load_u16(b));
        // Both exact but for one rounding, as the CPU: d(q - 16), and fma(q, d, m).
        return q51 ? fmaf((float)v, d, f16_to_f32(load_u16(b + 2))) : (float)(v - 16) * d;
    }
    case GGML_Q4_K:
    case GGML_Q5_K: {
        // Element e of a super-block: sub-block e / 32 (its 6-bit scale and minimum), nibble
        // (e / 32) % 2 of qs[32 (e / 64) + e % 32]; Q5_K's fifth bit is bit e / 32 of qh[e % 32].
        const bool q5 = ty == GGML_Q5_K;
        const uint8_t* b = row + (j / QK_K) * (q5 ? Q5_K_BYTES : Q4_K_BYTES);
        const int e = j % QK_K, sub = e / 32, l = e % 32;
        int sc, m;
        scale_min_k4(b + 4, sub, &sc, &m);
        const uint8_t* qs = b + (q5 ? 48 : 16);
        int v = (qs[32 * (sub / 2) + l] >> (4 * (sub % 2))) & 15;
        if (q5) v |= ((b[16 + l] >> sub) & 1) << 4;
        // (d sc) q - dmin m: every product exact, one rounding (kernels/src/quant/kquants.rs).
        const float scale = f16_to_f32(load_u16(b)) * (float)sc;
        const float minimum = f16_to_f32(load_u16(b + 2)) * (float)m;
        return scale * (float)v - minimum;
    }
    case GGML_Q6_K: {
        // Half h = e / 128, run r = (e % 128) / 32: nibble r / 2 of ql[64h + 32(r % 2) + l],
        // bits 2r, 2r + 1 of qh[32h + l]; signed 8-bit scale per 16 elements; d(sc)(q - 32).
        const uint8_t* b = row + (j / QK_K) * Q6_K_BYTES;
        const int e = j % QK_K, half = e / 128, r = (e % 128) / 32, l = e % 32;
        const int lo = (b[64 * half + 32 * (r % 2) + l] >> (4 * (r / 2))) & 15;
        const int hi = (b[128 + 32 * half + l] >> (2 * r)) & 3;
        const float scale = f16_to_f32(load_u16(b + 208)) * (float)(int8_t)b[192 + e / 16];
        return scale * (float)((lo | (hi << 4)) - 32);
    }
    default:
        return 0.0f;
    }
}

// out[t][0..cols) = row ids[t] of the embedding table, dequantized to f32.
// Grid (tokens), any block size.
KERNEL void embed_rows(float* __restrict__ out, const uint8_t* __restrict__ table,
                       const int32_t* __restrict__ ids, int ty, int cols, long long row_bytes) {
    const int t = blockIdx.x;
    const uint8_t* row = table + (long long)ids[t] * row_bytes;
    for (int j = threadIdx.x; j < cols; j += blockDim.x) {
        out[(long long)t * cols + j] = dequant_element(row, ty, j);
    }
}

// A whole GGML matrix (n_elems values, whole rows) to f16, for the dequantize + GEMM path.
// Grid-stride over elements; `row_bytes`/`cols` locate each element's row.
KERNEL void dequantize_f16(uint16_t* __restrict__ out, const uint8_t* __restrict__ w, int ty,
                           int cols, long long row_bytes, long long n_elems) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < n_elems; e += stride) {
        const long long r = e / cols;
        out[e] = f32_to_f16(dequant_element(w + r * row_bytes, ty, (int)(e % cols)));
    }
}

#define NORM_THREADS 256

// out = x / sqrt(mean(x^2) + eps) * w per row of n; squares summed in f64 as the CPU does.
// Grid (rows), block NORM_THREADS.
KERNEL void rms_norm(float* __restrict__ out, const float* __restrict__ x,
                     const float* __restrict__ w, int n, float eps) {
    __shared__ double partial[NORM_THREADS / WARP];
    const float* xr = x + (long long)blockIdx.x * n;
    float* outr = out + (long long)blockIdx.x * n;
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += NORM_THREADS) {
        const float v = xr[i];
        acc += (double)(v * v);
    }
    acc = warp_sum(acc);
    if (threadIdx.x % WARP == 0) partial[threadIdx.x / WARP] = acc;
    __syncthreads();
    double sum = 0.0;
    for (int i = 0; i < NORM_THREADS / WARP; ++i) sum += partial[i];
    const float mean = (float)(sum / n);
    const float scale = 1.0f / sqrtf(mean + eps);
    for (int i = threadIdx.x; i < n; i += NORM_THREADS) {
        // Two roundings, as ggml's rms_norm op followed by its mul op.
        outr[i] = (xr[i] * scale) * w[i];
    }
}

// RoPE, ggml NORM mode (adjacent pairs), in place on x[t][n_heads][head_dim] at positions[t].
// theta follows ggml's cumulative product theta *= freq_base^(-2/rope_dim) in f32, so the
// angles equal the CPU path's; pairs beyond rope_dim pass through. Grid (tokens), any block.
KERNEL void rope_norm(float* __restrict__ x, const int32_t* __restrict__ positions, int n_heads,
                      int head_dim, int rope_dim, float freq_base) {
    const int t = blockIdx.x;
    const int pairs = rope_dim / 2;
    const float theta_scale = powf(freq_base, -2.0f / (float)rope_dim);
    float* xt = x + (long long)t * n_heads * head_dim;
    for (int i = threadIdx.x; i < n_heads * pairs; i += blockDim.x) {
        const int h = i / pairs, p = i % pairs;
        float theta = (float)positions[t];
        for (int k = 0; k < p; ++k) theta *= theta_scale;
        const float c = cosf(theta), s = sinf(theta);
        float* pair = xt + h * head_dim + 2 * p;
        const float x0 = pair[0], x1 = pair[1];
        // The CPU build fuses the first product of each difference (GCC contraction).
        pair[0] = fmaf(x0, c, -(x1 * s));
        pair[1] = fmaf(x0, s, x1 * c);
    }
}

// out = silu(gate) * up, silu(x) = x / (1 + exp(-x)). Grid-stride.
KERNEL void swiglu(float* __restrict__ out, const float* __restrict__ gate,
                   const float* __restrict__ up, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        out[i] = (g / (1.0f + expf(-g))) * up[i];
    }
}

// x += y (the residual connections). Grid-stride.
KERNEL void add_inplace(float* __restrict__ x, const float* __restrict__ y, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        x[i] += y[i];
    }
}

#define ARGMAX_THREADS 256
#define NO_INDEX 0x7fffffff

// Greedy sampling on the device: out[r] = the index of the largest logit of row r, the lowest
// index among equal maxima (as the CPU sampler). Grid (rows), block ARGMAX_THREADS.
KERNEL void argmax_rows(int32_t* __restrict__ out, const float* __restrict__ logits, int vocab) {
    __shared__ float best_v[ARGMAX_THREADS / WARP];
    __shared__ int best_i[ARGMAX_THREADS / WARP];
    const float* row = logits + (long long)blockIdx.x * vocab;
    float v = NEG_INF;
    int idx = NO_INDEX;
    for (int i = threadIdx.x; i < vocab; i += ARGMAX_THREADS) {
        const float x = row[i];
        // NaN never wins; the first finite or infinite value seeds the search.
        if (x > v || (idx == NO_INDEX && x == x)) {
            v = x;
            idx = i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = SHFL_XOR(v, o);
        const int oi = SHFL_XOR(idx, o);
        if (ov > v || (ov == v && oi < idx)) {
            v = ov;
            idx = oi;
        }
    }
    if (threadIdx.x % WARP == 0) {
        best_v[threadIdx.x / WARP] = v;
        best_i[threadIdx.x / WARP] = idx;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < ARGMAX_THREADS / WARP; ++w) {
            if (best_v[w] > v || (best_v[w] == v && best_i[w] < idx)) {
                v = best_v[w];
                idx = best_i[w];
            }
        }
        out[blockIdx.x] = idx == NO_INDEX ? 0 : idx;
    }
}
