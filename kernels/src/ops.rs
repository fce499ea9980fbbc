//! Element-wise and row ops of the llama forward pass: rms_norm, RoPE, SwiGLU, softmax, and f16
//! conversions, each rounding exactly like ggml's x86 (AVX2 + FMA) build.
//!
//! Two ggml details matter for parity: the vector exp (`ggml_v_expf`, an ARM-derived polynomial
//! that differs from libm `expf` in the last bits) used by SiLU and softmax on 8-wide chunks, and
//! GCC's contraction of `a*b ± c*d` into one fused multiply-add (first product fused) in RoPE.
//! Everything here is cheap next to the matmuls, so plain scalar code is used throughout.

use half::f16;

/// `out = x / sqrt(mean(x²) + eps) * weight`, with the sum of squares accumulated in f64.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    assert_eq!(x.len(), weight.len(), "rms_norm: weight length");
    assert_eq!(x.len(), out.len(), "rms_norm: output length");
    if x.is_empty() {
        return;
    }
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0f32 / (mean + eps).sqrt();
    for ((o, &v), &w) in out.iter_mut().zip(x).zip(weight) {
        // ggml applies the scale (rms_norm op) and the weight (mul op) as two roundings.
        *o = (v * scale) * w;
    }
}

/// Which elements RoPE rotates together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    /// Adjacent pairs `(x[2i], x[2i+1])` (ggml mode 0; llama).
    Norm,
    /// Half-split pairs `(x[i], x[i + head_dim/2])` (ggml NEOX mode; qwen2, gpt-neox, ...).
    Neox,
}

/// Rotates every head of `x` (`n_heads × head_dim`, one token) in place for position `pos`,
/// over the full head dimension.
pub fn rope(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    pos: u32,
    freq_base: f32,
    mode: RopeMode,
) {
    rope_with_freq_factors(x, n_heads, head_dim, pos, freq_base, mode, None);
}

/// [`rope`] with Llama 3.1's per-pair frequency factors (the GGUF's `rope_freqs.weight`, one
/// per rotated pair): pair `i`'s angle is divided by `freq_factors[i]`, as ggml's
/// `rope_cache_init` does (`theta / ff` into `rope_yarn` with no extrapolation and scale 1).
pub fn rope_with_freq_factors(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    pos: u32,
    freq_base: f32,
    mode: RopeMode,
    freq_factors: Option<&[f32]>,
) {
    if let Some(ff) = freq_factors {
        assert_eq!(
            ff.len(),
            head_dim / 2,
            "rope: one frequency factor per pair"
        );
    }
    assert_eq!(
        x.len(),
        n_heads * head_dim,
        "rope: x must be n_heads × head_dim"
    );
    assert!(head_dim.is_multiple_of(2), "rope: head_dim must be even");
    let mut cache = [(0.0f32, 0.0f32); 256];
    let pairs = head_dim / 2;
    let mut heap_cache = Vec::new();
    let cache: &mut [(f32, f32)] = if pairs <= cache.len() {
        &mut cache[..pairs]
    } else {
        heap_cache.resize(pairs, (0.0, 0.0));
        &mut heap_cache
    };
    rope_cache(cache, head_dim, pos, freq_base, freq_factors);
    #[cfg(target_arch = "x86_64")]
    if crate::simd::Avx2Fma::detect().is_some() {
        // SAFETY: the token proves the CPU supports FMA.
        return unsafe { rotate_fma(x, head_dim, cache, mode) };
    }
    rotate(x, head_dim, cache, mode);
}

/// [`rotate`] compiled with FMA so that `mul_add` is one instruction instead of a libm call.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
fn rotate_fma(x: &mut [f32], head_dim: usize, cache: &[(f32, f32)], mode: RopeMode) {
    rotate(x, head_dim, cache, mode);
}

#[inline(always)]
fn rotate(x: &mut [f32], head_dim: usize, cache: &[(f32, f32)], mode: RopeMode) {
    let pairs = head_dim / 2;
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &(cos, sin)) in cache.iter().enumerate() {
            let (a, b) = match mode {
                RopeMode::Norm => (2 * i, 2 * i + 1),
                RopeMode::Neox => (i, i + pairs),
            };
            let (x0, x1) = (head[a], head[b]);
            // GCC contracts `x0*cos - x1*sin` by fusing the first product.
            head[a] = x0.mul_add(cos, -(x1 * sin));
            head[b] = x0.mul_add(sin, x1 * cos);
        }
    }
}

/// ggml's `rope_cache_init` without YaRN/scaling: theta starts at `pos` and is multiplied by
/// `freq_base^(-2/n_dims)` once per pair, all in f32; a frequency factor divides the angle of
/// its pair only (the running theta is not affected).
fn rope_cache(
    cache: &mut [(f32, f32)],
    n_dims: usize,
    pos: u32,
    freq_base: f32,
    freq_factors: Option<&[f32]>,
) {
    let theta_scale = freq_base.powf(-2.0 / n_dims as f32);
    let mut theta = pos as f32;
    for (i, c) in cache.iter_mut().enumerate() {
        let angle = match freq_factors {
            Some(ff) => theta / ff[i],
            None => theta,
        };
        *c = (angle.cos(), angle.sin());
        theta *= theta_scale;
    }
}

/// `out = silu(gate) * up`, silu(x) = x / (1 + exp(-x)).
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: up length");
    assert_eq!(gate.len(), out.len(), "swiglu: output length");
    #[cfg(target_arch = "x86_64")]
    if crate::simd::Avx2Fma::detect().is_some() {
        // SAFETY: the token proves the CPU supports AVX2, FMA and F16C.
        return unsafe { crate::avx2::math::swiglu(gate, up, out) };
    }
    swiglu_reference(gate, up, out);
}

/// Portable [`swiglu`] (the oracle for the vector path; same results bit for bit).
pub fn swiglu_reference(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert_eq!(gate.len(), up.len(), "swiglu: up length");
    assert_eq!(gate.len(), out.len(), "swiglu: output length");
    let full = gate.len() / 8 * 8;
    for i in 0..gate.len() {
        let x = gate[i];
        // ggml's vector path covers whole groups of 8; the tail uses libm expf.
        let e = if i < full {
            ggml_v_expf(-x)
        } else {
            (-x).exp()
        };
        out[i] = (x / (1.0 + e)) * up[i];
    }
}

/// In-place softmax of one row as ggml's `soft_max` computes it: subtract the max, exponentiate
/// with `ggml_v_expf` in groups of 8 (libm for the tail), sum each group in ggml's lane order into
/// an f64, then multiply by `(f32)(1/sum)`. `-inf` entries become exactly 0.
pub fn softmax_inplace(x: &mut [f32]) {
    if x.is_empty() {
        return;
    }
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0f64;
    let full = x.len() / 8 * 8;
    for chunk in x[..full].chunks_exact_mut(8) {
        let mut lanes = [0.0f32; 8];
        for (l, v) in lanes.iter_mut().zip(chunk.iter_mut()) {
            *v = ggml_v_expf(*v - max);
            *l = *v;
        }
        sum += f64::from(crate::dot::hsum8(&lanes));
    }
    for v in &mut x[full..] {
        *v = (*v - max).exp();
        sum += f64::from(*v);
    }
    let inv = (1.0 / sum) as f32;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// One lane of ggml's AVX2 `ggml_v_expf` (max error about 1.5 ulp; flushes beyond ±88/−104).
#[inline]
pub fn ggml_v_expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4B40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3FB8_AA3B), r); // log2(e)
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35BF_BE8E),
        (-n).mul_add(f32::from_bits(0x3F31_7200), x),
    );
    let e = z.to_bits().wrapping_shl(23);
    let k = f32::from_bits(e.wrapping_add(1.0f32.to_bits()));
    let u = b * b;
    let j = f32::from_bits(0x3C07_2010)
        .mul_add(b, f32::from_bits(0x3D2B_9F17))
        .mul_add(
            u,
            f32::from_bits(0x3E2A_AF33).mul_add(b, f32::from_bits(0x3EFF_FEDB)),
        )
        .mul_add(u, f32::from_bits(0x3F7F_FFF6) * b);
    let abs_n = n.abs();
    if abs_n > 192.0 {
        let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
        let s1 = f32::from_bits(g.wrapping_add(0x7F00_0000));
        s1 * s1
    } else if abs_n > 126.0 {
        let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
        let s1 = f32::from_bits(g.wrapping_add(0x7F00_0000));
        let s2 = f32::from_bits(e.wrapping_sub(g));
        s2.mul_add(j, s2) * s1
    } else {
        k.mul_add(j, k)
    }
}

/// Rounds each value to f16 (round to nearest even, as F16C does).
pub fn f32_to_f16_slice(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_f16_slice: length");
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(s);
    }
}

/// Widens each f16 to f32 (exact).
pub fn f16_to_f32_slice(src: &[f16], dst: &mut [f32]) {
    assert_eq!(src.len(), dst.len(), "f16_to_f32_slice: length");
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `0x1.<mantissa>p<exp>` with a 24-bit hex mantissa, as written in ggml's source.
    fn hex_float(mantissa: u32, exp: i32) -> f32 {
        ((1.0 + f64::from(mantissa) / f64::from(1u32 << 24)) * 2f64.powi(exp)) as f32
    }

    #[test]
    fn v_expf_constants_match_ggml_hex_floats() {
        let pairs = [
            (0x4B40_0000, hex_float(0x800000, 23)),
            (0x3FB8_AA3B, hex_float(0x715476, 0)),
            (0x35BF_BE8E, hex_float(0x7f7d1c, -20)),
            (0x3F31_7200, hex_float(0x62e400, -1)),
            (0x3C07_2010, hex_float(0x0e4020, -7)),
            (0x3D2B_9F17, hex_float(0x573e2e, -5)),
            (0x3E2A_AF33, hex_float(0x555e66, -3)),
            (0x3EFF_FEDB, hex_float(0xfffdb6, -2)),
            (0x3F7F_FFF6, hex_float(0xffffec, -1)),
        ];
        for (bits, value) in pairs {
            assert_eq!(bits, value.to_bits(), "{bits:#x}");
        }
    }

    #[test]
    fn v_expf_is_close_to_exp_and_saturates() {
        for i in -1000..=880 {
            let x = i as f32 * 0.1;
            let want = x.exp();
            let got = ggml_v_expf(x);
            assert!(
                (got - want).abs() <= want * 4.0e-7 + f32::MIN_POSITIVE,
                "{x}: {got} vs {want}"
            );
        }
        assert_eq!(ggml_v_expf(f32::NEG_INFINITY), 0.0);
        assert_eq!(ggml_v_expf(-200.0), 0.0);
        assert_eq!(ggml_v_expf(0.0), 1.0);
        assert!(ggml_v_expf(100.0).is_infinite());
    }

    #[test]
    fn rms_norm_normalises_to_unit_rms() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) * 0.3).collect();
        let w = vec![1.0; 64];
        let mut out = vec![0.0; 64];
        rms_norm(&x, &w, 1e-5, &mut out);
        let rms = (out.iter().map(|v| v * v).sum::<f32>() / 64.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-3, "{rms}");
        let w2: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let mut out2 = vec![0.0; 64];
        rms_norm(&x, &w2, 1e-5, &mut out2);
        for i in 0..64 {
            assert_eq!(out2[i], out[i] * i as f32);
        }
    }

    fn rope_direct(x: &[f32], head_dim: usize, pos: u32, base: f32, mode: RopeMode) -> Vec<f64> {
        let mut out: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        for head in 0..x.len() / head_dim {
            for i in 0..head_dim / 2 {
                let theta =
                    f64::from(pos) * f64::from(base).powf(-2.0 * i as f64 / head_dim as f64);
                let (a, b) = match mode {
                    RopeMode::Norm => (2 * i, 2 * i + 1),
                    RopeMode::Neox => (i, i + head_dim / 2),
                };
                let (x0, x1) = (
                    f64::from(x[head * head_dim + a]),
                    f64::from(x[head * head_dim + b]),
                );
                out[head * head_dim + a] = x0 * theta.cos() - x1 * theta.sin();
                out[head * head_dim + b] = x0 * theta.sin() + x1 * theta.cos();
            }
        }
        out
    }

    #[test]
    fn rope_matches_direct_formula() {
        let x: Vec<f32> = (0..3 * 64)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
            .collect();
        for mode in [RopeMode::Norm, RopeMode::Neox] {
            for pos in [0u32, 1, 7, 100, 1000] {
                let mut got = x.clone();
                rope(&mut got, 3, 64, pos, 10000.0, mode);
                let want = rope_direct(&x, 64, pos, 10000.0, mode);
                // Cumulative f32 theta drifts by a few ulps per pair, times pos.
                let tol = 1e-5 * (1.0 + f64::from(pos)) * 4.0;
                for (g, w) in got.iter().zip(&want) {
                    assert!(
                        (f64::from(*g) - w).abs() <= tol,
                        "{mode:?} pos {pos}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn rope_freq_factors_divide_each_pairs_angle() {
        // Llama 3.1-style factors (1 for high frequencies, up to 8 for low ones): pair i of a
        // head rotates by θ_i / ff[i]. Check against the f64 formula, and that all-ones factors
        // are bit-identical to plain RoPE.
        let x: Vec<f32> = (0..2 * 64)
            .map(|i| ((i * 53 % 97) as f32 - 48.0) / 20.0)
            .collect();
        let ff: Vec<f32> = (0..32)
            .map(|i| 1.0 + (i as f32 / 31.0).powi(2) * 7.0)
            .collect();
        for mode in [RopeMode::Norm, RopeMode::Neox] {
            for pos in [1u32, 9, 500] {
                let mut got = x.clone();
                rope_with_freq_factors(&mut got, 2, 64, pos, 500_000.0, mode, Some(&ff));
                let tol = 1e-5 * (1.0 + f64::from(pos)) * 4.0;
                for head in 0..2 {
                    for (i, &f) in ff.iter().enumerate() {
                        let theta =
                            f64::from(pos) * 500_000f64.powf(-2.0 * i as f64 / 64.0) / f64::from(f);
                        let (a, b) = match mode {
                            RopeMode::Norm => (2 * i, 2 * i + 1),
                            RopeMode::Neox => (i, i + 32),
                        };
                        let (x0, x1) = (f64::from(x[head * 64 + a]), f64::from(x[head * 64 + b]));
                        let want_a = x0 * theta.cos() - x1 * theta.sin();
                        let want_b = x0 * theta.sin() + x1 * theta.cos();
                        assert!((f64::from(got[head * 64 + a]) - want_a).abs() <= tol);
                        assert!((f64::from(got[head * 64 + b]) - want_b).abs() <= tol);
                    }
                }
                let mut ones = x.clone();
                rope_with_freq_factors(&mut ones, 2, 64, pos, 500_000.0, mode, Some(&[1.0; 32]));
                let mut plain = x.clone();
                rope(&mut plain, 2, 64, pos, 500_000.0, mode);
                assert_eq!(ones, plain, "{mode:?} pos {pos}");
                assert_ne!(got, plain, "factors must change the low frequencies");
            }
        }
    }

    #[test]
    fn rope_at_position_zero_is_identity() {
        let x: Vec<f32> = (0..128).map(|i| i as f32 * 0.01).collect();
        let mut y = x.clone();
        rope(&mut y, 2, 64, 0, 10000.0, RopeMode::Norm);
        assert_eq!(x, y);
    }

    #[test]
    fn swiglu_matches_definition() {
        let g: Vec<f32> = (0..21).map(|i| i as f32 * 0.7 - 7.0).collect();
        let u: Vec<f32> = (0..21).map(|i| 1.0 + i as f32 * 0.1).collect();
        let mut out = vec![0.0; 21];
        swiglu(&g, &u, &mut out);
        for i in 0..21 {
            let want = f64::from(g[i]) / (1.0 + (-f64::from(g[i])).exp()) * f64::from(u[i]);
            assert!(
                (f64::from(out[i]) - want).abs() <= want.abs() * 1e-6 + 1e-7,
                "{i}"
            );
        }
    }

    #[test]
    fn softmax_sums_to_one_and_zeroes_masked() {
        let mut x: Vec<f32> = (0..19).map(|i| (i as f32 * 0.9).sin() * 5.0).collect();
        x[3] = f32::NEG_INFINITY;
        softmax_inplace(&mut x);
        assert_eq!(x[3], 0.0);
        let sum: f32 = x.iter().sum();
        assert!((sum - 1.0).abs() < 1e-5);
        assert!(x.iter().all(|&p| (0.0..=1.0).contains(&p)));
    }

    #[test]
    fn f16_helpers_round_trip() {
        let src = [0.0f32, 1.0, -2.5, 65504.0, 1.0e-3];
        let mut h = [f16::ZERO; 5];
        f32_to_f16_slice(&src, &mut h);
        let mut back = [0.0f32; 5];
        f16_to_f32_slice(&h, &mut back);
        assert_eq!(&back[..4], &src[..4]);
        assert!((back[4] - 1.0e-3).abs() < 1e-6);
    }

    // The vector ports in `avx2::math` against the scalar ones here (the oracle), bit for bit.

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_exp_matches_scalar_port_bit_for_bit() {
        use crate::avx2::math::v_expf;
        use std::arch::x86_64::{_mm256_loadu_ps, _mm256_storeu_ps};
        if crate::simd::Avx2Fma::detect().is_none() {
            return;
        }
        let mut xs: Vec<f32> = (-2200..=1000).map(|i| i as f32 * 0.1 + 0.0137).collect();
        xs.extend([
            f32::NEG_INFINITY,
            -0.0,
            0.0,
            88.7,
            -87.5,
            -103.9,
            -126.5,
            -150.0,
            1e-30,
        ]);
        for chunk in xs.chunks(8) {
            let mut lanes = [0.0f32; 8];
            lanes[..chunk.len()].copy_from_slice(chunk);
            let mut got = [0.0f32; 8];
            // SAFETY: the token checked above proves AVX2/FMA/F16C; arrays hold 8 floats.
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), v_expf(_mm256_loadu_ps(lanes.as_ptr()))) };
            for (x, g) in lanes.iter().zip(got) {
                assert_eq!(g.to_bits(), ggml_v_expf(*x).to_bits(), "exp({x})");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_swiglu_matches_scalar_reference() {
        if crate::simd::Avx2Fma::detect().is_none() {
            return;
        }
        let n = 8 * 40 + 5;
        let gate: Vec<f32> = (0..n).map(|i| (i as f32 - 160.0) * 0.13).collect();
        let up: Vec<f32> = (0..n).map(|i| 1.0 - i as f32 * 0.01).collect();
        let (mut got, mut want) = (vec![0.0; n], vec![0.0; n]);
        // SAFETY: the token checked above proves AVX2/FMA/F16C.
        unsafe { crate::avx2::math::swiglu(&gate, &up, &mut got) };
        swiglu_reference(&gate, &up, &mut want);
        assert_eq!(got, want);
    }
}
