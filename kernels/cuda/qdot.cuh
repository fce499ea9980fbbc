// Quantized block products shared by the matvec kernels (matvec.cu) and the tiled
// matrix-matrix kernels (mmq.cu): one 32-element block of a weight row (for K-quants, one
// 32-element sub-block of a 256-element super-block) unpacked into registers once, then
// multiplied by Q8_1 activation blocks. Both kernel families call exactly these functions, so
// each per-block contribution is the same sequence of operations in both; with the same
// accumulation order (see mmq.cu) their outputs are bit-identical, which is what keeps a
// sequence's logits independent of the batch it runs in.
//
// Every float update is written as an explicit fmaf (never `acc += a * b`): NVRTC contracts a
// multiply feeding an add into an FMA when it chooses to (--fmad=true), and a choice that
// differed between the two kernels' surroundings would break bit identity. fmaf leaves it no
// choice; the emulator's fmaf is the correctly rounded C one, so the CPU run does the same.
//
// Integer sums (dp4a) are exact (|sum| <= 32 * 128 * 255), so their order is free.

// One unpacked weight block: q holds the 32 weight quants as eight packed words in
// activation order (word i covers activation bytes 4i..4i+4), d the scale; m is Q4_1/Q5_1's
// minimum and the K-quants' dmin; sc/mn are Q4_K/Q5_K's 6-bit scale and minimum, or Q6_K's
// two 16-element scales.
struct WBlock {
    int q[8];
    float d, m;
    int sc, mn;
};

// Block `wb` of a 32-element type (`sub` ignored), or sub-block `sub` (0..8) of K-quant
// super-block `wb`, into `w`.
template <int TY>
DEVICE void unpack_block(const uint8_t* __restrict__ wb, int sub, WBlock& w) {
    w.m = 0.0f;
    w.sc = 0;
    w.mn = 0;
    if (TY == GGML_Q4_0 || TY == GGML_Q4_1) {
        // Q4_0: d, qs[16] (2-byte aligned); Q4_1: d, m, qs[16]. Low nibbles are elements
        // 0..16, high ones 16..32.
        w.d = f16_to_f32(load_u16(wb));
        if (TY == GGML_Q4_1) w.m = f16_to_f32(load_u16(wb + 2));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int q = TY == GGML_Q4_0 ? load_i32_a2(wb + 2 + 4 * i) : load_i32_a4(wb + 4 + 4 * i);
            w.q[i] = q & 0x0F0F0F0F;
            w.q[4 + i] = (q >> 4) & 0x0F0F0F0F;
        }
    } else if (TY == GGML_Q5_0 || TY == GGML_Q5_1) {
        // Element k's fifth bit is bit k of qh (Q5_0: d, qh, qs; Q5_1: d, m, qh, qs).
        w.d = f16_to_f32(load_u16(wb));
        uint32_t qh;
        if (TY == GGML_Q5_0) {
            qh = (uint32_t)load_i32_a2(wb + 2);
        } else {
            w.m = f16_to_f32(load_u16(wb + 2));
            qh = (uint32_t)load_i32_a4(wb + 4);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int q = TY == GGML_Q5_0 ? load_i32_a2(wb + 6 + 4 * i)
                                          : load_i32_a4(wb + 8 + 4 * i);
            w.q[i] = (q & 0x0F0F0F0F) | spread_bit4(qh >> (4 * i));
            w.q[4 + i] = ((q >> 4) & 0x0F0F0F0F) | spread_bit4(qh >> (16 + 4 * i));
        }
    } else if (TY == GGML_Q8_0) {
        w.d = f16_to_f32(load_u16(wb));
#pragma unroll
        for (int i = 0; i < 8; ++i) w.q[i] = load_i32_a2(wb + 2 + 4 * i);
    } else if (TY == GGML_Q4_K || TY == GGML_Q5_K) {
        // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]. Sub-block 2p + h is nibble h of
        // qs[32p .. 32p + 32]; Q5_K's fifth bit of element l is bit `sub` of qh[l].
        w.d = f16_to_f32(load_u16(wb));
        w.m = f16_to_f32(load_u16(wb + 2));
        scale_min_k4(wb + 4, sub, &w.sc, &w.mn);
        const uint8_t* qs = wb + (TY == GGML_Q4_K ? 16 : 48) + 32 * (sub / 2);
        const int shift = 4 * (sub % 2);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            w.q[i] = (load_i32_a4(qs + 4 * i) >> shift) & 0x0F0F0F0F;
            if (TY == GGML_Q5_K) {
                w.q[i] |= ((load_i32_a4(wb + 16 + 4 * i) >> sub) & 0x01010101) << 4;
            }
        }
    } else {
        // Q6_K: ql[128], qh[64], scales[16] (i8, one per 16 elements), d; 2-byte aligned.
        // Half h = sub / 4, run r = sub % 4: low nibbles of ql[64h + 32(r % 2) + l] (high ones
        // for r >= 2) and bits 2r, 2r + 1 of qh[32h + l]; values 0..64, offset -32.
        w.d = f16_to_f32(load_u16(wb + 208));
        const int half = sub / 4, r = sub % 4;
        const uint8_t* ql = wb + 64 * half + 32 * (r % 2);
        const uint8_t* qh = wb + 128 + 32 * half;
        const int shift = 4 * (r / 2);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            w.q[i] = ((load_i32_a2(ql + 4 * i) >> shift) & 0x0F0F0F0F) |
                     (((load_i32_a2(qh + 4 * i) >> (2 * r)) & 0x03030303) << 4);
        }
        w.sc = (int)(int8_t)wb[192 + 2 * sub];
        w.mn = (int)(int8_t)wb[192 + 2 * sub + 1];
    }
}

// acc plus the product of unpacked weight block `w` with Q8_1 activation block `x` (f16 d,
// f16 s = d * sum(q), 32 x int8). Every sum inside a block is exact in integers; one f32
// product (and for Q4_1/Q5_1 one f32 minimum term) per block and activation row.
template <int TY>
DEVICE float block_dot(const WBlock& w, const uint8_t* __restrict__ x, float acc) {
    int xq[8];
    const float dx = load_q8_1_values(x, xq);
    if (TY == GGML_Q4_K || TY == GGML_Q5_K || TY == GGML_Q6_K) {
        int sumi0 = 0, sumi1 = 0, sumx0 = 0, sumx1 = 0;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            sumi0 = dp4a(w.q[i], xq[i], sumi0);
            sumi1 = dp4a(w.q[4 + i], xq[4 + i], sumi1);
            sumx0 = dp4a(0x01010101, xq[i], sumx0);
            sumx1 = dp4a(0x01010101, xq[4 + i], sumx1);
        }
        if (TY == GGML_Q6_K) {
            // Two 16-element groups, each with its own scale: sc * (q - 32) . x.
            const int s = w.sc * (sumi0 - 32 * sumx0) + w.mn * (sumi1 - 32 * sumx1);
            return fmaf(w.d * dx, (float)s, acc);
        }
        // d sc q . x - dmin m sum(x), per sub-block.
        const float t = fmaf(w.d, (float)(w.sc * (sumi0 + sumi1)),
                             -(w.m * (float)(w.mn * (sumx0 + sumx1))));
        return fmaf(dx, t, acc);
    }
    int sumi = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) sumi = dp4a(w.q[i], xq[i], sumi);
    if (TY == GGML_Q8_0) return fmaf(w.d * dx, (float)sumi, acc);
    if (TY == GGML_Q4_0 || TY == GGML_Q5_0) {
        // (q - 8) . x exactly (Q5_0: q - 16): the offset times the exact integer sum of x.
        int sumx = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) sumx = dp4a(0x01010101, xq[i], sumx);
        const int offset = TY == GGML_Q4_0 ? 8 : 16;
        return fmaf(w.d * dx, (float)(sumi - offset * sumx), acc);
    }
    // Q4_1/Q5_1, the CPU's block-sum form: d_w d_x sum(q_w q_x) + m_w s_x.
    const float sx = f16_to_f32(load_u16(x + 2));
    return acc + fmaf(w.d * dx, (float)sumi, w.m * sx);
}
