//! Paged attention over f16 K/V blocks read through a block table, and the KV cache write.
//!
//! One layer's K (or V) cache is `[num_blocks][block_size][num_kv_heads][head_dim]` f16; token
//! position `p` of a sequence lives in slot `block_table[p / block_size] * block_size +
//! p % block_size`. The arithmetic mirrors llama.cpp's non-flash attention (f16 KV cache):
//! q rounded to f16, scores = f16·f16 dots in f32, times `scale`, ggml softmax, probabilities
//! rounded to f16, output = Σ p·v in f32. ggml computes both products with one of two summation
//! orders depending on how many tokens the step (ubatch) holds, see [`ReductionOrder`].

use half::f16;
use rayon::prelude::*;
use std::cell::RefCell;

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
///
/// llama.cpp's order depends on how the work was cut into steps, so its output does too (a
/// cached prefix leaving one token, a chunk boundary). kvgate picks the order per token, by
/// what llama.cpp does in a plain run — a prompt of two or more tokens in one step, then one
/// step per generated token ([`ReductionOrder::for_token`]) — so it matches that run and gives
/// a token the same numbers however its sequence is split, preempted and recomputed, or
/// served from the prefix cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReductionOrder {
    /// `ggml_vec_dot_f16`: a step of exactly one token.
    VecDot,
    /// tinyBLAS: a step of two or more tokens (prefill, or several sequences batched).
    TinyBlas,
}

impl ReductionOrder {
    /// The order for the token at `position` of a sequence whose prompt is `prompt_len`
    /// tokens: tinyBLAS for a prompt token (llama.cpp's prefill step) unless the prompt is a
    /// single token, vec_dot for a generated one (llama.cpp's decode steps).
    pub fn for_token(position: usize, prompt_len: usize) -> Self {
        if position < prompt_len && prompt_len >= 2 {
            ReductionOrder::TinyBlas
        } else {
            ReductionOrder::VecDot
        }
    }
}

/// Stores one token's K and V (`num_kv_heads × head_dim` f32 each) into `slot`, rounded to f16.
pub fn write_kv(
    layout: &KvLayout,
    k_cache: &mut [f16],
    v_cache: &mut [f16],
    slot: usize,
    k: &[f32],
    v: &[f32],
) {
    let n = layout.slot_elems();
    assert_eq!(k.len(), n, "write_kv: k must be num_kv_heads × head_dim");
    assert_eq!(v.len(), n, "write_kv: v must be num_kv_heads × head_dim");
    let start = slot * n;
    assert!(
        start + n <= k_cache.len() && start + n <= v_cache.len(),
        "write_kv: slot {slot} outside the cache"
    );
    crate::ops::f32_to_f16_slice(k, &mut k_cache[start..start + n]);
    crate::ops::f32_to_f16_slice(v, &mut v_cache[start..start + n]);
}

/// Reusable buffers for [`paged_attention`]; they grow to the longest context seen and are then
/// reused, so the decode loop does not allocate.
#[derive(Debug, Default)]
pub struct AttentionScratch {
    floats: Vec<f32>,
    rows: Vec<usize>,
}

impl AttentionScratch {
    pub fn new() -> Self {
        Self::default()
    }
}

/// Attention of one query token (all `n_heads` heads, `q` is `n_heads × head_dim`) over
/// positions `0..context_len` of a sequence; writes `n_heads × head_dim` values to `out`.
/// Causality is the caller's: pass `context_len = position + 1`. `order` follows what the
/// token is, see [`ReductionOrder::for_token`]. Runs on the calling thread.
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
    scratch: &mut AttentionScratch,
) {
    let (args, gw) = one_row_args(
        layout,
        q,
        n_heads,
        k_cache,
        v_cache,
        block_table,
        context_len,
        scale,
        order,
        out,
    );
    for (kv_head, (qg, og)) in q.chunks_exact(gw).zip(out.chunks_exact_mut(gw)).enumerate() {
        attention_group(&args, qg, kv_head, og, scratch);
    }
}

/// One query row of [`paged_attention_batch`]: the sequence's block table and the number of
/// positions it attends to (its position + 1).
#[derive(Clone, Copy, Debug)]
pub struct AttentionRow<'a> {
    pub block_table: &'a [u32],
    pub context_len: usize,
}

/// [`paged_attention`] for many query rows at once (e.g. every token of a scheduler step, from
/// several sequences), spread over the pool by (row, KV head), or by (row, query head) when a
/// step has too few rows to keep every thread busy. `q` and `out` are
/// `rows.len() × n_heads × head_dim`. Each pool thread keeps its own scratch buffers.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_batch(
    layout: &KvLayout,
    q: &[f32],
    rows: &[AttentionRow],
    n_heads: usize,
    k_cache: &[f16],
    v_cache: &[f16],
    scale: f32,
    order: ReductionOrder,
    out: &mut [f32],
    pool: &rayon::ThreadPool,
) {
    let group = check_heads(layout, n_heads);
    let width = n_heads * layout.head_dim;
    assert_eq!(
        q.len(),
        rows.len() * width,
        "paged_attention_batch: q must be rows × n_heads × head_dim"
    );
    assert_eq!(
        out.len(),
        rows.len() * width,
        "paged_attention_batch: out must be rows × n_heads × head_dim"
    );
    for row in rows {
        check_row(layout, k_cache, v_cache, row.block_table, row.context_len);
    }
    thread_local! {
        static SCRATCH: RefCell<AttentionScratch> = RefCell::new(AttentionScratch::new());
    }
    // One task per (row, KV head) shares each widened K row among the group's query heads;
    // when that leaves too few tasks to keep every thread busy (one decode row has only
    // `num_kv_heads` of them), one task per (row, query head). Heads are independent, so the
    // split does not change any result.
    let heads_per_task = if rows.len() * layout.num_kv_heads >= 2 * pool.current_num_threads() {
        group
    } else {
        1
    };
    let tw = heads_per_task * layout.head_dim;
    pool.install(|| {
        out.par_chunks_mut(tw)
            .zip(q.par_chunks(tw))
            .enumerate()
            .for_each(|(task, (og, qt))| {
                let row = &rows[task * tw / width];
                let kv_head = (task * heads_per_task % n_heads) / group;
                let args = HeadArgs {
                    layout,
                    k_cache,
                    v_cache,
                    block_table: row.block_table,
                    context_len: row.context_len,
                    scale,
                    order,
                };
                SCRATCH.with(|s| attention_group(&args, qt, kv_head, og, &mut s.borrow_mut()));
            });
    });
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
    let (args, gw) = one_row_args(
        layout,
        q,
        n_heads,
        k_cache,
        v_cache,
        block_table,
        context_len,
        scale,
        order,
        out,
    );
    let mut scratch = AttentionScratch::new();
    for (kv_head, (qg, og)) in q.chunks_exact(gw).zip(out.chunks_exact_mut(gw)).enumerate() {
        scalar::attention_group(&args, qg, kv_head, og, &mut scratch.floats);
    }
}

/// Checks the arguments of a one-row attention call (shared by [`paged_attention`] and its
/// reference) and returns the per-head arguments plus the width of one KV head's query group.
#[allow(clippy::too_many_arguments)]
fn one_row_args<'a>(
    layout: &'a KvLayout,
    q: &[f32],
    n_heads: usize,
    k_cache: &'a [f16],
    v_cache: &'a [f16],
    block_table: &'a [u32],
    context_len: usize,
    scale: f32,
    order: ReductionOrder,
    out: &[f32],
) -> (HeadArgs<'a>, usize) {
    let group = check_heads(layout, n_heads);
    let width = n_heads * layout.head_dim;
    assert_eq!(
        q.len(),
        width,
        "paged_attention: q must be n_heads × head_dim"
    );
    assert_eq!(
        out.len(),
        width,
        "paged_attention: out must be n_heads × head_dim"
    );
    check_row(layout, k_cache, v_cache, block_table, context_len);
    let args = HeadArgs {
        layout,
        k_cache,
        v_cache,
        block_table,
        context_len,
        scale,
        order,
    };
    (args, group * layout.head_dim)
}

/// Returns the number of query heads per KV head.
fn check_heads(layout: &KvLayout, n_heads: usize) -> usize {
    assert!(
        layout.num_kv_heads > 0
            && layout.block_size > 0
            && n_heads.is_multiple_of(layout.num_kv_heads),
        "attention: n_heads must be a positive multiple of num_kv_heads"
    );
    n_heads / layout.num_kv_heads
}

/// The block table must cover the context and name blocks inside both caches; after this check
/// every K/V row the kernels read is in bounds.
fn check_row(
    layout: &KvLayout,
    k_cache: &[f16],
    v_cache: &[f16],
    block_table: &[u32],
    context_len: usize,
) {
    assert!(context_len > 0, "attention: empty context");
    let blocks = context_len.div_ceil(layout.block_size);
    assert!(
        block_table.len() >= blocks,
        "attention: block table too short for the context"
    );
    let end = block_table[..blocks]
        .iter()
        .map(|&b| (b as usize + 1) * layout.block_elems())
        .max()
        .unwrap_or(0);
    assert!(
        end <= k_cache.len() && end <= v_cache.len(),
        "attention: block id outside the cache"
    );
}

/// Everything a kernel needs about one sequence's attention, besides the query.
struct HeadArgs<'a> {
    layout: &'a KvLayout,
    k_cache: &'a [f16],
    v_cache: &'a [f16],
    block_table: &'a [u32],
    context_len: usize,
    scale: f32,
    order: ReductionOrder,
}

/// The query heads `q` (`group × head_dim`) that share `kv_head`, into `out` (same shape).
fn attention_group(
    args: &HeadArgs,
    q: &[f32],
    kv_head: usize,
    out: &mut [f32],
    scratch: &mut AttentionScratch,
) {
    // Every K/V row offset below is computed from `kv_head`; `check_row` only proved the
    // blocks are inside the caches, so a head past the layout would read another slot's data
    // (or, for the last slot, past the cache in the AVX2 kernel).
    assert!(
        kv_head < args.layout.num_kv_heads,
        "attention: kv_head {kv_head} out of range for {} KV heads",
        args.layout.num_kv_heads
    );
    #[cfg(target_arch = "x86_64")]
    if crate::simd::Avx2Fma::detect().is_some() {
        // SAFETY: the token proves AVX2, FMA and F16C; rows were bounds-checked by
        // `check_row` and `kv_head` above.
        unsafe { avx2::attention_group(args, q, kv_head, out, scratch) };
        return;
    }
    scalar::attention_group(args, q, kv_head, out, &mut scratch.floats);
}

#[cfg(target_arch = "x86_64")]
mod avx2;
mod scalar;
#[cfg(test)]
mod tests;
