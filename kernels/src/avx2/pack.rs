//! Activation rows quantized for the AVX2 matmul kernels: ggml's AVX2 `quantize_row_q8_0` /
//! `quantize_row_q8_1` arithmetic, stored block-major with f32 scales so that a tile reads the
//! activation rows of one weight block from adjacent memory and never converts f16 scales.

use crate::quant::QK;
use std::arch::x86_64::*;

/// Activations quantized for the AVX2 kernels, block-major so that the activation rows a tile
/// reads for one weight block are adjacent: block `b` of row `a` is `qs[(b*m + a)*32..]`, its
/// scale `d[b*m + a]` (broadcast by the kernels; one copy keeps the packed rows in L1), and (Q8_1) its sum
/// `s[b*s_stride + a]`. Scales and sums are already rounded through f16.
#[derive(Default)]
pub(crate) struct PackedActs {
    pub(super) nb: usize,
    pub(super) m: usize,
    pub(super) s_stride: usize,
    pub(super) qs: Vec<i8>,
    pub(super) d: Vec<f32>,
    pub(super) s: Vec<f32>,
}

/// Quantizes the `m` rows of `x` (`m × cols`) into `p`; `with_sums` for Q8_1 (Q4_1 weights).
pub(super) fn pack_acts(x: &[f32], m: usize, cols: usize, with_sums: bool, p: &mut PackedActs) {
    let nb = cols / QK;
    p.nb = nb;
    p.m = m;
    // Padding lets a tile read 8 sums starting at any activation row.
    p.s_stride = m.next_multiple_of(8) + 8;
    p.qs.resize(m * nb * QK, 0);
    p.d.resize(m * nb, 0.0);
    p.s.clear();
    if with_sums {
        p.s.resize(nb * p.s_stride, 0.0);
    }
    for a in 0..m {
        // SAFETY: AVX2/F16C detected by the caller's dispatch; buffers sized above.
        unsafe { quantize_row(&x[a * cols..(a + 1) * cols], a, p, with_sums) };
    }
}

/// ggml's AVX2 `quantize_row_q8_0` / `quantize_row_q8_1` for activation row `a`, written into
/// the block-major layout of `p`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_row(x: &[f32], a: usize, p: &mut PackedActs, with_sums: bool) {
    let m = p.m;
    assert!(x.len() == p.nb * QK && a < m && p.qs.len() == m * x.len() && p.d.len() == m * p.nb);
    assert!(!with_sums || p.s.len() == p.nb * p.s_stride);
    let sign = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (b, xb) in x.chunks_exact(QK).enumerate() {
        let px = xb.as_ptr();
        let slot = b * m + a;
        // SAFETY: `xb` has 32 elements; `qs` has 32 bytes at `slot * 32` (asserted above).
        unsafe {
            let v = [
                _mm256_loadu_ps(px),
                _mm256_loadu_ps(px.add(8)),
                _mm256_loadu_ps(px.add(16)),
                _mm256_loadu_ps(px.add(24)),
            ];
            let mut max_abs = _mm256_andnot_ps(sign, v[0]);
            for vi in &v[1..] {
                max_abs = _mm256_max_ps(max_abs, _mm256_andnot_ps(sign, *vi));
            }
            let mut max4 = _mm_max_ps(
                _mm256_extractf128_ps(max_abs, 1),
                _mm256_castps256_ps128(max_abs),
            );
            max4 = _mm_max_ps(max4, _mm_movehl_ps(max4, max4));
            max4 = _mm_max_ss(max4, _mm_movehdup_ps(max4));
            let amax = _mm_cvtss_f32(max4);
            let scale = amax / 127.0;
            p.d[slot] = round_f16(scale);
            let mul = _mm256_set1_ps(if amax != 0.0 { 127.0 / amax } else { 0.0 });
            let i: [__m256i; 4] = std::array::from_fn(|j| {
                _mm256_cvtps_epi32(_mm256_round_ps::<_MM_FROUND_TO_NEAREST_INT>(_mm256_mul_ps(
                    v[j], mul,
                )))
            });
            if with_sums {
                let sum = hsum_i32_8(_mm256_add_epi32(
                    _mm256_add_epi32(i[0], i[1]),
                    _mm256_add_epi32(i[2], i[3]),
                ));
                p.s[b * p.s_stride + a] = round_f16(scale * sum as f32);
            }
            let lo = _mm256_packs_epi32(i[0], i[1]);
            let hi = _mm256_packs_epi32(i[2], i[3]);
            let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), perm);
            _mm256_storeu_si256(p.qs.as_mut_ptr().add(slot * QK).cast(), bytes);
        }
    }
}

#[inline(always)]
fn round_f16(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i32_8(a: __m256i) -> i32 {
    let sum128 = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    let hi64 = _mm_unpackhi_epi64(sum128, sum128);
    let sum64 = _mm_add_epi32(hi64, sum128);
    let hi32 = _mm_shuffle_epi32(sum64, 0b10_11_00_01);
    _mm_cvtsi128_si32(_mm_add_epi32(sum64, hi32))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{Q8_1_BLOCK_BYTES, quantize_row_q8_0, quantize_row_q8_1, read_f16};

    #[test]
    fn packed_quants_match_the_scalar_quantizers() {
        if crate::simd_level() != crate::SimdLevel::Avx2 {
            return;
        }
        let (m, cols) = (3, 96);
        let mut x: Vec<f32> = (0..m * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.07)
            .collect();
        x[cols..cols + QK].fill(0.0); // an all-zero block
        x[5] = 2.5 * 127.0 / 50.0 * 0.07; // values near rounding ties
        let mut p = PackedActs::default();
        pack_acts(&x, m, cols, true, &mut p);
        let nb = cols / QK;
        for a in 0..m {
            let mut q1 = vec![0u8; nb * Q8_1_BLOCK_BYTES];
            quantize_row_q8_1(&x[a * cols..(a + 1) * cols], &mut q1);
            let mut q0 = vec![0u8; nb * crate::quant::Q8_0_BLOCK_BYTES];
            quantize_row_q8_0(&x[a * cols..(a + 1) * cols], &mut q0);
            for b in 0..nb {
                let blk = &q1[b * Q8_1_BLOCK_BYTES..(b + 1) * Q8_1_BLOCK_BYTES];
                let slot = b * m + a;
                assert_eq!(p.d[slot], read_f16(blk, 0), "d a{a} b{b}");
                assert_eq!(p.s[b * p.s_stride + a], read_f16(blk, 2), "s a{a} b{b}");
                let qs: Vec<u8> = p.qs[slot * QK..(slot + 1) * QK]
                    .iter()
                    .map(|&q| q as u8)
                    .collect();
                assert_eq!(&qs[..], &blk[4..], "qs a{a} b{b}");
                assert_eq!(
                    &q0[b * 34 + 2..(b + 1) * 34],
                    &blk[4..],
                    "q8_0 vs q8_1 a{a} b{b}"
                );
            }
        }
    }
}
