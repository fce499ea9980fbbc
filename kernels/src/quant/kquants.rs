//! ggml's K-quant super-blocks (Q4_K, Q5_K, Q6_K) and the Q8_K activation block.
//!
//! Every K-quant block covers `QK_K` = 256 elements split into sub-blocks with their own 6- or
//! 8-bit scales, all relative to one f16 super-block scale. Layouts, byte offsets in order:
//!
//! | type | bytes | fields                                                  | value             |
//! |------|-------|---------------------------------------------------------|-------------------|
//! | Q4_K | 144   | d: f16, dmin: f16, scales: [u8; 12], qs: [u8; 128]       | d·sc·q − dmin·m   |
//! | Q5_K | 176   | d, dmin, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]   | d·sc·q − dmin·m   |
//! | Q6_K | 210   | ql: [u8; 128], qh: [u8; 64], scales: [i8; 16], d: f16    | d·sc·(q − 32)     |
//! | Q8_K | 292   | d: f32, qs: [i8; 256], bsums: [i16; 16]                  | d·q               |
//!
//! * Q4_K/Q5_K: eight sub-blocks of 32; `scales` packs eight 6-bit scales `sc` and eight 6-bit
//!   mins `m` (see [`scale_min_k4`]). Within each 64 elements, the low nibbles of 32 `qs` bytes
//!   are the first 32 values and their high nibbles the next 32. Q5_K adds a fifth bit: value
//!   `e = 64j + 32h + l` takes bit `2j + h` of `qh[l]`.
//! * Q6_K: sixteen sub-blocks of 16 with signed 8-bit scales; each half of 128 values reads 64
//!   `ql` bytes (low nibbles of bytes 0..32, 32..64, then their high nibbles) and 32 `qh` bytes
//!   (bit pairs 0-1, 2-3, 4-5, 6-7 for the four runs of 32).
//! * Q8_K: `bsums[k]` is the sum of `qs[16k..16k+16]`, which lets a dot product apply the
//!   weight's per-sub-block minimum without touching the values.
//!
//! Dequantization rounds once per value, whatever the evaluation order: `d·sc·q` is exact in
//! f32 (an 11-bit f16 significand times a 6-bit scale — Q6_K: 7-bit magnitude — times a value
//! of at most 5 significant bits fits in 24 bits), and so is `dmin·m`, so only the final subtraction rounds — with or
//! without FMA contraction. That is why ggml's `dequantize_row_*` on any build and the `gguf`
//! package's NumPy code agree exactly; tests/fixtures/kquants holds that package's output and
//! a test compares bits.

use super::read_f16;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;
pub const Q4_K_BLOCK_BYTES: usize = 144;
pub const Q5_K_BLOCK_BYTES: usize = 176;
pub const Q6_K_BLOCK_BYTES: usize = 210;
pub const Q8_K_BLOCK_BYTES: usize = 292;

/// Byte offsets of the fields that are not at the start of their block.
const K4_SCALES: usize = 4;
const K4_QS: usize = 16;
const K5_QH: usize = 16;
const K5_QS: usize = 48;
const K6_QH: usize = 128;
const K6_SCALES: usize = 192;
const K6_D: usize = 208;
pub(crate) const Q8K_QS: usize = 4;
pub(crate) const Q8K_BSUMS: usize = 260;

/// The layout of a K-quant weight type (the K-quant [`crate::WeightType`]s map onto these with
/// `WeightType::kquant`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KQuantType {
    Q4K,
    Q5K,
    Q6K,
}

impl KQuantType {
    /// Bytes of one 256-element super-block.
    pub fn block_bytes(self) -> usize {
        match self {
            KQuantType::Q4K => Q4_K_BLOCK_BYTES,
            KQuantType::Q5K => Q5_K_BLOCK_BYTES,
            KQuantType::Q6K => Q6_K_BLOCK_BYTES,
        }
    }

    /// The quantized values of one block as small integers (Q4_K 0..16, Q5_K 0..32,
    /// Q6_K −32..32), in element order.
    pub(crate) fn quants(self, block: &[u8]) -> [i8; QK_K] {
        match self {
            KQuantType::Q4K => q4_k_quants(block),
            KQuantType::Q5K => q5_k_quants(block),
            KQuantType::Q6K => q6_k_quants(block),
        }
    }
}

/// A K-quant row whose length does not fit its blocks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KQuantSizeError {
    #[error("{ty:?} rows need a multiple of 256 values, got {cols}")]
    NotBlockMultiple { ty: KQuantType, cols: usize },
    #[error("{ty:?} row of {cols} values needs {expected} bytes, got {actual}")]
    DataSize {
        ty: KQuantType,
        cols: usize,
        expected: usize,
        actual: usize,
    },
}

#[inline(always)]
pub(crate) fn read_f32(bytes: &[u8], at: usize) -> f32 {
    f32::from_le_bytes([bytes[at], bytes[at + 1], bytes[at + 2], bytes[at + 3]])
}

/// Unpacks Q4_K/Q5_K's 12 scale bytes into eight 6-bit scales and eight 6-bit mins
/// (ggml's `get_scale_min_k4`): sub-blocks 0..4 use the low 6 bits of bytes 0..4 (scales) and
/// 4..8 (mins); sub-blocks 4..8 take their low 4 bits from bytes 8..12 (scale: low nibble,
/// min: high nibble) and their top 2 bits from the spare top bits of bytes 0..4 / 4..8.
#[inline(always)]
pub(crate) fn scale_min_k4(q: &[u8]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..4 {
        sc[j] = q[j] & 63;
        m[j] = q[j + 4] & 63;
        sc[j + 4] = (q[j + 8] & 0x0F) | ((q[j] >> 6) << 4);
        m[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
    }
    (sc, m)
}

/// Q4_K's 4-bit values, 0..16.
fn q4_k_quants(block: &[u8]) -> [i8; QK_K] {
    let qs = &block[K4_QS..K4_QS + QK_K / 2];
    let mut out = [0i8; QK_K];
    for (o, q) in out.chunks_exact_mut(64).zip(qs.chunks_exact(32)) {
        for l in 0..32 {
            o[l] = (q[l] & 0x0F) as i8;
            o[l + 32] = (q[l] >> 4) as i8;
        }
    }
    out
}

/// Q5_K's 5-bit values, 0..32.
fn q5_k_quants(block: &[u8]) -> [i8; QK_K] {
    let qh = &block[K5_QH..K5_QH + QK_K / 8];
    let qs = &block[K5_QS..K5_QS + QK_K / 2];
    let mut out = [0i8; QK_K];
    for (j, (o, q)) in out
        .chunks_exact_mut(64)
        .zip(qs.chunks_exact(32))
        .enumerate()
    {
        for l in 0..32 {
            let lo_bit = (qh[l] >> (2 * j)) & 1;
            let hi_bit = (qh[l] >> (2 * j + 1)) & 1;
            o[l] = ((q[l] & 0x0F) | (lo_bit << 4)) as i8;
            o[l + 32] = ((q[l] >> 4) | (hi_bit << 4)) as i8;
        }
    }
    out
}

/// Q6_K's 6-bit values minus 32, −32..32.
fn q6_k_quants(block: &[u8]) -> [i8; QK_K] {
    let mut out = [0i8; QK_K];
    for (half, o) in out.chunks_exact_mut(128).enumerate() {
        let ql = &block[64 * half..64 * half + 64];
        let qh = &block[K6_QH + 32 * half..K6_QH + 32 * half + 32];
        for l in 0..32 {
            let six = |low: u8, shift: u32| (low | (((qh[l] >> shift) & 3) << 4)) as i8 - 32;
            o[l] = six(ql[l] & 0x0F, 0);
            o[l + 32] = six(ql[l + 32] & 0x0F, 2);
            o[l + 64] = six(ql[l] >> 4, 4);
            o[l + 96] = six(ql[l + 32] >> 4, 6);
        }
    }
    out
}

/// The per-block scales a dot product needs, in ggml's integer form.
pub(crate) struct KScales {
    /// f16 super-block scale `d`.
    pub d: f32,
    /// f16 `dmin` (0 for Q6_K, which has no minimum).
    pub dmin: f32,
    /// Scale of each 16-element group (Q4_K/Q5_K repeat each 32-element scale twice).
    pub scales: [i32; 16],
    /// Minimum of each 16-element group (all 0 for Q6_K).
    pub mins: [i32; 16],
}

impl KScales {
    pub(crate) fn of(ty: KQuantType, block: &[u8]) -> KScales {
        let mut scales = [0i32; 16];
        let mut mins = [0i32; 16];
        match ty {
            KQuantType::Q4K | KQuantType::Q5K => {
                let (sc, m) = scale_min_k4(&block[K4_SCALES..K4_SCALES + 12]);
                for g in 0..16 {
                    scales[g] = i32::from(sc[g / 2]);
                    mins[g] = i32::from(m[g / 2]);
                }
                KScales {
                    d: read_f16(block, 0),
                    dmin: read_f16(block, 2),
                    scales,
                    mins,
                }
            }
            KQuantType::Q6K => {
                for (s, &b) in scales.iter_mut().zip(&block[K6_SCALES..K6_SCALES + 16]) {
                    *s = i32::from(b as i8);
                }
                KScales {
                    d: read_f16(block, K6_D),
                    dmin: 0.0,
                    scales,
                    mins,
                }
            }
        }
    }
}

/// Converts one row of `ty` blocks into f32 (`out.len()` values, a multiple of 256).
pub fn dequantize_row_k(
    ty: KQuantType,
    data: &[u8],
    out: &mut [f32],
) -> Result<(), KQuantSizeError> {
    let cols = out.len();
    if !cols.is_multiple_of(QK_K) {
        return Err(KQuantSizeError::NotBlockMultiple { ty, cols });
    }
    let expected = cols / QK_K * ty.block_bytes();
    if data.len() != expected {
        return Err(KQuantSizeError::DataSize {
            ty,
            cols,
            expected,
            actual: data.len(),
        });
    }
    dequantize_blocks(ty, data, out);
    Ok(())
}

/// The body of [`dequantize_row_k`] once the sizes are known to match.
pub(crate) fn dequantize_blocks(ty: KQuantType, data: &[u8], out: &mut [f32]) {
    for (ob, block) in out
        .chunks_exact_mut(QK_K)
        .zip(data.chunks_exact(ty.block_bytes()))
    {
        let q = ty.quants(block);
        let s = KScales::of(ty, block);
        for (g, (og, qg)) in ob.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            // ggml's and gguf's order, (d·sc)·q − (dmin·m); every product here is exact.
            let scale = s.d * s.scales[g] as f32;
            let min = s.dmin * s.mins[g] as f32;
            for (o, &v) in og.iter_mut().zip(qg) {
                *o = scale * f32::from(v) - min;
            }
        }
    }
}

/// Quantizes `x` (a multiple of 256 long) into Q8_K blocks (`x.len() / 256 * 292` bytes) as
/// ggml's `quantize_row_q8_K_ref` does — which is also what ggml's x86 build runs. The scale
/// comes from the signed value of largest magnitude (the first one on ties), `iscale = −127/max`
/// (negative on purpose: ggml's IQ kernels need it), values round half to even and clamp at
/// 127 above only, and `d = 1/iscale`. An all-zero block gets d = 0, zero values and sums.
pub fn quantize_row_q8_k(x: &[f32], out: &mut [u8]) {
    assert!(
        x.len().is_multiple_of(QK_K),
        "quantize_row_q8_k: {} values is not a multiple of {QK_K}",
        x.len()
    );
    assert_eq!(
        out.len(),
        x.len() / QK_K * Q8_K_BLOCK_BYTES,
        "quantize_row_q8_k: output buffer has the wrong size"
    );
    for (xb, ob) in x
        .chunks_exact(QK_K)
        .zip(out.chunks_exact_mut(Q8_K_BLOCK_BYTES))
    {
        let (mut amax, mut max) = (0.0f32, 0.0f32);
        for &v in xb {
            if v.abs() > amax {
                amax = v.abs();
                max = v;
            }
        }
        if amax == 0.0 {
            ob.fill(0);
            continue;
        }
        let iscale = -127.0f32 / max;
        let mut qs = [0i8; QK_K];
        for (q, &v) in qs.iter_mut().zip(xb) {
            // ggml's nearest_int (adding 1.5·2^23) rounds half to even; |iscale·v| <= 127 up
            // to rounding, so only the upper clamp can bite. The product is rounded to f32
            // first, as in ggml-base (built without FMA); a build that contracts
            // `iscale·v + 1.5·2^23` into one FMA can round a value differently.
            *q = ((iscale * v).round_ties_even() as i32).min(127) as i8;
        }
        ob[0..4].copy_from_slice(&(1.0f32 / iscale).to_le_bytes());
        for (o, &q) in ob[Q8K_QS..Q8K_QS + QK_K].iter_mut().zip(&qs) {
            *o = q as u8;
        }
        for (k, group) in qs.chunks_exact(16).enumerate() {
            let sum: i16 = group.iter().map(|&q| i16::from(q)).sum();
            ob[Q8K_BSUMS + 2 * k..Q8K_BSUMS + 2 * k + 2].copy_from_slice(&sum.to_le_bytes());
        }
    }
}

/// Quantizes `x` (a multiple of 256 long) into `ty` blocks appended to `out`, with a plain
/// min/max quantizer: each sub-block's scale (and Q4_K/Q5_K minimum) is fitted to its range,
/// then quantized to 6 bits (Q6_K: 8 bits) relative to the super-block's largest.
///
/// This is not ggml's `quantize_row_q*_K_ref`, whose iterative scale search (`make_qkx2_quants`)
/// lowers the error further: it exists so that kvgate can write synthetic K-quant models and
/// test data. Any valid block runs the same through kvgate and llama.cpp, so parity tests do not
/// depend on which quantizer made the file.
pub fn quantize_row_k(ty: KQuantType, x: &[f32], out: &mut Vec<u8>) {
    assert!(
        x.len().is_multiple_of(QK_K),
        "quantize_row_k: {} values is not a multiple of {QK_K}",
        x.len()
    );
    for xb in x.chunks_exact(QK_K) {
        match ty {
            KQuantType::Q4K => quantize_block_min_k(xb, 4, out),
            KQuantType::Q5K => quantize_block_min_k(xb, 5, out),
            KQuantType::Q6K => quantize_block_q6_k(xb, out),
        }
    }
}

/// `v / unit` rounded and clamped to `0..=max` (0 when `unit` is 0).
fn level(v: f32, unit: f32, max: i32) -> i32 {
    if unit == 0.0 {
        return 0;
    }
    ((v / unit).round() as i32).clamp(0, max)
}

/// One Q4_K (`bits` = 4) or Q5_K (`bits` = 5) block: value = d·sc·q − dmin·m.
fn quantize_block_min_k(x: &[f32], bits: u32, out: &mut Vec<u8>) {
    let qmax = (1i32 << bits) - 1;
    // Per 32-element sub-block: step (max − min)/qmax and minimum −min ≥ 0 (the range is
    // widened to include 0 so that the minimum is never negative, as in ggml).
    let mut steps = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        let lo = sub.iter().fold(0.0f32, |a, &v| a.min(v));
        let hi = sub.iter().fold(0.0f32, |a, &v| a.max(v));
        steps[j] = (hi - lo) / qmax as f32;
        mins[j] = -lo;
    }
    let d = half::f16::from_f32(steps.iter().fold(0.0f32, |a, &v| a.max(v)) / 63.0);
    let dmin = half::f16::from_f32(mins.iter().fold(0.0f32, |a, &v| a.max(v)) / 63.0);
    let (df, dminf) = (d.to_f32(), dmin.to_f32());
    let mut sc = [0u8; 8];
    let mut m = [0u8; 8];
    for j in 0..8 {
        // Round the scale up so that the sub-block's range still fits in qmax steps.
        sc[j] = if df == 0.0 {
            0
        } else {
            ((steps[j] / df).ceil() as i32).clamp(0, 63) as u8
        };
        m[j] = level(mins[j], dminf, 63) as u8;
    }
    let mut q = [0u8; QK_K];
    for (e, v) in x.iter().enumerate() {
        let j = e / 32;
        let unit = df * f32::from(sc[j]);
        q[e] = level(v + dminf * f32::from(m[j]), unit, qmax) as u8;
    }
    out.extend(d.to_le_bytes());
    out.extend(dmin.to_le_bytes());
    let mut scales = [0u8; 12];
    for j in 0..4 {
        scales[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        scales[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        scales[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
    out.extend(scales);
    if bits == 5 {
        let mut qh = [0u8; 32];
        for (e, &v) in q.iter().enumerate() {
            let (j, h, l) = (e / 64, (e / 32) % 2, e % 32);
            qh[l] |= ((v >> 4) & 1) << (2 * j + h);
        }
        out.extend(qh);
    }
    for chunk in q.chunks_exact(64) {
        out.extend((0..32).map(|l| (chunk[l] & 0x0F) | ((chunk[l + 32] & 0x0F) << 4)));
    }
}

/// One Q6_K block: value = d·sc·(q − 32) with signed 8-bit scales per 16 elements.
fn quantize_block_q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut steps = [0.0f32; 16];
    for (g, sub) in x.chunks_exact(16).enumerate() {
        steps[g] = sub.iter().fold(0.0f32, |a, &v| a.max(v.abs())) / 31.0;
    }
    let d = half::f16::from_f32(steps.iter().fold(0.0f32, |a, &v| a.max(v)) / 127.0);
    let df = d.to_f32();
    let mut sc = [0i8; 16];
    for g in 0..16 {
        sc[g] = if df == 0.0 {
            0
        } else {
            ((steps[g] / df).ceil() as i32).clamp(0, 127) as i8
        };
    }
    let mut q = [0u8; QK_K];
    for (e, &v) in x.iter().enumerate() {
        let unit = df * f32::from(sc[e / 16]);
        // A zero unit gives level 0, value d·0·(0 − 32) = 0: still exact for an all-zero group.
        q[e] = level(v + 32.0 * unit, unit, 63) as u8;
    }
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for (half, hq) in q.chunks_exact(128).enumerate() {
        let (ql, qh) = (&mut ql[64 * half..], &mut qh[32 * half..]);
        for l in 0..32 {
            ql[l] = (hq[l] & 0x0F) | ((hq[l + 64] & 0x0F) << 4);
            ql[l + 32] = (hq[l + 32] & 0x0F) | ((hq[l + 96] & 0x0F) << 4);
            qh[l] = (hq[l] >> 4)
                | ((hq[l + 32] >> 4) << 2)
                | ((hq[l + 64] >> 4) << 4)
                | ((hq[l + 96] >> 4) << 6);
        }
    }
    out.extend(ql);
    out.extend(qh);
    out.extend(sc.map(|s| s as u8));
    out.extend(d.to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q8_k_fields(b: &[u8]) -> (f32, Vec<i8>, Vec<i16>) {
        let qs = b[Q8K_QS..Q8K_QS + QK_K].iter().map(|&q| q as i8).collect();
        let bsums = b[Q8K_BSUMS..]
            .chunks_exact(2)
            .map(|p| i16::from_le_bytes([p[0], p[1]]))
            .collect();
        (read_f32(b, 0), qs, bsums)
    }

    #[test]
    fn scale_min_k4_unpacks_all_six_bits() {
        // Sub-block 5: scale low nibble from byte 9, top bits from byte 1; min from byte 9's
        // high nibble and byte 5's top bits.
        let mut q = [0u8; 12];
        q[1] = 0b10_000011;
        q[5] = 0b01_000111;
        q[9] = 0xA5;
        let (sc, m) = scale_min_k4(&q);
        assert_eq!((sc[1], m[1]), (3, 7));
        assert_eq!(sc[5], 0x05 | (0b10 << 4));
        assert_eq!(m[5], 0x0A | (0b01 << 4));
    }

    #[test]
    fn q5_k_high_bits_follow_ggml_order() {
        let mut b = vec![0u8; Q5_K_BLOCK_BYTES];
        b[K5_QH + 3] = 0b0000_0110; // element 32+3 (bit 1) and element 64+3 (bit 2)
        let q = q5_k_quants(&b);
        assert_eq!((q[3], q[35], q[67], q[99]), (0, 16, 16, 0));
    }

    #[test]
    fn q6_k_values_use_ql_nibbles_and_qh_pairs() {
        let mut b = vec![0u8; Q6_K_BLOCK_BYTES];
        b[64 + 33] = 0x7C; // second half, element 128+32+1 low nibble C, element 128+96+1 high 7
        b[K6_QH + 32 + 1] = 0b11_00_10_00; // pair for +32 = 2, pair for +96 = 3
        let q = q6_k_quants(&b);
        assert_eq!(q[128 + 33], (0x0C | (2 << 4)) - 32);
        assert_eq!(q[128 + 97], (0x07 | (3 << 4)) - 32);
        assert_eq!(q[0], -32);
    }

    #[test]
    fn dequantize_rejects_wrong_sizes() {
        let mut out = [0.0f32; QK_K];
        assert_eq!(
            dequantize_row_k(KQuantType::Q4K, &[0u8; 143], &mut out),
            Err(KQuantSizeError::DataSize {
                ty: KQuantType::Q4K,
                cols: 256,
                expected: 144,
                actual: 143
            })
        );
        let mut odd = [0.0f32; 200];
        let err = dequantize_row_k(KQuantType::Q6K, &[0u8; 210], &mut odd).unwrap_err();
        assert_eq!(
            err.to_string(),
            "Q6K rows need a multiple of 256 values, got 200"
        );
    }

    #[test]
    fn q8_k_uses_signed_max_and_block_sums() {
        let mut x = [0.0f32; QK_K];
        x[0] = 10.0;
        x[7] = -127.0; // largest magnitude, negative: iscale = 1 exactly, so halves stay halves
        x[20] = 0.5; // rounds to even: 0
        x[21] = 1.5; // 2
        x[22] = -2.5; // -2
        let mut out = vec![0u8; Q8_K_BLOCK_BYTES];
        quantize_row_q8_k(&x, &mut out);
        let (d, qs, bsums) = q8_k_fields(&out);
        assert_eq!(d, 1.0);
        assert_eq!((qs[0], qs[7]), (10, -127));
        assert_eq!((qs[20], qs[21], qs[22]), (0, 2, -2));
        assert_eq!(bsums[0], 10 - 127);
        assert_eq!(bsums[1], 0);
        assert!(bsums[2..].iter().all(|&s| s == 0));
    }

    #[test]
    fn quantize_row_k_round_trips_within_a_step() {
        // Values of mixed sign and magnitude per sub-block; each dequantized value must be
        // within one quantization step (scale unit) of the input, and the layouts must
        // decode through the independent-reference-checked `dequantize_row_k`.
        let x: Vec<f32> = (0..2 * QK_K)
            .map(|i| ((i * 7919 % 613) as f32 / 613.0 - 0.4) * if i % 100 < 30 { 2.0 } else { 0.3 })
            .collect();
        for ty in [KQuantType::Q4K, KQuantType::Q5K, KQuantType::Q6K] {
            let mut bytes = Vec::new();
            quantize_row_k(ty, &x, &mut bytes);
            assert_eq!(bytes.len(), 2 * ty.block_bytes(), "{ty:?}");
            let mut y = vec![0.0f32; x.len()];
            dequantize_row_k(ty, &bytes, &mut y).expect("sizes match");
            let levels = match ty {
                KQuantType::Q4K => 15.0,
                KQuantType::Q5K => 31.0,
                KQuantType::Q6K => 31.0,
            };
            for (sub, (xs, ys)) in x.chunks(32).zip(y.chunks(32)).enumerate() {
                let range = xs.iter().fold(0.0f32, |a, v| a.max(v.abs())) * 2.0;
                // One step of the sub-block's range plus the 6-bit scale rounding (1/63 of the
                // largest step) and the minimum's rounding.
                let tol = range / levels * 1.1 + range / 63.0;
                for (a, b) in xs.iter().zip(ys) {
                    assert!(
                        (a - b).abs() <= tol,
                        "{ty:?} sub {sub}: {a} vs {b} (tol {tol})"
                    );
                }
            }
        }
    }

    #[test]
    fn q8_k_zero_block_is_all_zero() {
        let mut out = vec![0xAAu8; 2 * Q8_K_BLOCK_BYTES];
        let mut x = vec![0.0f32; 2 * QK_K];
        x[300] = 1.0;
        quantize_row_q8_k(&x, &mut out);
        assert!(out[..Q8_K_BLOCK_BYTES].iter().all(|&b| b == 0));
        let (d, qs, _) = q8_k_fields(&out[Q8_K_BLOCK_BYTES..]);
        assert_eq!((d, qs[300 - QK_K]), (-1.0 / 127.0, -127));
    }
}
