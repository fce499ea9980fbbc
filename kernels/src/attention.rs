//! Paged attention over f16 K/V blocks read through a block table, and the KV cache write.
//!
//! One layer's K (or V) cache is `[num_blocks][block_size][num_kv_heads][head_dim]` f16; token
//! position `p` of a sequence lives in slot `block_table[p / block_size] * block_size +
//! p % block_size`. The arithmetic mirrors llama.cpp's non-flash attention (f16 KV cache):
//! q rounded to f16, scores = f16·f16 dots in f32, times `scale`, ggml softmax, probabilities
//! rounded to f16, output = Σ p·v in f32. ggml computes both products with one of two summation
//! orders depending on how many tokens the step (ubatch) holds, see [`ReductionOrder`].

use crate::dot::hsum8;
use crate::ops::ggml_v_expf;
use half::f16;

/// Geometry of one layer's paged K or V cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvLayout {
    /// f16 values per slot (one token, all KV heads).
    pub fn slot_elems(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// f16 values per block.
    pub fn block_elems(&self) -> usize {
        self.block_size * self.slot_elems()
    }

    #[inline(always)]
    fn head_offset(&self, slot: usize, kv_head: usize) -> usize {
        (slot * self.num_kv_heads + kv_head) * self.head_dim
    }

    #[inline(always)]
    fn slot_of(&self, block_table: &[u32], pos: usize) -> usize {
        block_table[pos / self.block_size] as usize * self.block_size + pos % self.block_size
    }
}

/// The summation order ggml uses for the two attention products. llama.cpp routes a matrix
/// product through llamafile's tinyBLAS when the step has at least two tokens (one 8-lane
/// accumulator) and through `ggml_vec_dot_f16` otherwise (four 8-lane accumulators); the
/// results differ in the last bits, which can flip a greedy argmax.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReductionOrder {
    /// `ggml_vec_dot_f16`: a step of exactly one token.
    VecDot,
    /// tinyBLAS: a step of two or more tokens (prefill, or several sequences batched).
    TinyBlas,
}

impl ReductionOrder {
    /// The order llama.cpp uses for a step (ubatch) of `step_tokens` tokens.
    pub fn for_step(step_tokens: usize) -> Self {
        if step_tokens < 2 { ReductionOrder::VecDot } else { ReductionOrder::TinyBlas }
    }
}

/// Stores one token's K and V (`num_kv_heads × head_dim` f32 each) into `slot`, rounded to f16.
pub fn write_kv(layout: &KvLayout, k_cache: &mut [f16], v_cache: &mut [f16], slot: usize, k: &[f32], v: &[f32]) {
    let n = layout.slot_elems();
    assert_eq!(k.len(), n, "write_kv: k must be num_kv_heads × head_dim");
    assert_eq!(v.len(), n, "write_kv: v must be num_kv_heads × head_dim");
    let start = slot * n;
    assert!(start + n <= k_cache.len() && start + n <= v_cache.len(), "write_kv: slot {slot} outside the cache");
    crate::ops::f32_to_f16_slice(k, &mut k_cache[start..start + n]);
    crate::ops::f32_to_f16_slice(v, &mut v_cache[start..start + n]);
}

/// Attention of one query token (all `n_heads` heads, `q` is `n_heads × head_dim`) over
/// positions `0..context_len` of a sequence; writes `n_heads × head_dim` values to `out`.
/// Causality is the caller's: pass `context_len = position + 1`. `scratch` is resized to
/// `context_len` and reused across calls.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention(
    layout: &KvLayout,
    q: &[f32],
    n_heads: usize,
    k_cache: &[f16],
    v_cache: &[f16],
    block_table: &[u32],
    context_len: usize,
    scale: f32,
    order: ReductionOrder,
    out: &mut [f32],
    scratch: &mut Vec<f32>,
) {
    let hd = layout.head_dim;
    assert!(layout.num_kv_heads > 0 && n_heads % layout.num_kv_heads == 0, "heads must be a multiple of kv heads");
    assert_eq!(q.len(), n_heads * hd, "paged_attention: q must be n_heads × head_dim");
    assert_eq!(out.len(), n_heads * hd, "paged_attention: out must be n_heads × head_dim");
    assert!(context_len > 0, "paged_attention: empty context");
    assert!(block_table.len() * layout.block_size >= context_len, "paged_attention: block table too short");
    let max_slot_end = block_table[..context_len.div_ceil(layout.block_size)]
        .iter()
        .map(|&b| (b as usize + 1) * layout.block_elems())
        .max()
        .unwrap_or(0);
    assert!(max_slot_end <= k_cache.len() && max_slot_end <= v_cache.len(), "paged_attention: block id outside the cache");
    let args = HeadArgs { layout, k_cache, v_cache, block_table, context_len, scale, order };
    #[cfg(target_arch = "x86_64")]
    if crate::simd_level() == crate::SimdLevel::Avx2 {
        // SAFETY: the CPU supports AVX2, FMA and F16C (checked by simd_level).
        unsafe { attention_heads_avx2(&args, q, n_heads, out, scratch) };
        return;
    }
    attention_heads(&args, q, n_heads, out, scratch);
}

/// Portable reference of [`paged_attention`] (same results, bit for bit).
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_reference(
    layout: &KvLayout,
    q: &[f32],
    n_heads: usize,
    k_cache: &[f16],
    v_cache: &[f16],
    block_table: &[u32],
    context_len: usize,
    scale: f32,
    order: ReductionOrder,
    out: &mut [f32],
) {
    let args = HeadArgs { layout, k_cache, v_cache, block_table, context_len, scale, order };
    attention_heads(&args, q, n_heads, out, &mut Vec::new());
}

struct HeadArgs<'a> {
    layout: &'a KvLayout,
    k_cache: &'a [f16],
    v_cache: &'a [f16],
    block_table: &'a [u32],
    context_len: usize,
    scale: f32,
    order: ReductionOrder,
}

/// The same code compiled with AVX2/FMA/F16C enabled, so that `mul_add` becomes one instruction
/// and the loops vectorize; the arithmetic (and so the result) is unchanged.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attention_heads_avx2(args: &HeadArgs, q: &[f32], n_heads: usize, out: &mut [f32], scratch: &mut Vec<f32>) {
    attention_heads(args, q, n_heads, out, scratch);
}

#[inline(always)]
fn attention_heads(args: &HeadArgs, q: &[f32], n_heads: usize, out: &mut [f32], scratch: &mut Vec<f32>) {
    let hd = args.layout.head_dim;
    let group = n_heads / args.layout.num_kv_heads;
    scratch.clear();
    scratch.resize(args.context_len + 40 * hd, 0.0);
    let (scores, rest) = scratch.split_at_mut(args.context_len);
    let (q16, acc) = rest.split_at_mut(hd);
    for h in 0..n_heads {
        for (d, &v) in q16.iter_mut().zip(&q[h * hd..(h + 1) * hd]) {
            *d = f16::from_f32(v).to_f32();
        }
        let kv_head = h / group;
        for (pos, s) in scores.iter_mut().enumerate() {
            let slot = args.layout.slot_of(args.block_table, pos);
            let off = args.layout.head_offset(slot, kv_head);
            let k = &args.k_cache[off..off + hd];
            *s = dot_k_q(args.order, k, q16) * args.scale;
        }
        softmax_probs_f16(scores);
        weighted_values(args, kv_head, scores, &mut acc[..32 * hd], &mut out[h * hd..(h + 1) * hd]);
    }
}

/// f16 K row · f16-rounded q, in the order of `order` (tinyBLAS needs `head_dim % 8 == 0`).
#[inline(always)]
fn dot_k_q(order: ReductionOrder, k: &[f16], q16: &[f32]) -> f32 {
    let n = k.len();
    if order == ReductionOrder::TinyBlas && n % 8 == 0 {
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
fn reduce_vec_dot(acc: &[[f32; 8]; 4]) -> f32 {
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
fn weighted_values(args: &HeadArgs, kv_head: usize, probs: &[f32], acc: &mut [f32], out: &mut [f32]) {
    let hd = args.layout.head_dim;
    let tiny = args.order == ReductionOrder::TinyBlas && hd % 4 == 0;
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
            hsum8(&[lane(0), lane(1), lane(2), lane(3), lane(4), lane(5), lane(6), lane(7)])
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

#[cfg(test)]
mod tests;
