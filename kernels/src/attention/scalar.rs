//! Portable attention kernel: the reference for the SIMD path and the fallback on other CPUs.
//! The summation orders are spelled out element by element (see `ReductionOrder`).

use super::{HeadArgs, ReductionOrder};
use crate::dot::hsum8;
use crate::ops::ggml_v_expf;
use half::f16;

/// The query heads `q` (`group × head_dim`) sharing `kv_head`, into `out` (same shape).
pub(super) fn attention_group(
    args: &HeadArgs,
    q: &[f32],
    kv_head: usize,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    let hd = args.layout.head_dim;
    scratch.clear();
    scratch.resize(args.context_len + 33 * hd, 0.0);
    let (scores, rest) = scratch.split_at_mut(args.context_len);
    let (q16, acc) = rest.split_at_mut(hd);
    for (qh, oh) in q.chunks_exact(hd).zip(out.chunks_exact_mut(hd)) {
        for (d, &v) in q16.iter_mut().zip(qh) {
            *d = f16::from_f32(v).to_f32();
        }
        for (pos, s) in scores.iter_mut().enumerate() {
            let slot = args.layout.slot_of(args.block_table, pos);
            let off = args.layout.head_offset(slot, kv_head);
            *s = dot_k_q(args.order, &args.k_cache[off..off + hd], q16) * args.scale;
        }
        softmax_probs_f16(scores);
        weighted_values(args, kv_head, scores, acc, oh);
    }
}

/// f16 K row · f16-rounded q, in the order of `order` (tinyBLAS needs `head_dim % 8 == 0`).
#[inline(always)]
fn dot_k_q(order: ReductionOrder, k: &[f16], q16: &[f32]) -> f32 {
    let n = k.len();
    if order == ReductionOrder::TinyBlas && n.is_multiple_of(8) {
        let mut lanes = [0.0f32; 8];
        for (kc, qc) in k.chunks_exact(8).zip(q16.chunks_exact(8)) {
            for l in 0..8 {
                lanes[l] = kc[l].to_f32().mul_add(qc[l], lanes[l]);
            }
        }
        return hsum8(&lanes);
    }
    let mut acc = [[0.0f32; 8]; 4];
    let full = n / 32 * 32;
    for (kc, qc) in k[..full].chunks_exact(32).zip(q16.chunks_exact(32)) {
        for j in 0..4 {
            for l in 0..8 {
                acc[j][l] = kc[8 * j + l].to_f32().mul_add(qc[8 * j + l], acc[j][l]);
            }
        }
    }
    let mut sum = f64::from(reduce_vec_dot(&acc));
    for i in full..n {
        sum += f64::from(k[i].to_f32() * q16[i]);
    }
    sum as f32
}

/// ggml's `GGML_F32x8_REDUCE` of four 8-lane accumulators (AVX build).
#[inline(always)]
pub(super) fn reduce_vec_dot(acc: &[[f32; 8]; 4]) -> f32 {
    let mut s = [0.0f32; 8];
    for l in 0..8 {
        s[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let t0 = [s[0] + s[4], s[1] + s[5], s[2] + s[6], s[3] + s[7]];
    (t0[0] + t0[1]) + (t0[2] + t0[3])
}

/// ggml `soft_max` over the scaled scores (max, `ggml_v_expf` in groups of 8 from position 0
/// with an f64 sum of each group's `hsum8`, multiply by `(f32)(1/sum)`), then rounds each
/// probability to f16 as the following f16 product does. Positions past the end of the context
/// behave like ggml's masked padding (exactly zero).
#[inline(always)]
fn softmax_probs_f16(scores: &mut [f32]) {
    let max = scores.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0.0f64;
    for chunk in scores.chunks_mut(8) {
        let mut lanes = [0.0f32; 8];
        for (l, v) in lanes.iter_mut().zip(chunk.iter_mut()) {
            *v = ggml_v_expf(*v - max);
            *l = *v;
        }
        sum += f64::from(hsum8(&lanes));
    }
    let inv = (1.0 / sum) as f32;
    for v in scores.iter_mut() {
        *v = f16::from_f32(*v * inv).to_f32();
    }
}

/// `out[d] = Σ_pos p[pos] · v[pos][d]` with ggml's accumulator layout over positions: tinyBLAS
/// keeps 8 lanes (lane = pos % 8, needs `head_dim % 4 == 0`), `vec_dot_f16` keeps 32 (pos % 32)
/// reduced by `reduce_vec_dot`. `acc` holds `32 × head_dim` accumulators.
#[inline(always)]
fn weighted_values(
    args: &HeadArgs,
    kv_head: usize,
    probs: &[f32],
    acc: &mut [f32],
    out: &mut [f32],
) {
    let hd = args.layout.head_dim;
    let tiny = args.order == ReductionOrder::TinyBlas && hd.is_multiple_of(4);
    let lanes = if tiny { 8 } else { 32 };
    acc[..lanes * hd].fill(0.0);
    for (pos, &p) in probs.iter().enumerate() {
        let slot = args.layout.slot_of(args.block_table, pos);
        let off = args.layout.head_offset(slot, kv_head);
        let v = &args.v_cache[off..off + hd];
        let a = &mut acc[(pos % lanes) * hd..(pos % lanes + 1) * hd];
        for (ad, vd) in a.iter_mut().zip(v) {
            *ad = vd.to_f32().mul_add(p, *ad);
        }
    }
    for (d, o) in out.iter_mut().enumerate() {
        let lane = |i: usize| acc[i * hd + d];
        *o = if tiny {
            hsum8(&[
                lane(0),
                lane(1),
                lane(2),
                lane(3),
                lane(4),
                lane(5),
                lane(6),
                lane(7),
            ])
        } else {
            let mut grouped = [[0.0f32; 8]; 4];
            for (j, g) in grouped.iter_mut().enumerate() {
                for (l, x) in g.iter_mut().enumerate() {
                    *x = lane(8 * j + l);
                }
            }
            reduce_vec_dot(&grouped)
        };
    }
}
