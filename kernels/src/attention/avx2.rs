//! AVX2 + FMA + F16C version of the per-head attention loop in `attention.rs`, bit-identical to
//! it. Vectorised across `head_dim` (8 values per register) with explicit f16 conversions; the
//! summation orders (tinyBLAS: 8 lanes, `vec_dot_f16`: 4×8 lanes) are the scalar code's.

use super::{HeadArgs, ReductionOrder};
use crate::avx2::math::v_expf;
use std::arch::x86_64::*;

/// The query heads `q` (`group × head_dim`) sharing `kv_head`, into `out`; head dims that are
/// not a multiple of 32 use the portable kernel. Each K row is widened from f16 once and scored
/// against every head of the group.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn attention_group(
    args: &HeadArgs,
    q: &[f32],
    kv_head: usize,
    out: &mut [f32],
    scratch: &mut super::AttentionScratch,
) {
    let hd = args.layout.head_dim;
    if !hd.is_multiple_of(32) {
        return super::scalar::attention_group(args, q, kv_head, out, &mut scratch.floats);
    }
    let group = q.len() / hd;
    assert!(q.len() == group * hd && out.len() == q.len());
    let ctx = args.context_len;
    let stride = ctx.next_multiple_of(8);
    // Element offset of each position's K/V row, walking the block table block by block.
    let rows = &mut scratch.rows;
    rows.clear();
    let bs = args.layout.block_size;
    for &block in &args.block_table[..ctx.div_ceil(bs)] {
        let first = args.layout.head_offset(block as usize * bs, kv_head);
        rows.extend((0..bs).map(|off| first + off * args.layout.slot_elems()));
    }
    rows.truncate(ctx);
    let floats = &mut scratch.floats;
    floats.clear();
    floats.resize(group * (stride + hd) + hd, 0.0);
    let (scores, rest) = floats.split_at_mut(group * stride);
    let (q16, row) = rest.split_at_mut(group * hd);
    let v_base = args.v_cache.as_ptr().cast::<u16>();
    // SAFETY (this block): every `rows[pos] + hd` is within both caches (`check_row`); the
    // scratch buffers are sized above.
    unsafe {
        for c in (0..group * hd).step_by(8) {
            _mm256_storeu_ps(
                q16.as_mut_ptr().add(c),
                round_f16(_mm256_loadu_ps(q.as_ptr().add(c))),
            );
        }
        let k_base = args.k_cache.as_ptr().cast::<u16>();
        for (pos, &r) in rows.iter().enumerate() {
            // A sequence's K/V rows are scattered over its blocks and, in a batch, were last
            // touched a whole step ago: fetch the K and V rows a few positions ahead (V for
            // the value pass below) instead of stalling on each (measured: ~25% of this
            // function's time was spent waiting on the K loads at 16 sequences).
            if let Some(&ahead) = rows.get(pos + PREFETCH_POSITIONS) {
                prefetch_row(k_base.add(ahead), hd);
                prefetch_row(v_base.add(ahead), hd);
            }
            widen_row(k_base.add(r), row.as_mut_ptr(), hd);
            for g in 0..group {
                let dot = dot_k_q(args.order, row.as_ptr(), q16.as_ptr().add(g * hd), hd);
                *scores.get_unchecked_mut(g * stride + pos) = dot * args.scale;
            }
        }
    }
    for g in 0..group {
        softmax_probs_f16(&mut scores[g * stride..g * stride + ctx]);
    }
    for g in 0..group {
        let probs = &scores[g * stride..g * stride + ctx];
        for c in (0..hd).step_by(8) {
            // SAFETY: as above; `out` holds group × hd values.
            unsafe {
                let res = if args.order == ReductionOrder::TinyBlas {
                    values_tinyblas(v_base.add(c), rows, probs)
                } else {
                    values_vec_dot(v_base.add(c), rows, probs)
                };
                _mm256_storeu_ps(out.as_mut_ptr().add(g * hd + c), res);
            }
        }
    }
}

/// Eight output values `Σ_pos p[pos]·v[pos][c..c+8]` in tinyBLAS order: lane = pos % 8, each lane
/// accumulated in position order, then `hsum8` across lanes (done per output value).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_tinyblas(v: *const u16, rows: &[usize], probs: &[f32]) -> __m256 {
    let mut acc = [_mm256_setzero_ps(); 8];
    let full = rows.len() / 8 * 8;
    // SAFETY: the caller guarantees 8 readable values at `v + rows[pos]`.
    unsafe {
        for base in (0..full).step_by(8) {
            for (l, a) in acc.iter_mut().enumerate() {
                let pos = base + l;
                let vr = load_f16x8(v.add(*rows.get_unchecked(pos)));
                *a = _mm256_fmadd_ps(vr, _mm256_set1_ps(*probs.get_unchecked(pos)), *a);
            }
        }
        for pos in full..rows.len() {
            let vr = load_f16x8(v.add(rows[pos]));
            acc[pos % 8] = _mm256_fmadd_ps(vr, _mm256_set1_ps(probs[pos]), acc[pos % 8]);
        }
    }
    _mm256_add_ps(
        _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6])),
        _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7])),
    )
}

/// Eight output values in `ggml_vec_dot_f16` order: 32 lanes (pos % 32) reduced as
/// `s[l] = (A0[l] + A2[l]) + (A1[l] + A3[l])` (Aj = lanes 8j..8j+8), `t0[k] = s[k] + s[k+4]`,
/// result `(t0[0] + t0[1]) + (t0[2] + t0[3])`. Lanes are accumulated 8 at a time (one group Aj
/// per pass) so that they stay in registers.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values_vec_dot(v: *const u16, rows: &[usize], probs: &[f32]) -> __m256 {
    let n = rows.len();
    let mut groups = [[_mm256_setzero_ps(); 8]; 4];
    for (j, acc) in groups.iter_mut().enumerate() {
        let mut base = 8 * j;
        // SAFETY: the caller guarantees 8 readable values at `v + rows[pos]` for pos < n.
        unsafe {
            while base + 8 <= n {
                for (l, a) in acc.iter_mut().enumerate() {
                    let pos = base + l;
                    let vr = load_f16x8(v.add(*rows.get_unchecked(pos)));
                    *a = _mm256_fmadd_ps(vr, _mm256_set1_ps(*probs.get_unchecked(pos)), *a);
                }
                base += 32;
            }
            for (l, a) in acc.iter_mut().enumerate().take(n.saturating_sub(base)) {
                let pos = base + l;
                *a = _mm256_fmadd_ps(load_f16x8(v.add(rows[pos])), _mm256_set1_ps(probs[pos]), *a);
            }
        }
    }
    let s: [__m256; 8] = std::array::from_fn(|l| {
        _mm256_add_ps(
            _mm256_add_ps(groups[0][l], groups[2][l]),
            _mm256_add_ps(groups[1][l], groups[3][l]),
        )
    });
    let t0: [__m256; 4] = std::array::from_fn(|k| _mm256_add_ps(s[k], s[k + 4]));
    _mm256_add_ps(_mm256_add_ps(t0[0], t0[1]), _mm256_add_ps(t0[2], t0[3]))
}

/// How far ahead of the K loop the K and V rows are prefetched.
const PREFETCH_POSITIONS: usize = 6;

/// Asks for the cache lines of `hd` f16 values at `p` (a hint: never faults). The cache's
/// allocation need not be line-aligned, so a row can straddle one more line than its size
/// suggests: the last byte is fetched too.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn prefetch_row(p: *const u16, hd: usize) {
    let bytes = p.cast::<i8>();
    for off in (0..hd * 2).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(bytes.wrapping_add(off));
    }
    _mm_prefetch::<_MM_HINT_T0>(bytes.wrapping_add(hd * 2 - 1));
}

/// Converts `hd` f16 values at `src` to f32 at `dst`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_row(src: *const u16, dst: *mut f32, hd: usize) {
    for c in (0..hd).step_by(8) {
        // SAFETY: the caller guarantees `hd` values at both pointers.
        unsafe { _mm256_storeu_ps(dst.add(c), load_f16x8(src.add(c))) };
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn round_f16(v: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_f16x8(p: *const u16) -> __m256 {
    // SAFETY: the caller guarantees 8 readable f16 values at `p`.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p.cast()) })
}

/// `hsum_float_8` order: `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum8(x: __m256) -> f32 {
    let mut r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// `GGML_F32x8_REDUCE` of four accumulators: `(a0+a2)+(a1+a3)`, halves, then two `hadd`s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn reduce4(a: [__m256; 4]) -> f32 {
    let s = _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
    let t0 = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    let t1 = _mm_hadd_ps(t0, t0);
    _mm_cvtss_f32(_mm_hadd_ps(t1, t1))
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_k_q(order: ReductionOrder, k: *const f32, q16: *const f32, hd: usize) -> f32 {
    // SAFETY: `k` and `q16` hold `hd` values (a multiple of 32).
    unsafe {
        if order == ReductionOrder::TinyBlas {
            let mut acc = _mm256_setzero_ps();
            for c in (0..hd).step_by(8) {
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(k.add(c)), _mm256_loadu_ps(q16.add(c)), acc);
            }
            return hsum8(acc);
        }
        let mut acc = [_mm256_setzero_ps(); 4];
        for i in (0..hd).step_by(32) {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(
                    _mm256_loadu_ps(k.add(i + 8 * j)),
                    _mm256_loadu_ps(q16.add(i + 8 * j)),
                    *a,
                );
            }
        }
        reduce4(acc)
    }
}

/// Same arithmetic as `attention::softmax_probs_f16`, with the exp vectorised.
#[target_feature(enable = "avx2,fma,f16c")]
fn softmax_probs_f16(scores: &mut [f32]) {
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let maxv = _mm256_set1_ps(max);
    let mut sum = 0.0f64;
    for chunk in scores.chunks_mut(8) {
        // A short last chunk is padded with -inf, whose exp is exactly 0 (ggml's masked padding).
        let mut lanes = [f32::NEG_INFINITY; 8];
        lanes[..chunk.len()].copy_from_slice(chunk);
        // SAFETY: `lanes` holds 8 floats.
        let e = unsafe { v_expf(_mm256_sub_ps(_mm256_loadu_ps(lanes.as_ptr()), maxv)) };
        sum += f64::from(hsum8(e));
        // SAFETY: as above.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), e) };
        chunk.copy_from_slice(&lanes[..chunk.len()]);
    }
    let inv = (1.0 / sum) as f32;
    let mut chunks = scores.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: `c` holds 8 floats.
        unsafe {
            let v = _mm256_mul_ps(_mm256_loadu_ps(c.as_ptr()), _mm256_set1_ps(inv));
            _mm256_storeu_ps(c.as_mut_ptr(), round_f16(v));
        }
    }
    for v in chunks.into_remainder() {
        *v = half::f16::from_f32(*v * inv).to_f32();
    }
}
