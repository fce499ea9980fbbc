//! Scalar reference dot products of K-quant weight rows with Q8_K activation rows, in two orders.
//!
//! [`dot_k_q8_k`] (what kvgate computes, on every path) follows ggml's AVX2 kernels
//! (`ggml_vec_dot_q{4,5,6}_K_q8_K` in ggml-cpu/arch/x86/quants.c), which is what llama.cpp runs
//! on this hardware:
//!
//! * per super-block, eight i32 lanes: lane `l` sums exactly `scale(e) · w[e]·x[e]` over the
//!   elements with `(e mod 32) / 4 = l` (`maddubs` then `madd` with the scales); Q6_K's `w`
//!   is the stored unsigned `q = w + 32`, and lane `l` then loses `32 · Σ scale·x` over
//!   sub-block `l` (elements `32l..32l+32`, from `bsums`: ggml's `q8sclsub`);
//! * `acc[l] = fma(dx·d, lane[l], acc[l])`, reduced at the end with `hsum8`;
//! * the minimum term, `dmin' = −dx·dmin`: Q4_K keeps four f32 lanes,
//!   `acc_m[p] = fma(dmin', m[2p]·s[2p] + m[2p+1]·s[2p+1], acc_m[p])` with `s[j]` the sum of
//!   sub-block `j`'s activations, reduced as `(a0+a2) + (a1+a3)`; Q5_K keeps one f32,
//!   `summs = fma(dmin', Σ m·s, summs)`; Q6_K has none;
//! * the result is `hsum8(acc) + minimum term`.
//!
//! [`dot_k_q8_k_generic`] is ggml's generic C order (`ggml_vec_dot_q*_K_q8_K_generic`, what
//! llama.cpp runs without AVX2) as compiled for an FMA target, where `sums[l] += d * aux32[l]`
//! and `sumf -= dmin * sumi` contract into fused multiply-adds:
//!
//! * per super-block, lane `l` (0..8) sums exactly, in integers, `scale(g) · w[e]·x[e]` over the
//!   elements `e ≡ l (mod 8)`, `g` being the 16-element group of `e`;
//! * the minimum term `Σ_g min(g) · bsums[g]` is one integer per block (Q8_K's `bsums`);
//! * `sums[l] = fma(dw·dx, lane[l], sums[l])` and `sumf = fma(−dmin·dx, mins, sumf)` across blocks;
//! * the result is `sumf + sums[0] + … + sums[7]`, left to right.
//!
//! Checked once (not a committed test: it needs ggml's C) against a transcription of those C
//! functions built with GCC 12 `-O2 -march=native`: 200 random rows of 8 blocks per type gave
//! bit-identical results.
//!
//! The AVX2 kernels (`avx2/kquants.rs`) are tested bit for bit against [`dot_k_q8_k`].

use crate::quant::kquants::{
    KQuantType, KScales, Q8_K_BLOCK_BYTES, Q8K_BSUMS, Q8K_QS, QK_K, read_f32,
};

/// Q4_K weight row · Q8_K activation row (`w` and `x` hold the same number of blocks), in
/// ggml's AVX2 order.
pub fn dot_q4_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    dot_k_q8_k(KQuantType::Q4K, w, x)
}

/// Q5_K weight row · Q8_K activation row.
pub fn dot_q5_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    dot_k_q8_k(KQuantType::Q5K, w, x)
}

/// Q6_K weight row · Q8_K activation row.
pub fn dot_q6_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    dot_k_q8_k(KQuantType::Q6K, w, x)
}

/// The sum of each 32-element sub-block's activations, from Q8_K's 16-element `bsums`.
#[inline(always)]
pub(crate) fn sub_block_sums(xb: &[u8]) -> [i32; 8] {
    let bsum = |g: usize| {
        let at = Q8K_BSUMS + 2 * g;
        i32::from(i16::from_le_bytes([xb[at], xb[at + 1]]))
    };
    std::array::from_fn(|j| bsum(2 * j) + bsum(2 * j + 1))
}

/// The integer lane sums of one super-block in ggml's AVX2 grouping: lane `l` holds
/// `Σ scale·w·x` over the elements `e` with `(e mod 32) / 4 = l`. Q6_K's values enter ggml's
/// products unsigned (`w + 32`), and the surplus is taken back per lane after the sums, as
/// `32 · Σ scale·x` over the 32 elements of sub-block `l` (`q8sclsub`, from Q8_K's `bsums`):
/// the same total as signed values, distributed differently over the lanes.
#[inline(always)]
fn x86_lanes(ty: KQuantType, values: &[i8; QK_K], scales: &KScales, xb: &[u8]) -> [i32; 8] {
    let offset = if ty == KQuantType::Q6K { 32 } else { 0 };
    let xq = &xb[Q8K_QS..Q8K_QS + QK_K];
    let mut lanes = [0i32; 8];
    for (e, (&v, &q)) in values.iter().zip(xq).enumerate() {
        lanes[(e % 32) / 4] += scales.scales[e / 16] * (i32::from(v) + offset) * i32::from(q as i8);
    }
    if ty == KQuantType::Q6K {
        let bsum = |g: usize| {
            let at = Q8K_BSUMS + 2 * g;
            i32::from(i16::from_le_bytes([xb[at], xb[at + 1]]))
        };
        let sc = &scales.scales;
        for (l, lane) in lanes.iter_mut().enumerate() {
            *lane -= offset * (sc[2 * l] * bsum(2 * l) + sc[2 * l + 1] * bsum(2 * l + 1));
        }
    }
    lanes
}

/// The shared body of the three types in ggml's AVX2 order (see the module documentation).
pub fn dot_k_q8_k(ty: KQuantType, w: &[u8], x: &[u8]) -> f32 {
    assert_eq!(
        w.len() / ty.block_bytes(),
        x.len() / Q8_K_BLOCK_BYTES,
        "dot_k_q8_k: weight and activation rows differ in length"
    );
    let mut acc = [0.0f32; 8];
    let mut acc_m = [0.0f32; 4];
    let mut summs = 0.0f32;
    for (wb, xb) in w
        .chunks_exact(ty.block_bytes())
        .zip(x.chunks_exact(Q8_K_BLOCK_BYTES))
    {
        let scales = KScales::of(ty, wb);
        let lanes = x86_lanes(ty, &ty.quants(wb), &scales, xb);
        let dx = read_f32(xb, 0);
        let d = dx * scales.d;
        for (a, &lane) in acc.iter_mut().zip(&lanes) {
            *a = d.mul_add(lane as f32, *a);
        }
        let dmin = -dx * scales.dmin;
        // Sub-block j's minimum is mins[2j] (the 16-element table repeats it).
        let sums = sub_block_sums(xb);
        let m = |j: usize| scales.mins[2 * j];
        match ty {
            KQuantType::Q4K => {
                for (p, a) in acc_m.iter_mut().enumerate() {
                    let prod = m(2 * p) * sums[2 * p] + m(2 * p + 1) * sums[2 * p + 1];
                    *a = dmin.mul_add(prod as f32, *a);
                }
            }
            KQuantType::Q5K => {
                let total: i32 = (0..8).map(|j| m(j) * sums[j]).sum();
                summs = dmin.mul_add(total as f32, summs);
            }
            KQuantType::Q6K => {}
        }
    }
    let lanes = crate::dot::hsum8(&acc);
    match ty {
        KQuantType::Q4K => lanes + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3])),
        KQuantType::Q5K => lanes + summs,
        KQuantType::Q6K => lanes,
    }
}

/// Which of ggml's two x86 K-quant product orders an activation row gets. ggml's CPU backend
/// (AVX2 and AVX-512 builds alike) runs a matrix product with at least 8 activation rows through
/// its tiled K-quant kernel (ggml-cpu/tiled, `ggml_tiled_min_batch`) and smaller ones through
/// `ggml_vec_dot_q*_K_q8_K`; the two round differently.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KQuantOrder {
    /// `ggml_vec_dot_q*_K_q8_K` ([`dot_k_q8_k`]): a product of fewer than 8 rows.
    #[default]
    VecDot,
    /// The tiled kernel ([`dot_k_q8_k_tiled`]): a product of 8 rows or more.
    Tiled,
}

impl KQuantOrder {
    /// Rows a product needs for ggml to take the tiled kernel.
    pub const TILED_MIN_ROWS: usize = 8;

    /// The order for the token at `position` of a sequence whose prompt is `prompt_len` tokens,
    /// as llama.cpp computes it in a plain run (the prompt as one batch, then one token per
    /// step): tiled for a prompt token of a prompt of at least [`Self::TILED_MIN_ROWS`] tokens,
    /// vec_dot for a generated one. (Like `ReductionOrder::for_token`, chosen per token so that
    /// a token gets the same numbers however its step was cut.)
    pub fn for_token(position: usize, prompt_len: usize) -> Self {
        if position < prompt_len && prompt_len >= Self::TILED_MIN_ROWS {
            KQuantOrder::Tiled
        } else {
            KQuantOrder::VecDot
        }
    }
}

/// A K-quant weight row · Q8_K activation row in the order of ggml's tiled x86 kernels
/// (`tiled_run_microtile_avx2`, and `tiled_run_micro_vnni_8x16` on AVX512-VNNI builds, which
/// computes the same): per super-block the exact integers `S1 = Σ scale·w·x` (Q6_K's `w`
/// signed) and, for Q4_K/Q5_K, `S2 = Σ min·bsum`; then in f32 `r = dw·S1`,
/// `r = fma(−dmin, S2, r)`, and across super-blocks `acc = fma(r, dx, acc)` from 0.
pub fn dot_k_q8_k_tiled(ty: KQuantType, w: &[u8], x: &[u8]) -> f32 {
    assert_eq!(
        w.len() / ty.block_bytes(),
        x.len() / Q8_K_BLOCK_BYTES,
        "dot_k_q8_k_tiled: weight and activation rows differ in length"
    );
    let mut acc = 0.0f32;
    for (wb, xb) in w
        .chunks_exact(ty.block_bytes())
        .zip(x.chunks_exact(Q8_K_BLOCK_BYTES))
    {
        let scales = KScales::of(ty, wb);
        let xq = &xb[Q8K_QS..Q8K_QS + QK_K];
        let s1: i32 = ty
            .quants(wb)
            .iter()
            .zip(xq)
            .enumerate()
            .map(|(e, (&v, &q))| scales.scales[e / 16] * i32::from(v) * i32::from(q as i8))
            .sum();
        let mut r = scales.d * s1 as f32;
        if ty != KQuantType::Q6K {
            let sums = sub_block_sums(xb);
            let s2: i32 = (0..8).map(|j| scales.mins[2 * j] * sums[j]).sum();
            r = (-scales.dmin).mul_add(s2 as f32, r);
        }
        acc = r.mul_add(read_f32(xb, 0), acc);
    }
    acc
}

/// [`dot_k_q8_k`] or [`dot_k_q8_k_tiled`] by `order`.
pub fn dot_k_q8_k_ordered(ty: KQuantType, order: KQuantOrder, w: &[u8], x: &[u8]) -> f32 {
    match order {
        KQuantOrder::VecDot => dot_k_q8_k(ty, w, x),
        KQuantOrder::Tiled => dot_k_q8_k_tiled(ty, w, x),
    }
}

/// ggml's generic C order (see the module documentation): the three types differ only in how
/// values and scales unpack, and Q6_K has no minimum term (its `sumf` stays 0 until the final
/// lane sum, as in ggml).
pub fn dot_k_q8_k_generic(ty: KQuantType, w: &[u8], x: &[u8]) -> f32 {
    assert_eq!(
        w.len() / ty.block_bytes(),
        x.len() / Q8_K_BLOCK_BYTES,
        "dot_k_q8_k: weight and activation rows differ in length"
    );
    let mut sums = [0.0f32; 8];
    let mut sumf = 0.0f32;
    for (wb, xb) in w
        .chunks_exact(ty.block_bytes())
        .zip(x.chunks_exact(Q8_K_BLOCK_BYTES))
    {
        let values = ty.quants(wb);
        let scales = KScales::of(ty, wb);
        let xq = &xb[Q8K_QS..Q8K_QS + QK_K];
        let mut lanes = [0i32; 8];
        for (e, (&v, &q)) in values.iter().zip(xq).enumerate() {
            lanes[e % 8] += scales.scales[e / 16] * i32::from(v) * i32::from(q as i8);
        }
        let mins: i32 = (0..16)
            .map(|g| {
                let at = Q8K_BSUMS + 2 * g;
                scales.mins[g] * i32::from(i16::from_le_bytes([xb[at], xb[at + 1]]))
            })
            .sum();
        let dx = read_f32(xb, 0);
        let d = scales.d * dx;
        for (s, &lane) in sums.iter_mut().zip(&lanes) {
            *s = d.mul_add(lane as f32, *s);
        }
        if ty != KQuantType::Q6K {
            let dmin = scales.dmin * dx;
            sumf = (-dmin).mul_add(mins as f32, sumf);
        }
    }
    sums.iter().fold(sumf, |acc, &s| acc + s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::kquants::{dequantize_row_k, quantize_row_q8_k};
    use half::f16;
    use rand::{Rng, SeedableRng, rngs::StdRng};

    type DotFn = fn(&[u8], &[u8]) -> f32;

    const TYPES: [KQuantType; 3] = [KQuantType::Q4K, KQuantType::Q5K, KQuantType::Q6K];

    /// Random blocks with realistic (small, finite) super-block scales and random everything
    /// else, so that every scale, min and high-bit pattern occurs.
    fn random_blocks(rng: &mut StdRng, ty: KQuantType, nb: usize) -> Vec<u8> {
        let mut out = vec![0u8; nb * ty.block_bytes()];
        rng.fill(&mut out[..]);
        for b in out.chunks_exact_mut(ty.block_bytes()) {
            let d = f16::from_f32(rng.random_range(-0.01..0.01f32)).to_le_bytes();
            match ty {
                KQuantType::Q6K => b[208..210].copy_from_slice(&d),
                _ => {
                    b[0..2].copy_from_slice(&d);
                    let dmin = f16::from_f32(rng.random_range(-0.01..0.01f32));
                    b[2..4].copy_from_slice(&dmin.to_le_bytes());
                }
            }
        }
        out
    }

    /// `nb` blocks of uniform random activations in `-amp..amp` and their Q8_K row.
    fn random_q8_k(rng: &mut StdRng, nb: usize, amp: f32) -> (Vec<f32>, Vec<u8>) {
        let xf: Vec<f32> = (0..nb * QK_K)
            .map(|_| rng.random_range(-amp..amp))
            .collect();
        let mut x = vec![0u8; nb * Q8_K_BLOCK_BYTES];
        quantize_row_q8_k(&xf, &mut x);
        (xf, x)
    }

    fn dequant(ty: KQuantType, w: &[u8]) -> Vec<f32> {
        let mut out = vec![0.0; w.len() / ty.block_bytes() * QK_K];
        dequantize_row_k(ty, w, &mut out).unwrap();
        out
    }

    /// Q8_K values as f64 (`d·q`, exact in f64).
    fn q8_k_values(x: &[u8]) -> Vec<f64> {
        x.chunks_exact(Q8_K_BLOCK_BYTES)
            .flat_map(|b| {
                let d = f64::from(read_f32(b, 0));
                b[Q8K_QS..Q8K_QS + QK_K]
                    .iter()
                    .map(move |&q| d * f64::from(q as i8))
            })
            .collect()
    }

    /// Σ w·x over both dequantized rows in f64, plus the sum of |w·x| for the error bound.
    fn exact_dot(ty: KQuantType, w: &[u8], x: &[u8]) -> (f64, f64) {
        let wf = dequant(ty, w);
        let xf = q8_k_values(x);
        let products = wf.iter().zip(&xf).map(|(&a, &b)| f64::from(a) * b);
        products.fold((0.0, 0.0), |(s, m), p| (s + p, m + p.abs()))
    }

    #[test]
    fn dots_match_f64_sum_of_dequantized_operands() {
        // The dot product computes the same sum as dequantize-then-multiply; the only
        // differences are f32 roundings: of d·dx and dmin·dx, of each lane and the minimum term
        // converted to f32, and of the FMA chains — a few ulps of the magnitude Σ|w·x| per
        // block. 2^-20 · Σ|w·x| is ~8 f32 ulps of that magnitude.
        let mut rng = StdRng::seed_from_u64(15);
        for ty in TYPES {
            for nb in [1, 3, 8] {
                let w = random_blocks(&mut rng, ty, nb);
                let (_, x) = random_q8_k(&mut rng, nb, 3.0);
                let (exact, magnitude) = exact_dot(ty, &w, &x);
                let tol = magnitude * 2f64.powi(-20);
                for dot in [dot_k_q8_k, dot_k_q8_k_generic, dot_k_q8_k_tiled] {
                    let got = f64::from(dot(ty, &w, &x));
                    assert!(
                        (got - exact).abs() <= tol,
                        "{ty:?} × {nb} blocks: {got} vs {exact} (tol {tol:e})"
                    );
                }
            }
        }
    }

    #[test]
    fn dots_approximate_the_float_dot() {
        // Against the unquantized activations the error is the activation rounding:
        // at most half a step (|d|/2) per element, times |w|.
        let mut rng = StdRng::seed_from_u64(16);
        for ty in TYPES {
            let nb = 4;
            let w = random_blocks(&mut rng, ty, nb);
            let (xf, x) = random_q8_k(&mut rng, nb, 1.0);
            let wf = dequant(ty, &w);
            let float: f64 = wf
                .iter()
                .zip(&xf)
                .map(|(&a, &b)| f64::from(a) * f64::from(b))
                .sum();
            let bound: f64 = wf
                .chunks(QK_K)
                .zip(x.chunks_exact(Q8_K_BLOCK_BYTES))
                .map(|(wb, xb)| {
                    let half_step = f64::from(read_f32(xb, 0).abs()) / 2.0;
                    wb.iter().map(|v| f64::from(v.abs())).sum::<f64>() * half_step
                })
                .sum::<f64>()
                * 1.01
                + 1e-6;
            let got = f64::from(dot_k_q8_k(ty, &w, &x));
            assert!(
                (got - float).abs() <= bound,
                "{ty:?}: {got} vs {float} (bound {bound})"
            );
        }
    }

    #[test]
    fn named_entry_points_agree_and_zero_activations_give_zero() {
        let mut rng = StdRng::seed_from_u64(17);
        let (_, x) = random_q8_k(&mut rng, 1, 2.0);
        let named: [DotFn; 3] = [dot_q4_k_q8_k, dot_q5_k_q8_k, dot_q6_k_q8_k];
        for (ty, f) in TYPES.into_iter().zip(named) {
            let w = random_blocks(&mut rng, ty, 1);
            assert_eq!(f(&w, &x).to_bits(), dot_k_q8_k(ty, &w, &x).to_bits());
            // Zero activations give exactly zero.
            let zero = vec![0u8; Q8_K_BLOCK_BYTES];
            assert_eq!(f(&w, &zero), 0.0);
        }
    }

    #[test]
    fn x86_and_generic_orders_round_differently_but_agree_closely() {
        // Both orders compute the same exact sum with different f32 roundings, so on random
        // rows some results differ in the last bits (proof that the orders are really
        // distinct) but never by more than the rounding bound.
        let mut rng = StdRng::seed_from_u64(19);
        let mut differing = 0;
        for ty in TYPES {
            for _ in 0..50 {
                let w = random_blocks(&mut rng, ty, 8);
                let (_, x) = random_q8_k(&mut rng, 8, 3.0);
                let a = dot_k_q8_k(ty, &w, &x);
                let b = dot_k_q8_k_generic(ty, &w, &x);
                let (_, magnitude) = exact_dot(ty, &w, &x);
                assert!(f64::from((a - b).abs()) <= magnitude * 2f64.powi(-19));
                differing += usize::from(a.to_bits() != b.to_bits());
            }
        }
        assert!(differing > 10, "only {differing} of 150 dots differ");
    }

    /// `ggml_vec_dot_q6_K_q8_K`'s AVX2 body (ggml-cpu/arch/x86/quants.c) transcribed with
    /// plain integers, straight from the block layout: each value enters unsigned
    /// (`ql | qh << 4`, 0..63, what `maddubs` needs), i32 lane `l` of 32-element run `c` sums
    /// `scale · q · x` over bytes `4l..4l+4`, and only after all eight runs does lane `l` lose
    /// `q8sclsub[l] = 32 · (sc[2l]·bsums[2l] + sc[2l+1]·bsums[2l+1])`: the offset of the 32
    /// elements of run `l`, not of the elements the lane summed.
    fn ggml_avx2_q6_k(w: &[u8], x: &[u8]) -> f32 {
        let mut acc = [0.0f32; 8];
        for (wb, xb) in w.chunks_exact(210).zip(x.chunks_exact(Q8_K_BLOCK_BYTES)) {
            let d = read_f32(xb, 0) * crate::quant::read_f16(wb, 208);
            let (ql, qh) = (&wb[..128], &wb[128..192]);
            let sc = |g: usize| i32::from(wb[192 + g] as i8);
            let q8 = |e: usize| i32::from(xb[Q8K_QS + e] as i8);
            let bsum = |g: usize| {
                let at = Q8K_BSUMS + 2 * g;
                i32::from(i16::from_le_bytes([xb[at], xb[at + 1]]))
            };
            let mut sumi = [0i32; 8];
            for half in 0..2 {
                for k in 0..4 {
                    for b in 0..32 {
                        let low = ql[64 * half + 32 * (k % 2) + b];
                        let low = if k < 2 { low & 15 } else { low >> 4 };
                        let high = (qh[32 * half + b] >> (2 * k)) & 3;
                        let q = i32::from(low | (high << 4));
                        let e = 128 * half + 32 * k + b;
                        sumi[b / 4] += sc(e / 16) * q * q8(e);
                    }
                }
            }
            for (l, s) in sumi.iter_mut().enumerate() {
                *s -= 32 * (sc(2 * l) * bsum(2 * l) + sc(2 * l + 1) * bsum(2 * l + 1));
            }
            for (a, &s) in acc.iter_mut().zip(&sumi) {
                *a = d.mul_add(s as f32, *a);
            }
        }
        crate::dot::hsum8(&acc)
    }

    #[test]
    fn q6_k_is_ggml_avx2_bit_for_bit() {
        // The lanes carry ggml's per-run offset correction, not the offset of their own
        // elements: the two groupings have the same total but round differently in the f32
        // lanes, and on real activations (SmolLM2's ffn_down) the difference was a few ulps
        // in most outputs of the first layer already.
        let mut rng = StdRng::seed_from_u64(21);
        for _ in 0..200 {
            let nb = rng.random_range(1..8);
            let w = random_blocks(&mut rng, KQuantType::Q6K, nb);
            let amp = [0.01f32, 1.0, 300.0][rng.random_range(0..3)];
            let (_, x) = random_q8_k(&mut rng, nb, amp);
            let want = ggml_avx2_q6_k(&w, &x);
            assert_eq!(
                dot_q6_k_q8_k(&w, &x).to_bits(),
                want.to_bits(),
                "{nb} blocks"
            );
        }
    }

    #[test]
    fn tiled_order_is_ggmls_block_formula_and_rounds_unlike_vec_dot() {
        // One super-block: r = dw·S1 − dmin·S2 (fused), times dx, is the whole result.
        let mut rng = StdRng::seed_from_u64(22);
        for ty in TYPES {
            let w = random_blocks(&mut rng, ty, 1);
            let (_, x) = random_q8_k(&mut rng, 1, 2.0);
            let scales = KScales::of(ty, &w);
            let values = ty.quants(&w);
            let mut s1 = 0i64;
            let mut s2 = 0i64;
            for e in 0..QK_K {
                let q = i64::from(x[Q8K_QS + e] as i8);
                s1 += i64::from(scales.scales[e / 16]) * i64::from(values[e]) * q;
                s2 += i64::from(scales.mins[e / 16]) * q;
            }
            let mut r = scales.d * s1 as f32;
            if ty != KQuantType::Q6K {
                r = (-scales.dmin).mul_add(s2 as f32, r);
            }
            let want = r * read_f32(&x, 0);
            assert_eq!(
                dot_k_q8_k_tiled(ty, &w, &x).to_bits(),
                want.to_bits(),
                "{ty:?}"
            );
        }
        // Over several blocks the two orders round differently on some rows (they are really
        // two orders) but stay within the rounding bound of each other.
        let mut differing = 0;
        for ty in TYPES {
            for _ in 0..50 {
                let w = random_blocks(&mut rng, ty, 6);
                let (_, x) = random_q8_k(&mut rng, 6, 3.0);
                let a = dot_k_q8_k_ordered(ty, KQuantOrder::Tiled, &w, &x);
                let b = dot_k_q8_k_ordered(ty, KQuantOrder::VecDot, &w, &x);
                assert_eq!(a.to_bits(), dot_k_q8_k_tiled(ty, &w, &x).to_bits());
                assert_eq!(b.to_bits(), dot_k_q8_k(ty, &w, &x).to_bits());
                let (_, magnitude) = exact_dot(ty, &w, &x);
                assert!(f64::from((a - b).abs()) <= magnitude * 2f64.powi(-19));
                differing += usize::from(a.to_bits() != b.to_bits());
            }
        }
        assert!(differing > 10, "only {differing} of 150 dots differ");
    }

    #[test]
    fn tiled_order_is_for_prompt_tokens_of_prompts_of_eight_or_more() {
        use KQuantOrder::{Tiled, VecDot};
        assert_eq!(KQuantOrder::for_token(0, 8), Tiled);
        assert_eq!(KQuantOrder::for_token(7, 8), Tiled);
        assert_eq!(KQuantOrder::for_token(8, 8), VecDot, "generated");
        assert_eq!(
            KQuantOrder::for_token(0, 7),
            VecDot,
            "a prompt of 7 is one vec_dot batch"
        );
        assert_eq!(KQuantOrder::for_token(0, 1), VecDot);
        assert_eq!(KQuantOrder::default(), VecDot);
    }

    #[test]
    fn q5_k_with_empty_high_bits_equals_q4_k_on_the_same_fields() {
        // Q5_K = Q4_K's fields + qh; with qh = 0 both must compute bit-identical dots.
        let mut rng = StdRng::seed_from_u64(18);
        let q4 = random_blocks(&mut rng, KQuantType::Q4K, 2);
        let mut q5 = Vec::new();
        for b in q4.chunks_exact(144) {
            q5.extend_from_slice(&b[..16]);
            q5.extend_from_slice(&[0u8; 32]);
            q5.extend_from_slice(&b[16..]);
        }
        let (_, x) = random_q8_k(&mut rng, 2, 2.0);
        assert_eq!(
            dot_q4_k_q8_k(&q4, &x).to_bits(),
            dot_q5_k_q8_k(&q5, &x).to_bits()
        );
        assert_eq!(dequant(KQuantType::Q4K, &q4), dequant(KQuantType::Q5K, &q5));
    }
}
