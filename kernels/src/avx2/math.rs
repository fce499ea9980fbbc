//! Vector versions of ggml's element-wise math (exp, SwiGLU), bit-identical to the scalar ports
//! in `ops.rs`.

use std::arch::x86_64::*;

/// ggml's AVX2 `ggml_v_expf`, instruction for instruction (see `ops::ggml_v_expf`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn v_expf(x: __m256) -> __m256 {
    let ps = |bits: u32| _mm256_set1_ps(f32::from_bits(bits));
    let r = ps(0x4B40_0000);
    let z = _mm256_fmadd_ps(x, ps(0x3FB8_AA3B), r);
    let n = _mm256_sub_ps(z, r);
    let b = _mm256_fnmadd_ps(n, ps(0x35BF_BE8E), _mm256_fnmadd_ps(n, ps(0x3F31_7200), x));
    let e = _mm256_slli_epi32::<23>(_mm256_castps_si256(z));
    let k = _mm256_castsi256_ps(_mm256_add_epi32(
        e,
        _mm256_castps_si256(_mm256_set1_ps(1.0)),
    ));
    let abs_n = _mm256_andnot_ps(_mm256_set1_ps(-0.0), n);
    let c = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(126.0));
    let u = _mm256_mul_ps(b, b);
    let j = _mm256_fmadd_ps(
        _mm256_fmadd_ps(
            _mm256_fmadd_ps(ps(0x3C07_2010), b, ps(0x3D2B_9F17)),
            u,
            _mm256_fmadd_ps(ps(0x3E2A_AF33), b, ps(0x3EFF_FEDB)),
        ),
        u,
        _mm256_mul_ps(ps(0x3F7F_FFF6), b),
    );
    if _mm256_movemask_ps(c) == 0 {
        return _mm256_fmadd_ps(j, k, k);
    }
    let g = _mm256_and_si256(
        _mm256_castps_si256(_mm256_cmp_ps::<_CMP_LE_OQ>(n, _mm256_setzero_ps())),
        _mm256_set1_epi32(0x8200_0000u32 as i32),
    );
    let s1 = _mm256_castsi256_ps(_mm256_add_epi32(g, _mm256_set1_epi32(0x7F00_0000)));
    let s2 = _mm256_castsi256_ps(_mm256_sub_epi32(e, g));
    let d = _mm256_cmp_ps::<_CMP_GT_OQ>(abs_n, _mm256_set1_ps(192.0));
    _mm256_or_ps(
        _mm256_and_ps(d, _mm256_mul_ps(s1, s1)),
        _mm256_andnot_ps(
            d,
            _mm256_or_ps(
                _mm256_and_ps(c, _mm256_mul_ps(_mm256_fmadd_ps(s2, j, s2), s1)),
                _mm256_andnot_ps(c, _mm256_fmadd_ps(k, j, k)),
            ),
        ),
    )
}

/// `out = silu(gate) * up` exactly as ggml's AVX2 `ggml_vec_swiglu_f32`: whole groups of 8 use
/// `x / (1 + v_expf(0 - x)) * up`, the tail the scalar formula with libm `expf`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(gate.len() == up.len() && gate.len() == out.len());
    let full = gate.len() / 8 * 8;
    for i in (0..full).step_by(8) {
        // SAFETY: i + 8 <= full <= len of all three slices.
        unsafe {
            let x = _mm256_loadu_ps(gate.as_ptr().add(i));
            let e = v_expf(_mm256_sub_ps(_mm256_setzero_ps(), x));
            let silu = _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0), e));
            _mm256_storeu_ps(
                out.as_mut_ptr().add(i),
                _mm256_mul_ps(silu, _mm256_loadu_ps(up.as_ptr().add(i))),
            );
        }
    }
    for i in full..gate.len() {
        let x = gate[i];
        out[i] = (x / (1.0 + (-x).exp())) * up[i];
    }
}
