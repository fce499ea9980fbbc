//! Scalar reference dot products of K-quant weight rows with Q8_K activation rows, in two orders.
//!
//! [`dot_k_q8_k`] (what kvgate computes, on every path) follows ggml's AVX2 kernels
//! (`ggml_vec_dot_q{4,5,6}_K_q8_K` in ggml-cpu/arch/x86/quants.c), which is what llama.cpp runs
//! on this hardware:
//!
//! * per super-block, eight i32 lanes: lane `l` sums exactly `scale(e) · w[e]·x[e]` over the
//!   elements with `(e mod 32) / 4 = l` (`maddubs` then `madd` with the scales);
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
/// `Σ scale·w·x` over the elements `e` with `(e mod 32) / 4 = l`.
#[inline(always)]
fn x86_lanes(values: &[i8; QK_K], scales: &KScales, xq: &[u8]) -> [i32; 8] {
    let mut lanes = [0i32; 8];
    for (e, (&v, &q)) in values.iter().zip(xq).enumerate() {
        lanes[(e % 32) / 4] += scales.scales[e / 16] * i32::from(v) * i32::from(q as i8);
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
        let lanes = x86_lanes(&ty.quants(wb), &scales, &xb[Q8K_QS..Q8K_QS + QK_K]);
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
                for dot in [dot_k_q8_k, dot_k_q8_k_generic] {
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
