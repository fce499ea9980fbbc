//! Scalar reference dot products between one weight row and one activation row, in ggml's
//! byte layouts, with ggml's x86 rounding behaviour (Q4_1 excepted: see [`dot_q4_1_q8_1`]).
//!
//! ggml (AVX2 build, and llamafile's tinyBLAS for Q8_0 and f16) accumulates every dot product in
//! eight f32 lanes: per 32-element block, lane `l` receives the exact integer sum of elements
//! `4l..4l+4` converted to f32, multiplied by the block's combined scale with one fused
//! multiply-add; the lanes are reduced at the end as `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
//! (ggml's Q4_1 additionally carries `Σ m·s` in a separate scalar chain added after the
//! reduction; kvgate's Q4_1 keeps that chain but not the lanes.) Reproducing that order exactly
//! is what makes greedy decoding token-identical to llama.cpp; kvgate keeps it for every type
//! but Q4_1. These functions are the oracle every SIMD path is tested against, bit for bit.

pub mod kquants;

pub use kquants::{
    KQuantOrder, dot_k_q8_k, dot_k_q8_k_generic, dot_k_q8_k_ordered, dot_k_q8_k_tiled,
    dot_q4_k_q8_k, dot_q5_k_q8_k, dot_q6_k_q8_k,
};

use crate::quant::{
    Q4_0_BLOCK_BYTES, Q4_1_BLOCK_BYTES, Q5_0_BLOCK_BYTES, Q5_1_BLOCK_BYTES, Q8_0_BLOCK_BYTES,
    Q8_1_BLOCK_BYTES, QK, read_f16, unpack_q5,
};
use half::f16;

/// ggml's 8-lane f32 accumulator.
pub(crate) type Lanes = [f32; 8];

/// ggml's `hsum_float_8` reduction order.
#[inline(always)]
pub(crate) fn hsum8(a: &Lanes) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Adds one block's eight integer lane sums, scaled by `d`, into the accumulator.
#[inline(always)]
pub(crate) fn fma_lanes(acc: &mut Lanes, d: f32, sums: &[i32; 8]) {
    for (a, &s) in acc.iter_mut().zip(sums) {
        *a = d.mul_add(s as f32, *a);
    }
}

/// Integer lane sums of one block: lane `l` = Σ_{j in 4l..4l+4} w[j]·x[j].
#[inline(always)]
pub(crate) fn lane_sums(w: &[i32; QK], x: &[u8]) -> [i32; 8] {
    let mut sums = [0i32; 8];
    for (l, s) in sums.iter_mut().enumerate() {
        for j in 4 * l..4 * l + 4 {
            *s += w[j] * i32::from(x[j] as i8);
        }
    }
    sums
}

/// Unpacks 16 nibble bytes into 32 values (low nibbles first), minus `offset`.
#[inline(always)]
pub(crate) fn unpack_nibbles(qs: &[u8], offset: i32) -> [i32; QK] {
    let mut w = [0i32; QK];
    for (j, &q) in qs[..QK / 2].iter().enumerate() {
        w[j] = i32::from(q & 0x0F) - offset;
        w[j + QK / 2] = i32::from(q >> 4) - offset;
    }
    w
}

/// Q4_0 weight row · Q8_0 activation row.
pub fn dot_q4_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    dot_scaled_q8_0(w, x, Q4_0_BLOCK_BYTES, |b| unpack_nibbles(b, 8))
}

/// A weight type with one f16 scale `d` at the start of each block and signed values
/// (`values` unpacks the rest of the block) · Q8_0: ggml's eight lanes, `fma(dw·da, lane)`.
#[inline(always)]
fn dot_scaled_q8_0(
    w: &[u8],
    x: &[u8],
    block_bytes: usize,
    values: impl Fn(&[u8]) -> [i32; QK],
) -> f32 {
    let mut acc = [0.0f32; 8];
    for (wb, xb) in w
        .chunks_exact(block_bytes)
        .zip(x.chunks_exact(Q8_0_BLOCK_BYTES))
    {
        let d = read_f16(wb, 0) * read_f16(xb, 0);
        fma_lanes(&mut acc, d, &lane_sums(&values(&wb[2..]), &xb[2..]));
    }
    hsum8(&acc)
}

/// Q5_0 weight row · Q8_0 activation row (ggml's eight lanes, as for Q4_0).
pub fn dot_q5_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    dot_scaled_q8_0(w, x, Q5_0_BLOCK_BYTES, |b| unpack_q5(b).map(|q| q - 16))
}

/// Q5_1 weight row · Q8_1 activation row in ggml's AVX2 order (unlike kvgate's Q4_1): eight
/// lanes `fma(dw·da, lane, acc)`, and `Σ m·s` in one FMA chain added after `hsum8`.
pub fn dot_q5_1_q8_1(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = [0.0f32; 8];
    let mut summs = 0.0f32;
    for (wb, xb) in w
        .chunks_exact(Q5_1_BLOCK_BYTES)
        .zip(x.chunks_exact(Q8_1_BLOCK_BYTES))
    {
        summs = read_f16(wb, 2).mul_add(read_f16(xb, 2), summs);
        let d = read_f16(wb, 0) * read_f16(xb, 0);
        fma_lanes(&mut acc, d, &lane_sums(&unpack_q5(&wb[4..]), &xb[4..]));
    }
    hsum8(&acc) + summs
}

/// Q4_1 weight row · Q8_1 activation row, in block-sum form: each block's exact integer dot
/// product, converted once, enters one fused multiply-add chain scaled by `dw·da`; `Σ m·s` runs
/// in a second chain added at the end. This departs from ggml's eight-lane order (which only
/// rounds differently) because it lets the SIMD kernels share conversions and FMAs between
/// pairs; see `avx2::q4_1`.
pub fn dot_q4_1_q8_1(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = 0.0f32;
    let mut summs = 0.0f32;
    for block in q4_1_blocks(w, x) {
        summs = block.m.mul_add(block.s, summs);
        let isum: i32 = block.lanes.iter().sum();
        acc = block.d.mul_add(isum as f32, acc);
    }
    acc + summs
}

/// One block of a Q4_1 weight row against its Q8_1 activation block.
struct Q4_1Block {
    /// `dw·da`.
    d: f32,
    /// The weight block's minimum `mw`.
    m: f32,
    /// The activation block's `s = da·Σq`.
    s: f32,
    /// Integer lane sums (ggml's lanes; their total is the block's integer dot product).
    lanes: [i32; 8],
}

/// The blocks of a Q4_1 weight row `w` and a Q8_1 activation row `x`.
fn q4_1_blocks<'a>(w: &'a [u8], x: &'a [u8]) -> impl Iterator<Item = Q4_1Block> + 'a {
    w.chunks_exact(Q4_1_BLOCK_BYTES)
        .zip(x.chunks_exact(Q8_1_BLOCK_BYTES))
        .map(|(wb, xb)| Q4_1Block {
            d: read_f16(wb, 0) * read_f16(xb, 0),
            m: read_f16(wb, 2),
            s: read_f16(xb, 2),
            lanes: lane_sums(&unpack_nibbles(&wb[4..], 0), &xb[4..]),
        })
}

/// Q8_0 weight row · Q8_0 activation row.
pub fn dot_q8_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    dot_scaled_q8_0(w, x, Q8_0_BLOCK_BYTES, |b| {
        std::array::from_fn(|j| i32::from(b[j] as i8))
    })
}

/// Eight-lane float dot product (tinyBLAS order): lane `l` accumulates elements `l, l+8, ...`
/// with fused multiply-adds, then `hsum8`. A tail shorter than 8 is added afterwards in order.
pub(crate) fn dot_lanes_f32(n: usize, w: impl Fn(usize) -> f32, x: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [0.0f32; 8];
    let full = n / 8 * 8;
    for base in (0..full).step_by(8) {
        for (l, a) in acc.iter_mut().enumerate() {
            *a = w(base + l).mul_add(x(base + l), *a);
        }
    }
    let mut sum = hsum8(&acc);
    for i in full..n {
        sum = w(i).mul_add(x(i), sum);
    }
    sum
}

/// f16 weight row (little-endian bytes) · f16 activation row.
pub fn dot_f16_f16(w: &[u8], x: &[f16]) -> f32 {
    dot_lanes_f32(x.len(), |i| read_f16(w, 2 * i), |i| x[i].to_f32())
}

/// f32 weight row (little-endian bytes) · f32 activation row.
pub fn dot_f32_f32(w: &[u8], x: &[f32]) -> f32 {
    let wf = |i: usize| f32::from_le_bytes([w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]]);
    dot_lanes_f32(x.len(), wf, |i| x[i])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{WeightType, dequantize_row, quantize_row_q8_0, quantize_row_q8_1};
    use rand::{Rng, SeedableRng, rngs::StdRng};

    fn random_blocks(rng: &mut StdRng, ty: WeightType, nb: usize) -> Vec<u8> {
        let mut out = vec![0u8; nb * ty.block_bytes()];
        rng.fill(&mut out[..]);
        for b in out.chunks_exact_mut(ty.block_bytes()) {
            b[0..2].copy_from_slice(&f16::from_f32(rng.random_range(0.001..0.05)).to_le_bytes());
            if ty == WeightType::Q4_1 {
                let m = rng.random_range(-0.2..0.2f32);
                b[2..4].copy_from_slice(&f16::from_f32(m).to_le_bytes());
            }
        }
        out
    }

    fn naive(ty: WeightType, w: &[u8], x: &[f32]) -> f64 {
        let mut wf = vec![0.0; x.len()];
        dequantize_row(ty, w, &mut wf).unwrap();
        wf.iter()
            .zip(x)
            .map(|(&a, &b)| f64::from(a) * f64::from(b))
            .sum()
    }

    #[test]
    fn quantized_dots_approximate_the_float_dot() {
        let mut rng = StdRng::seed_from_u64(7);
        for ty in [WeightType::Q4_0, WeightType::Q4_1, WeightType::Q8_0] {
            let nb = 18;
            let w = random_blocks(&mut rng, ty, nb);
            let x: Vec<f32> = (0..nb * QK).map(|_| rng.random_range(-1.0..1.0)).collect();
            let exact = naive(ty, &w, &x);
            let got = match ty {
                WeightType::Q4_1 => {
                    let mut q = vec![0u8; nb * Q8_1_BLOCK_BYTES];
                    quantize_row_q8_1(&x, &mut q);
                    dot_q4_1_q8_1(&w, &q)
                }
                _ => {
                    let mut q = vec![0u8; nb * Q8_0_BLOCK_BYTES];
                    quantize_row_q8_0(&x, &mut q);
                    if ty == WeightType::Q4_0 {
                        dot_q4_0_q8_0(&w, &q)
                    } else {
                        dot_q8_0_q8_0(&w, &q)
                    }
                }
            };
            // Activation quantization error: ≤ half a step (amax/254) per element.
            let bound: f64 = {
                let mut wf = vec![0.0; x.len()];
                dequantize_row(ty, &w, &mut wf).unwrap();
                wf.iter().map(|v| f64::from(v.abs())).sum::<f64>() / 254.0 * 1.1 + 1e-3
            };
            assert!(
                (f64::from(got) - exact).abs() <= bound,
                "{ty:?}: {got} vs {exact}"
            );
        }
    }

    /// ggml's eight-lane Q4_1 order, kept here only to compare accuracy with the block-sum form.
    fn dot_q4_1_q8_1_lanes(w: &[u8], x: &[u8]) -> f32 {
        let mut acc = [0.0f32; 8];
        let mut summs = 0.0f32;
        for block in q4_1_blocks(w, x) {
            summs = block.m.mul_add(block.s, summs);
            fma_lanes(&mut acc, block.d, &block.lanes);
        }
        hsum8(&acc) + summs
    }

    /// The same quantized operands summed exactly (f64, whose 53 bits hold every product here).
    fn dot_q4_1_q8_1_exact(w: &[u8], x: &[u8]) -> f64 {
        q4_1_blocks(w, x)
            .map(|block| {
                let isum: i32 = block.lanes.iter().sum();
                f64::from(block.d) * f64::from(isum) + f64::from(block.m) * f64::from(block.s)
            })
            .sum()
    }

    #[test]
    fn q4_1_block_sum_form_is_no_less_accurate_than_ggml_lanes() {
        // kvgate's Q4_1 departs from ggml's rounding order (see `dot_q4_1_q8_1`); this checks
        // that the departure costs no accuracy: against the exact sum of the same quantized
        // operands, the block-sum form's error is no larger than the eight-lane form's.
        let mut rng = StdRng::seed_from_u64(11);
        let (mut err_blocks, mut err_lanes) = (0.0f64, 0.0f64);
        for _ in 0..400 {
            let nb = 48;
            let w = random_blocks(&mut rng, WeightType::Q4_1, nb);
            let x: Vec<f32> = (0..nb * QK).map(|_| rng.random_range(-4.0..4.0)).collect();
            let mut q = vec![0u8; nb * Q8_1_BLOCK_BYTES];
            quantize_row_q8_1(&x, &mut q);
            let exact = dot_q4_1_q8_1_exact(&w, &q);
            err_blocks += (f64::from(dot_q4_1_q8_1(&w, &q)) - exact).abs();
            err_lanes += (f64::from(dot_q4_1_q8_1_lanes(&w, &q)) - exact).abs();
        }
        assert!(err_lanes > 0.0, "the comparison must see rounding at all");
        assert!(
            err_blocks <= err_lanes,
            "block-sum error {err_blocks:e} vs eight-lane error {err_lanes:e}"
        );
    }

    #[test]
    fn hsum8_uses_ggml_pairing() {
        // Values chosen so that any other association order gives a different f32.
        let a = [1.0e8f32, 1.0, -1.0e8, 1.0, 3.0, 1.0, 5.0, 1.0];
        assert_eq!(
            hsum8(&a),
            ((1.0e8 + 3.0) + (-1.0e8 + 5.0)) + ((1.0 + 1.0) + (1.0 + 1.0))
        );
    }

    #[test]
    fn float_dots_match_exact_small_integers() {
        let w: Vec<u8> = (0..20)
            .flat_map(|i| f16::from_f32(i as f32).to_le_bytes())
            .collect();
        let x: Vec<f16> = (0..20).map(|i| f16::from_f32((i % 3) as f32)).collect();
        let exact: f32 = (0..20).map(|i| (i * (i % 3)) as f32).sum();
        assert_eq!(dot_f16_f16(&w, &x), exact);
        let w32: Vec<u8> = (0..20).flat_map(|i| (i as f32).to_le_bytes()).collect();
        let x32: Vec<f32> = (0..20).map(|i| (i % 3) as f32).collect();
        assert_eq!(dot_f32_f32(&w32, &x32), exact);
    }
}
