//! AVX2 dot products of K-quant weight rows (Q4_K, Q5_K, Q6_K) with Q8_K activation rows, in
//! ggml's AVX2 arithmetic: bit-identical to the scalar reference [`crate::dot::dot_k_q8_k`].
//!
//! Per super-block the values are unpacked to bytes 32 at a time, multiplied with the
//! activations by `maddubs` (u8 × i8 → pairs summed in i16; the largest pair, 2·63·127, cannot
//! saturate) and with the sub-block scales by `madd` (→ i32 lane `l` = elements `4l..4l+4` of
//! each 32), so the eight integer lanes are exactly the reference's; the f32 steps (one FMA per
//! lane and block, the minimum term, `hsum8`) are the reference's operations in its order.
//!
//! Activations stay in ggml's Q8_K layout (row-major, 292 bytes per block): its 256-element
//! blocks are already SIMD-friendly, and its `bsums` serve the minimum term directly. Rows are
//! computed one (weight row, activation row) pair at a time on the matmul's row split.

use super::{f16_at, hsum8};
use crate::matrix::{OutPtr, QMatrix};
use crate::quant::WeightType;
use crate::quant::kquants::{
    KQuantType, Q8_K_BLOCK_BYTES, Q8K_BSUMS, Q8K_QS, QK_K, read_f32, scale_min_k4,
};
use crate::simd::Avx2Fma;
use std::arch::x86_64::*;
use std::ops::Range;

/// Weight rows `rows` of `w` × the `m` Q8_K activation rows in `acts` (row-major).
pub(crate) fn compute_rows(
    cpu: Avx2Fma,
    w: &QMatrix,
    m: usize,
    acts: &[u8],
    rows: Range<usize>,
    out: OutPtr<'_>,
) {
    let ty = match w.ty {
        WeightType::Q4_K => KQuantType::Q4K,
        WeightType::Q5_K => KQuantType::Q5K,
        WeightType::Q6_K => KQuantType::Q6K,
        other => unreachable!("{other:?} is not a K-quant type"),
    };
    let act_bytes = w.cols / QK_K * Q8_K_BLOCK_BYTES;
    assert_eq!(acts.len(), m * act_bytes, "Q8_K activations: wrong size");
    assert!(rows.end <= w.rows, "row range past the matrix");
    for r in rows {
        let wr = w.row(r);
        for (a, xr) in acts.chunks_exact(act_bytes).enumerate() {
            let value = dot_k_q8_k(cpu, ty, wr, xr);
            // SAFETY: each thread owns a distinct range of rows `r`.
            unsafe { out.write(a * w.rows + r, value) };
        }
    }
}

/// One weight row · one Q8_K activation row; `cpu` proves the instructions exist.
pub(crate) fn dot_k_q8_k(_cpu: Avx2Fma, ty: KQuantType, w: &[u8], x: &[u8]) -> f32 {
    let nb = x.len() / Q8_K_BLOCK_BYTES;
    assert!(
        w.len() == nb * ty.block_bytes() && x.len() == nb * Q8_K_BLOCK_BYTES,
        "dot_k_q8_k: weight and activation rows differ in length"
    );
    // SAFETY: the token proves AVX2/FMA/F16C; the lengths were checked above, and the kernels
    // read only within `nb` blocks of each slice.
    unsafe {
        match ty {
            KQuantType::Q4K => dot_q4_k(w, x, nb),
            KQuantType::Q5K => dot_q5_k(w, x, nb),
            KQuantType::Q6K => dot_q6_k(w, x, nb),
        }
    }
}

/// The eight sub-block mins of a Q4_K/Q5_K block times the Q8_K sub-block sums, as ggml pairs
/// them: lane `p` = m[2p]·s[2p] + m[2p+1]·s[2p+1], `s[j]` = bsums[2j] + bsums[2j+1].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn min_products(mins: &[u8; 8], xb: *const u8) -> __m128i {
    // SAFETY: the caller guarantees a whole Q8_K block at `xb` (bsums: 32 bytes at 260);
    // `mins` is 8 bytes.
    let (lo, hi, m8) = unsafe {
        (
            _mm_loadu_si128(xb.add(Q8K_BSUMS).cast()),
            _mm_loadu_si128(xb.add(Q8K_BSUMS + 16).cast()),
            _mm_loadl_epi64(mins.as_ptr().cast()),
        )
    };
    let sums = _mm_hadd_epi16(lo, hi);
    let m16 = _mm_cvtepu8_epi16(m8);
    _mm_madd_epi16(m16, sums)
}

/// 32 weight bytes (unsigned) × 32 activations, scaled by `scale` (i16 per element pair):
/// eight exact i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scaled_lanes(values: __m256i, q8: __m256i, scale: __m256i) -> __m256i {
    _mm256_madd_epi16(scale, _mm256_maddubs_epi16(values, q8))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k(w: &[u8], x: &[u8], nb: usize) -> f32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let mut acc = _mm256_setzero_ps();
    let mut acc_m = _mm_setzero_ps();
    for i in 0..nb {
        let wb = &w[i * KQuantType::Q4K.block_bytes()..][..KQuantType::Q4K.block_bytes()];
        let xb = &x[i * Q8_K_BLOCK_BYTES..][..Q8_K_BLOCK_BYTES];
        let dx = read_f32(xb, 0);
        // SAFETY: `wb` is a whole block (d at 0, dmin at 2).
        let (dw, dminw) = unsafe { (f16_at(wb.as_ptr()), f16_at(wb.as_ptr().add(2))) };
        let d = dx * dw;
        let dmin = -dx * dminw;
        let (sc, mins) = scale_min_k4(&wb[4..16]);
        // SAFETY: `xb` is a whole Q8_K block.
        let prod = unsafe { min_products(&mins, xb.as_ptr()) };
        acc_m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc_m);
        let mut sumi = _mm256_setzero_si256();
        for j in 0..4 {
            // SAFETY: qs holds 128 bytes at 16; the Q8_K values 256 bytes at 4.
            let (bits, q8l, q8h) = unsafe {
                (
                    _mm256_loadu_si256(wb.as_ptr().add(16 + 32 * j).cast()),
                    _mm256_loadu_si256(xb.as_ptr().add(Q8K_QS + 64 * j).cast()),
                    _mm256_loadu_si256(xb.as_ptr().add(Q8K_QS + 64 * j + 32).cast()),
                )
            };
            let lo = _mm256_and_si256(bits, m4);
            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
            let scale_l = _mm256_set1_epi16(i16::from(sc[2 * j]));
            let scale_h = _mm256_set1_epi16(i16::from(sc[2 * j + 1]));
            // SAFETY: plain register arithmetic under this function's features.
            let (pl, ph) = unsafe {
                (
                    scaled_lanes(lo, q8l, scale_l),
                    scaled_lanes(hi, q8h, scale_h),
                )
            };
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    acc_m = _mm_add_ps(acc_m, _mm_movehl_ps(acc_m, acc_m));
    acc_m = _mm_add_ss(acc_m, _mm_movehdup_ps(acc_m));
    // SAFETY: register arithmetic only.
    unsafe { hsum8(acc) + _mm_cvtss_f32(acc_m) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_k(w: &[u8], x: &[u8], nb: usize) -> f32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let one = _mm256_set1_epi8(1);
    let mut acc = _mm256_setzero_ps();
    let mut summs = 0.0f32;
    for i in 0..nb {
        let wb = &w[i * KQuantType::Q5K.block_bytes()..][..KQuantType::Q5K.block_bytes()];
        let xb = &x[i * Q8_K_BLOCK_BYTES..][..Q8_K_BLOCK_BYTES];
        let dx = read_f32(xb, 0);
        // SAFETY: `wb` is a whole block (d at 0, dmin at 2).
        let (dw, dminw) = unsafe { (f16_at(wb.as_ptr()), f16_at(wb.as_ptr().add(2))) };
        let d = dx * dw;
        let dmin = -dx * dminw;
        let (sc, mins) = scale_min_k4(&wb[4..16]);
        // SAFETY: `xb` is a whole Q8_K block.
        let prod = unsafe { min_products(&mins, xb.as_ptr()) };
        let mut lanes = [0i32; 4];
        // SAFETY: `lanes` is 16 writable bytes.
        unsafe { _mm_storeu_si128(lanes.as_mut_ptr().cast(), prod) };
        let total: i32 = lanes.iter().sum();
        summs = dmin.mul_add(total as f32, summs);
        // SAFETY: qh is 32 bytes at 16.
        let hbits = unsafe { _mm256_loadu_si256(wb.as_ptr().add(16).cast()) };
        let mut sumi = _mm256_setzero_si256();
        for j in 0..4 {
            // SAFETY: qs holds 128 bytes at 48; the Q8_K values 256 bytes at 4.
            let (bits, q8l, q8h) = unsafe {
                (
                    _mm256_loadu_si256(wb.as_ptr().add(48 + 32 * j).cast()),
                    _mm256_loadu_si256(xb.as_ptr().add(Q8K_QS + 64 * j).cast()),
                    _mm256_loadu_si256(xb.as_ptr().add(Q8K_QS + 64 * j + 32).cast()),
                )
            };
            // Fifth bits: bit 2j of qh[l] for the low nibbles, 2j + 1 for the high ones. A
            // 16-bit shift then a per-byte mask of 1 keeps each byte's own bit.
            let high = |bit: i32| {
                let shifted = _mm256_srl_epi16(hbits, _mm_cvtsi32_si128(bit));
                _mm256_slli_epi16::<4>(_mm256_and_si256(shifted, one))
            };
            let lo = _mm256_or_si256(_mm256_and_si256(bits, m4), high(2 * j as i32));
            let hi = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4),
                high(2 * j as i32 + 1),
            );
            let scale_l = _mm256_set1_epi16(i16::from(sc[2 * j]));
            let scale_h = _mm256_set1_epi16(i16::from(sc[2 * j + 1]));
            // SAFETY: plain register arithmetic under this function's features.
            let (pl, ph) = unsafe {
                (
                    scaled_lanes(lo, q8l, scale_l),
                    scaled_lanes(hi, q8h, scale_h),
                )
            };
            sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(pl, ph));
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    // SAFETY: register arithmetic only.
    unsafe { hsum8(acc) + summs }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k(w: &[u8], x: &[u8], nb: usize) -> f32 {
    let m4 = _mm256_set1_epi8(0x0F);
    let m3 = _mm256_set1_epi8(3);
    let m32 = _mm256_set1_epi8(32);
    let mut acc = _mm256_setzero_ps();
    for i in 0..nb {
        let wb = &w[i * KQuantType::Q6K.block_bytes()..][..KQuantType::Q6K.block_bytes()];
        let xb = &x[i * Q8_K_BLOCK_BYTES..][..Q8_K_BLOCK_BYTES];
        // SAFETY: `wb` is a whole block (d at 208).
        let d = read_f32(xb, 0) * unsafe { f16_at(wb.as_ptr().add(208)) };
        let scales = &wb[192..208];
        let mut sumi = _mm256_setzero_si256();
        for half in 0..2 {
            // SAFETY: ql is 128 bytes at 0, qh 64 bytes at 128.
            let (bits1, bits2, bits_h) = unsafe {
                (
                    _mm256_loadu_si256(wb.as_ptr().add(64 * half).cast()),
                    _mm256_loadu_si256(wb.as_ptr().add(64 * half + 32).cast()),
                    _mm256_loadu_si256(wb.as_ptr().add(128 + 32 * half).cast()),
                )
            };
            let h = |v: __m256i| _mm256_slli_epi16::<4>(_mm256_and_si256(v, m3));
            let values = [
                _mm256_or_si256(_mm256_and_si256(bits1, m4), h(bits_h)),
                _mm256_or_si256(
                    _mm256_and_si256(bits2, m4),
                    h(_mm256_srli_epi16::<2>(bits_h)),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(bits1), m4),
                    h(_mm256_srli_epi16::<4>(bits_h)),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(bits2), m4),
                    h(_mm256_srli_epi16::<6>(bits_h)),
                ),
            ];
            for (k, &v) in values.iter().enumerate() {
                // SAFETY: the Q8_K values are 256 bytes at 4.
                let q8 = unsafe {
                    _mm256_loadu_si256(xb.as_ptr().add(Q8K_QS + 128 * half + 32 * k).cast())
                };
                // Values are stored +32 (unsigned for maddubs): subtract 32·x per pair.
                let p16 =
                    _mm256_sub_epi16(_mm256_maddubs_epi16(v, q8), _mm256_maddubs_epi16(m32, q8));
                // Elements 0..16 of this run take group scale 2k, 16..32 group 2k + 1.
                let g = 8 * half + 2 * k;
                let scale = _mm256_set_m128i(
                    _mm_set1_epi16(i16::from(scales[g + 1] as i8)),
                    _mm_set1_epi16(i16::from(scales[g] as i8)),
                );
                sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(scale, p16));
            }
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sumi), acc);
    }
    // SAFETY: register arithmetic only.
    unsafe { hsum8(acc) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::kquants::quantize_row_q8_k;
    use half::f16;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    const TYPES: [KQuantType; 3] = [KQuantType::Q4K, KQuantType::Q5K, KQuantType::Q6K];

    fn random_blocks(rng: &mut StdRng, ty: KQuantType, nb: usize) -> Vec<u8> {
        let mut out = vec![0u8; nb * ty.block_bytes()];
        rng.fill(&mut out[..]);
        for b in out.chunks_exact_mut(ty.block_bytes()) {
            let d =
                |rng: &mut StdRng| f16::from_f32(rng.random_range(-0.02..0.02f32)).to_le_bytes();
            match ty {
                KQuantType::Q6K => b[208..210].copy_from_slice(&d(rng)),
                _ => {
                    b[0..2].copy_from_slice(&d(rng));
                    b[2..4].copy_from_slice(&d(rng));
                }
            }
        }
        out
    }

    fn random_q8_k(rng: &mut StdRng, nb: usize, amp: f32) -> Vec<u8> {
        let xf: Vec<f32> = (0..nb * QK_K)
            .map(|_| rng.random_range(-amp..amp))
            .collect();
        let mut x = vec![0u8; nb * Q8_K_BLOCK_BYTES];
        quantize_row_q8_k(&xf, &mut x);
        x
    }

    #[test]
    fn avx2_dots_are_bit_identical_to_the_reference() {
        // Like the module's other SIMD tests: nothing to compare on a CPU without AVX2.
        let Some(cpu) = Avx2Fma::detect() else {
            return;
        };
        let mut rng = StdRng::seed_from_u64(151);
        for ty in TYPES {
            for nb in [1, 2, 5, 16] {
                for _ in 0..40 {
                    let w = random_blocks(&mut rng, ty, nb);
                    let amp = [0.01f32, 1.0, 300.0][rng.random_range(0..3)];
                    let x = random_q8_k(&mut rng, nb, amp);
                    let want = crate::dot::dot_k_q8_k(ty, &w, &x);
                    let got = dot_k_q8_k(cpu, ty, &w, &x);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "{ty:?} nb={nb}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn avx2_extremes_do_not_saturate() {
        // Every weight value at its maximum (all bits set: Q4 15, Q5 31, Q6 63 − 32 = 31)
        // and every scale at its maximum, against activations all +127 or all −127: the
        // largest maddubs pairs of the module's headroom argument, checked against the
        // scalar reference's plain i32 arithmetic.
        let Some(cpu) = Avx2Fma::detect() else {
            return;
        };
        for ty in TYPES {
            let mut w = vec![0xFFu8; 2 * ty.block_bytes()];
            for b in w.chunks_exact_mut(ty.block_bytes()) {
                let one = f16::from_f32(1.0).to_le_bytes();
                match ty {
                    KQuantType::Q6K => {
                        b[192..208].fill(127);
                        b[208..210].copy_from_slice(&one);
                    }
                    _ => {
                        b[0..2].copy_from_slice(&one);
                        b[2..4].copy_from_slice(&one);
                    }
                }
            }
            for sign in [1.0f32, -1.0] {
                let xf = vec![sign; 2 * QK_K];
                let mut x = vec![0u8; 2 * Q8_K_BLOCK_BYTES];
                quantize_row_q8_k(&xf, &mut x);
                let want = crate::dot::dot_k_q8_k(ty, &w, &x);
                let got = dot_k_q8_k(cpu, ty, &w, &x);
                assert_eq!(got.to_bits(), want.to_bits(), "{ty:?} sign {sign}");
                assert!(want.abs() > 1000.0, "{ty:?}: {want}");
            }
        }
    }
}
