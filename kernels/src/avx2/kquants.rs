//! AVX2 dot products of K-quant weight rows (Q4_K, Q5_K, Q6_K) with Q8_K activation rows, in
//! ggml's AVX2 arithmetic: bit-identical to the scalar reference [`crate::dot::dot_k_q8_k`].
//!
//! Per super-block the values are unpacked to bytes 32 at a time, multiplied with the
//! activations by `maddubs` (u8 × i8 → pairs summed in i16; the largest pair, 2·63·127, cannot
//! saturate) and with the sub-block scales by `madd` (→ i32 lane `l` = elements `4l..4l+4` of
//! each 32; Q6_K's unsigned values then give back their offset per sub-block, as ggml's
//! `q8sclsub`), so the eight integer lanes are exactly the reference's; the f32 steps (one FMA per
//! lane and block, the minimum term, `hsum8`) are the reference's operations in its order.
//!
//! Activations stay in ggml's Q8_K layout (row-major, 292 bytes per block): its 256-element
//! blocks are already SIMD-friendly, and its `bsums` serve the minimum term directly. Each
//! weight super-block is unpacked once for up to four activation rows (batched decode and
//! prefill); every (weight row, activation row) pair still runs ggml's sequence of operations.

use super::{f16_at, hsum8};
use crate::dot::KQuantOrder;
use crate::matrix::{OutPtr, QMatrix};
use crate::quant::WeightType;
use crate::quant::kquants::{
    KQuantType, Q8_K_BLOCK_BYTES, Q8K_BSUMS, Q8K_QS, QK_K, read_f32, scale_min_k4,
};
use crate::simd::Avx2Fma;
use std::arch::x86_64::*;
use std::ops::Range;

/// Activation rows that share one unpacking of a weight super-block.
const ACT_TILE: usize = 4;

/// Weight rows `rows` of `w` × the `m` Q8_K activation rows in `acts` (row-major).
pub(crate) fn compute_rows(
    _cpu: Avx2Fma,
    w: &QMatrix,
    m: usize,
    orders: &[KQuantOrder],
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
        let mut a0 = 0;
        while a0 < m {
            let n = (m - a0).min(ACT_TILE);
            let xs: [&[u8]; ACT_TILE] = std::array::from_fn(|j| {
                let a = a0 + j.min(n - 1);
                &acts[a * act_bytes..(a + 1) * act_bytes]
            });
            let tiled: [bool; ACT_TILE] =
                std::array::from_fn(|j| orders.get(a0 + j) == Some(&KQuantOrder::Tiled));
            // SAFETY: the token proves AVX2/FMA/F16C; `wr` holds `nb` weight blocks and every
            // `xs[j]` `nb` Q8_K blocks (sizes asserted above).
            let values = unsafe { dot_tile(ty, wr, &xs, &tiled, n) };
            for (j, &v) in values[..n].iter().enumerate() {
                // SAFETY: each thread owns a distinct range of rows `r`.
                unsafe { out.write((a0 + j) * w.rows + r, v) };
            }
            a0 += n;
        }
    }
}

/// One weight row · one Q8_K activation row; `cpu` proves the instructions exist. (The matmul
/// goes through [`compute_rows`]; this single-pair entry point serves the tests.)
#[cfg(test)]
pub(crate) fn dot_k_q8_k(_cpu: Avx2Fma, ty: KQuantType, w: &[u8], x: &[u8]) -> f32 {
    let nb = x.len() / Q8_K_BLOCK_BYTES;
    assert!(
        w.len() == nb * ty.block_bytes() && x.len() == nb * Q8_K_BLOCK_BYTES,
        "dot_k_q8_k: weight and activation rows differ in length"
    );
    // SAFETY: the token proves AVX2/FMA/F16C; the lengths were checked above.
    unsafe { dot_tile(ty, w, &[x; ACT_TILE], &[false; ACT_TILE], 1)[0] }
}

/// [`dot_k_q8_k`] in the tiled order ([`crate::dot::dot_k_q8_k_tiled`]), for the tests.
#[cfg(test)]
pub(crate) fn dot_k_q8_k_tiled(_cpu: Avx2Fma, ty: KQuantType, w: &[u8], x: &[u8]) -> f32 {
    let nb = x.len() / Q8_K_BLOCK_BYTES;
    assert!(w.len() == nb * ty.block_bytes() && x.len() == nb * Q8_K_BLOCK_BYTES);
    // SAFETY: the token proves AVX2/FMA/F16C; the lengths were checked above.
    unsafe { dot_tile(ty, w, &[x; ACT_TILE], &[true; ACT_TILE], 1)[0] }
}

/// One weight super-block ready for the integer products: its 256 values as eight runs of 32
/// unsigned bytes (Q6_K: value + 32) and each run's scales as 16 i16 (one per element pair).
struct Block {
    d: f32,
    dmin: f32,
    mins: [u8; 8],
    runs: [__m256i; 8],
    scales: [__m256i; 8],
    /// Q6_K: the 16 group scales as i16, for the per-sub-block offset correction.
    group_scales: __m256i,
}

/// The f32 state of one (weight row, activation row) product: the eight lanes, Q4_K's four
/// minimum lanes and Q5_K's scalar minimum sum (vec_dot order), or the one running sum of the
/// tiled order.
#[derive(Clone, Copy)]
struct Acc {
    lanes: __m256,
    mins: __m128,
    summs: f32,
    tiled: Option<f32>,
}

/// Weight row `w` · activation rows `xs[..n]` (each as long as `w` in blocks).
///
/// # Safety
/// AVX2/FMA/F16C must be available; `w` must hold whole blocks of `ty` and each of `xs[..n]`
/// as many Q8_K blocks.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_tile(
    ty: KQuantType,
    w: &[u8],
    xs: &[&[u8]; ACT_TILE],
    tiled: &[bool; ACT_TILE],
    n: usize,
) -> [f32; ACT_TILE] {
    let bb = ty.block_bytes();
    let nb = w.len() / bb;
    let mut accs = tiled.map(|t| Acc {
        lanes: _mm256_setzero_ps(),
        mins: _mm_setzero_ps(),
        summs: 0.0,
        tiled: t.then_some(0.0),
    });
    for i in 0..nb {
        // SAFETY: block i of `w` exists.
        let block = unsafe { unpack(ty, &w[i * bb..(i + 1) * bb]) };
        for (acc, x) in accs.iter_mut().zip(xs).take(n) {
            let xb = &x[i * Q8_K_BLOCK_BYTES..(i + 1) * Q8_K_BLOCK_BYTES];
            // SAFETY: `xb` is a whole Q8_K block.
            unsafe { accumulate(ty, &block, xb, acc) };
        }
    }
    // SAFETY: register arithmetic only.
    accs.map(|acc| unsafe { finish(ty, acc) })
}

/// Unpacks the super-block `wb` (ggml's AVX2 unpacking, per type).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack(ty: KQuantType, wb: &[u8]) -> Block {
    let m4 = _mm256_set1_epi8(0x0F);
    let p = wb.as_ptr();
    let mut runs = [_mm256_setzero_si256(); 8];
    let mut scales = [_mm256_setzero_si256(); 8];
    match ty {
        KQuantType::Q4K | KQuantType::Q5K => {
            let (sc, mins) = scale_min_k4(&wb[4..16]);
            let qs = if ty == KQuantType::Q4K { 16 } else { 48 };
            // SAFETY: qh (Q5_K) is 32 bytes at 16.
            let hbits = unsafe { _mm256_loadu_si256(p.add(16).cast()) };
            let one = _mm256_set1_epi8(1);
            // Q5_K's fifth bits: bit `bit` of qh[l]; a 16-bit shift then a per-byte mask of 1
            // keeps each byte's own bit.
            let high = |bit: i32| {
                let shifted = _mm256_srl_epi16(hbits, _mm_cvtsi32_si128(bit));
                _mm256_slli_epi16::<4>(_mm256_and_si256(shifted, one))
            };
            for j in 0..4 {
                // SAFETY: qs is 128 bytes at `qs`.
                let bits = unsafe { _mm256_loadu_si256(p.add(qs + 32 * j).cast()) };
                let mut lo = _mm256_and_si256(bits, m4);
                let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(bits), m4);
                if ty == KQuantType::Q5K {
                    lo = _mm256_or_si256(lo, high(2 * j as i32));
                    hi = _mm256_or_si256(hi, high(2 * j as i32 + 1));
                }
                runs[2 * j] = lo;
                runs[2 * j + 1] = hi;
                scales[2 * j] = _mm256_set1_epi16(i16::from(sc[2 * j]));
                scales[2 * j + 1] = _mm256_set1_epi16(i16::from(sc[2 * j + 1]));
            }
            // SAFETY: d at 0, dmin at 2.
            let (d, dmin) = unsafe { (f16_at(p), f16_at(p.add(2))) };
            Block {
                d,
                dmin,
                mins,
                runs,
                scales,
                group_scales: _mm256_setzero_si256(),
            }
        }
        KQuantType::Q6K => {
            let m3 = _mm256_set1_epi8(3);
            let sc = &wb[192..208];
            for half in 0..2 {
                // SAFETY: ql is 128 bytes at 0, qh 64 bytes at 128.
                let (bits1, bits2, bits_h) = unsafe {
                    (
                        _mm256_loadu_si256(p.add(64 * half).cast()),
                        _mm256_loadu_si256(p.add(64 * half + 32).cast()),
                        _mm256_loadu_si256(p.add(128 + 32 * half).cast()),
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
                for (k, v) in values.into_iter().enumerate() {
                    // Elements 0..16 of this run take group scale 2k, 16..32 group 2k + 1.
                    let g = 8 * half + 2 * k;
                    runs[4 * half + k] = v;
                    scales[4 * half + k] = _mm256_set_m128i(
                        _mm_set1_epi16(i16::from(sc[g + 1] as i8)),
                        _mm_set1_epi16(i16::from(sc[g] as i8)),
                    );
                }
            }
            Block {
                // SAFETY: d at 208.
                d: unsafe { f16_at(p.add(208)) },
                dmin: 0.0,
                mins: [0; 8],
                runs,
                scales,
                // SAFETY: the 16 scales at 192.
                group_scales: _mm256_cvtepi8_epi16(unsafe { _mm_loadu_si128(p.add(192).cast()) }),
            }
        }
    }
}

/// Adds one super-block's product with the Q8_K block `xb` to `acc`, in ggml's order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn accumulate(ty: KQuantType, block: &Block, xb: &[u8], acc: &mut Acc) {
    let mut sumi = _mm256_setzero_si256();
    for (c, (&run, &scale)) in block.runs.iter().zip(&block.scales).enumerate() {
        // SAFETY: the Q8_K values are 256 bytes at 4.
        let q8 = unsafe { _mm256_loadu_si256(xb.as_ptr().add(Q8K_QS + 32 * c).cast()) };
        let p16 = _mm256_maddubs_epi16(run, q8);
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(scale, p16));
    }
    if ty == KQuantType::Q6K {
        // The values were multiplied unsigned (+32); as ggml does, lane l gives back
        // 32 · Σ scale·x over sub-block l (`q8sclsub`), from the 16 group sums `bsums`.
        // SAFETY: bsums are 32 bytes at 260.
        let bsums = unsafe { _mm256_loadu_si256(xb.as_ptr().add(Q8K_BSUMS).cast()) };
        let offset = _mm256_slli_epi32::<5>(_mm256_madd_epi16(bsums, block.group_scales));
        sumi = _mm256_sub_epi32(sumi, offset);
    }
    let dx = read_f32(xb, 0);
    if let Some(sum) = acc.tiled.as_mut() {
        // ggml's tiled kernel: the block's exact integer totals, then r = dw·S1,
        // r = fma(−dmin, S2, r), sum = fma(r, dx, sum).
        // SAFETY: register arithmetic only.
        let mut r = block.d * unsafe { hsum_epi32(sumi) } as f32;
        if ty != KQuantType::Q6K {
            // SAFETY: `xb` is a whole Q8_K block.
            let s2 = unsafe { hsum_epi32_128(min_products(&block.mins, xb.as_ptr())) };
            r = (-block.dmin).mul_add(s2 as f32, r);
        }
        *sum = r.mul_add(dx, *sum);
        return;
    }
    acc.lanes = _mm256_fmadd_ps(
        _mm256_set1_ps(dx * block.d),
        _mm256_cvtepi32_ps(sumi),
        acc.lanes,
    );
    if ty == KQuantType::Q6K {
        return;
    }
    let dmin = -dx * block.dmin;
    // SAFETY: `xb` is a whole Q8_K block.
    let prod = unsafe { min_products(&block.mins, xb.as_ptr()) };
    if ty == KQuantType::Q4K {
        acc.mins = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc.mins);
    } else {
        let mut lanes = [0i32; 4];
        // SAFETY: `lanes` is 16 writable bytes.
        unsafe { _mm_storeu_si128(lanes.as_mut_ptr().cast(), prod) };
        let total: i32 = lanes.iter().sum();
        acc.summs = dmin.mul_add(total as f32, acc.summs);
    }
}

/// The product's value: `hsum8` of the lanes plus the type's minimum term.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn finish(ty: KQuantType, acc: Acc) -> f32 {
    if let Some(sum) = acc.tiled {
        return sum;
    }
    // SAFETY: register arithmetic only.
    let lanes = unsafe { hsum8(acc.lanes) };
    match ty {
        KQuantType::Q4K => {
            let m = _mm_add_ps(acc.mins, _mm_movehl_ps(acc.mins, acc.mins));
            lanes + _mm_cvtss_f32(_mm_add_ss(m, _mm_movehdup_ps(m)))
        }
        KQuantType::Q5K => lanes + acc.summs,
        KQuantType::Q6K => lanes,
    }
}

/// The exact sum of eight i32 lanes (wrapping like the integer SIMD adds).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_epi32(v: __m256i) -> i32 {
    let halves = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    // SAFETY: register arithmetic only.
    unsafe { hsum_epi32_128(halves) }
}

/// The exact sum of four i32 lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_epi32_128(v: __m128i) -> i32 {
    let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
    let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b10_11_00_01>(v));
    _mm_cvtsi128_si32(v)
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
                    let want = crate::dot::dot_k_q8_k_tiled(ty, &w, &x);
                    let got = dot_k_q8_k_tiled(cpu, ty, &w, &x);
                    assert_eq!(
                        got.to_bits(),
                        want.to_bits(),
                        "tiled {ty:?} nb={nb}: {got} vs {want}"
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
