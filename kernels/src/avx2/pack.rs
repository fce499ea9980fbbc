//! Activation rows quantized for the AVX2 matmul kernels: ggml's AVX2 `quantize_row_q8_0` /
//! `quantize_row_q8_1` arithmetic, stored block-major with f32 scales so that a tile reads the
//! activation rows of one weight block from adjacent memory and never converts f16 scales.

use super::hsum_i32_8;
use crate::quant::QK;
use crate::simd::Avx2Fma;
use std::arch::x86_64::*;

/// Activations quantized for the AVX2 kernels, block-major so that the activation rows a tile
/// reads for one weight block are adjacent: block `b` of row `a` is `qs[(b*m + a)*32..]`, its
/// scale `d[b*m + a]` (broadcast by the kernels; one copy keeps the packed rows in L1), and (Q8_1) its sum
/// `s[b*s_stride + a]`. Scales and sums are already rounded through f16.
///
/// Q8_1 activations for two or more rows of the Q4_1 batched kernel are instead stored
/// *grouped* (Q5_1's kernels read the block-major layout, sums included): rows in groups of [`GROUP`], and for block `b` of group `g` the 256 bytes at
/// `qs[(b*groups + g)*256..]` hold eight registers, register `j` carrying elements `4j..4j+4` of
/// each of the group's rows (row `r` of the group at bytes `4r..4r+4`); scales and sums at
/// `d[(b*groups + g)*8 + r]`, `s[(b*groups + g)*8 + r]`. Rows past `m` in the last group are zero.
#[derive(Default)]
pub(crate) struct PackedActs {
    pub(super) nb: usize,
    pub(super) m: usize,
    /// Grouped layout (see above) rather than block-major.
    pub(super) grouped: bool,
    /// Row groups of the grouped layout.
    pub(super) groups: usize,
    pub(super) s_stride: usize,
    pub(super) qs: LineAligned,
    pub(super) d: Vec<f32>,
    pub(super) s: Vec<f32>,
}

#[cfg(test)]
impl PackedActs {
    /// (grouped layout, activation sums present): which layout a dispatch packed, for tests.
    pub(crate) fn layout(&self) -> (bool, bool) {
        (self.grouped, !self.s.is_empty())
    }
}

/// Bytes starting on a cache line, so that no 32-byte block load of the kernels is split
/// between two lines (a plain `Vec<i8>` from malloc is only 16-byte aligned).
#[derive(Default)]
pub(crate) struct LineAligned {
    lines: Vec<Line>,
    len: usize,
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([i8; 64]);

impl LineAligned {
    /// Sets the length to `len`; bytes beyond the old length are zero.
    fn resize(&mut self, len: usize) {
        self.lines.resize(len.div_ceil(64), Line([0; 64]));
        self.len = len;
    }

    fn clear(&mut self) {
        self.lines.clear();
        self.len = 0;
    }
}

impl std::ops::Deref for LineAligned {
    type Target = [i8];
    fn deref(&self) -> &[i8] {
        // SAFETY: `lines` holds at least `len` initialised bytes (`resize`), and `Line` is plain
        // bytes with no padding.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast(), self.len) }
    }
}

impl std::ops::DerefMut for LineAligned {
    fn deref_mut(&mut self) -> &mut [i8] {
        // SAFETY: as for `deref`, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast(), self.len) }
    }
}

/// Activation rows per group of the grouped layout (one per f32 lane).
pub(crate) const GROUP: usize = 8;

/// Quantizes the `m` rows of `x` (`m × cols`) into `p`; `with_sums` for Q8_1 (Q4_1, Q5_1
/// weights); `grouped`: the grouped layout when `m ≥ 2` (Q4_1's kernels; needs `with_sums`).
pub(super) fn pack_acts(
    _cpu: Avx2Fma,
    x: &[f32],
    m: usize,
    cols: usize,
    with_sums: bool,
    grouped: bool,
    p: &mut PackedActs,
) {
    assert!(with_sums || !grouped, "the grouped layout is Q8_1's");
    let nb = cols / QK;
    p.nb = nb;
    p.m = m;
    p.grouped = grouped && m >= 2;
    p.groups = m.div_ceil(GROUP);
    p.s.clear();
    if p.grouped {
        let slots = nb * p.groups * GROUP;
        p.s_stride = 0;
        // Cleared, so that the padding rows of the last group are zeros, not stale values.
        p.qs.clear();
        p.qs.resize(slots * QK);
        p.d.clear();
        p.d.resize(slots, 0.0);
        p.s.resize(slots, 0.0);
    } else {
        // Padding lets a tile read 8 sums starting at any activation row.
        p.s_stride = m.next_multiple_of(8) + 8;
        p.qs.resize(m * nb * QK);
        p.d.resize(m * nb, 0.0);
        if with_sums {
            p.s.resize(nb * p.s_stride, 0.0);
        }
    }
    for a in 0..m {
        // SAFETY: `_cpu` proves AVX2/FMA/F16C; buffers sized above.
        unsafe { quantize_row(&x[a * cols..(a + 1) * cols], a, p, with_sums) };
    }
}

/// ggml's AVX2 `quantize_row_q8_0` / `quantize_row_q8_1` for activation row `a`, written into
/// the block-major layout of `p`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn quantize_row(x: &[f32], a: usize, p: &mut PackedActs, with_sums: bool) {
    let m = p.m;
    let rows = if p.grouped { p.groups * GROUP } else { m };
    assert!(x.len() == p.nb * QK && a < m);
    assert!(p.qs.len() == rows * x.len() && p.d.len() == rows * p.nb);
    assert!(!with_sums || p.s.len() >= p.nb * p.s_stride.max(p.groups * GROUP));
    // Where block b of row a goes: (slot of its scale and sum, byte offset, byte stride
    // between its 4-element pieces).
    let (g, r) = (a / GROUP, a % GROUP);
    let (grouped, groups, s_stride) = (p.grouped, p.groups, p.s_stride);
    let place = |b: usize| {
        if grouped {
            let slot = (b * groups + g) * GROUP + r;
            (slot, slot, (slot - r) * QK + 4 * r, QK)
        } else {
            (b * m + a, b * s_stride + a, (b * m + a) * QK, 4)
        }
    };
    let sign = _mm256_set1_ps(-0.0);
    let perm = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (b, xb) in x.chunks_exact(QK).enumerate() {
        let px = xb.as_ptr();
        let (slot, s_slot, offset, stride) = place(b);
        // SAFETY: `xb` has 32 elements; `qs` holds this block's 32 bytes at `offset` (+ 4 bytes
        // at each of the 8 strides when grouped), within the lengths asserted above.
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
                p.s[s_slot] = round_f16(scale * sum as f32);
            }
            let lo = _mm256_packs_epi32(i[0], i[1]);
            let hi = _mm256_packs_epi32(i[2], i[3]);
            let bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(lo, hi), perm);
            if stride == 4 {
                _mm256_storeu_si256(p.qs.as_mut_ptr().add(offset).cast(), bytes);
            } else {
                let mut pieces = [0i32; 8];
                _mm256_storeu_si256(pieces.as_mut_ptr().cast(), bytes);
                for (j, piece) in pieces.into_iter().enumerate() {
                    p.qs.as_mut_ptr()
                        .add(offset + j * stride)
                        .cast::<i32>()
                        .write_unaligned(piece);
                }
            }
        }
    }
}

#[inline(always)]
fn round_f16(v: f32) -> f32 {
    half::f16::from_f32(v).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{Q8_1_BLOCK_BYTES, quantize_row_q8_0, quantize_row_q8_1, read_f16};

    /// Row `a`'s block `b` from either layout: (d, s, 32 quants).
    fn block_of(p: &PackedActs, a: usize, b: usize) -> (f32, Option<f32>, Vec<u8>) {
        if p.grouped {
            let (g, r) = (a / GROUP, a % GROUP);
            let slot = (b * p.groups + g) * GROUP + r;
            let base = (slot - r) * QK + 4 * r;
            let qs = (0..QK)
                .map(|e| p.qs[base + (e / 4) * QK + e % 4] as u8)
                .collect();
            (p.d[slot], Some(p.s[slot]), qs)
        } else {
            let slot = b * p.m + a;
            let s = (!p.s.is_empty()).then(|| p.s[b * p.s_stride + a]);
            let qs = p.qs[slot * QK..(slot + 1) * QK]
                .iter()
                .map(|&q| q as u8)
                .collect();
            (p.d[slot], s, qs)
        }
    }

    #[test]
    fn packed_quants_match_the_scalar_quantizers() {
        let Some(cpu) = Avx2Fma::detect() else {
            return;
        };
        let cols = 96;
        let nb = cols / QK;
        // m = 1 and Q8_0 are block-major, and so is Q8_1 unless grouped (Q5_1); grouped Q8_1
        // with m ≥ 2 (Q4_1; 11 rows: a full group and a partial one).
        for (m, with_sums, grouped) in [
            (1, true, true),
            (3, false, false),
            (3, true, true),
            (11, true, true),
            (3, true, false),
            (11, true, false),
        ] {
            let mut x: Vec<f32> = (0..m * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.07)
                .collect();
            x[(m - 1) * cols..(m - 1) * cols + QK].fill(0.0); // an all-zero block
            x[5] = 2.5 * 127.0 / 50.0 * 0.07; // values near rounding ties
            let mut p = PackedActs::default();
            // Stale contents from a bigger call must not leak into the padding rows.
            pack_acts(
                cpu,
                &vec![3.0; 16 * cols],
                16,
                cols,
                with_sums,
                grouped,
                &mut p,
            );
            pack_acts(cpu, &x, m, cols, with_sums, grouped, &mut p);
            assert_eq!(p.grouped, grouped && m >= 2);
            for a in 0..m {
                let mut q1 = vec![0u8; nb * Q8_1_BLOCK_BYTES];
                quantize_row_q8_1(&x[a * cols..(a + 1) * cols], &mut q1);
                let mut q0 = vec![0u8; nb * crate::quant::Q8_0_BLOCK_BYTES];
                quantize_row_q8_0(&x[a * cols..(a + 1) * cols], &mut q0);
                for b in 0..nb {
                    let blk = &q1[b * Q8_1_BLOCK_BYTES..(b + 1) * Q8_1_BLOCK_BYTES];
                    let (d, s, qs) = block_of(&p, a, b);
                    assert_eq!(d, read_f16(blk, 0), "m{m} d a{a} b{b}");
                    if with_sums {
                        assert_eq!(s, Some(read_f16(blk, 2)), "m{m} s a{a} b{b}");
                    } else {
                        assert_eq!(s, None, "Q8_0 has no sums");
                    }
                    assert_eq!(&qs[..], &blk[4..], "m{m} qs a{a} b{b}");
                    assert_eq!(&q0[b * 34 + 2..(b + 1) * 34], &blk[4..], "q8_0 vs q8_1");
                }
            }
            if p.grouped {
                for a in m..p.groups * GROUP {
                    for b in 0..nb {
                        let (d, s, qs) = block_of(&p, a, b);
                        assert!(d == 0.0 && s == Some(0.0) && qs.iter().all(|&q| q == 0));
                    }
                }
            }
        }
    }
}
