use super::*;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng, rngs::StdRng};

const LAYOUT: KvLayout = KvLayout {
    block_size: 4,
    num_kv_heads: 3,
    head_dim: 64,
};
const N_HEADS: usize = 9;

struct Fixture {
    k_cache: Vec<f16>,
    v_cache: Vec<f16>,
    block_table: Vec<u32>,
    /// Dense per-position K and V (`context × slot_elems`) as written.
    k_dense: Vec<f32>,
    v_dense: Vec<f32>,
}

/// Writes `context` random tokens through `write_kv` into shuffled, non-contiguous blocks.
fn fixture(rng: &mut StdRng, context: usize, num_blocks: usize) -> Fixture {
    let n = LAYOUT.slot_elems();
    let mut k_cache = vec![f16::from_f32(f32::NAN); num_blocks * LAYOUT.block_elems()];
    let mut v_cache = k_cache.clone();
    let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
    ids.shuffle(rng);
    let block_table: Vec<u32> = ids[..context.div_ceil(LAYOUT.block_size)].to_vec();
    let mut k_dense = Vec::new();
    let mut v_dense = Vec::new();
    for pos in 0..context {
        let k: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let slot = LAYOUT.slot_of(&block_table, pos);
        write_kv(&LAYOUT, &mut k_cache, &mut v_cache, slot, &k, &v);
        k_dense.extend(k.iter().map(|&x| f16::from_f32(x).to_f32()));
        v_dense.extend(v.iter().map(|&x| f16::from_f32(x).to_f32()));
    }
    Fixture {
        k_cache,
        v_cache,
        block_table,
        k_dense,
        v_dense,
    }
}

/// Dense f64 attention with GQA over the f16-rounded cache contents.
fn naive(f: &Fixture, q: &[f32], context: usize, scale: f64) -> Vec<f64> {
    let hd = LAYOUT.head_dim;
    let n = LAYOUT.slot_elems();
    let mut out = vec![0.0; N_HEADS * hd];
    for h in 0..N_HEADS {
        let kvh = h / (N_HEADS / LAYOUT.num_kv_heads);
        let qh: Vec<f64> = q[h * hd..(h + 1) * hd]
            .iter()
            .map(|&x| f64::from(f16::from_f32(x).to_f32()))
            .collect();
        let scores: Vec<f64> = (0..context)
            .map(|p| {
                (0..hd)
                    .map(|d| qh[d] * f64::from(f.k_dense[p * n + kvh * hd + d]))
                    .sum::<f64>()
                    * scale
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
        let sum: f64 = e.iter().sum();
        for d in 0..hd {
            out[h * hd + d] = (0..context)
                .map(|p| e[p] / sum * f64::from(f.v_dense[p * n + kvh * hd + d]))
                .sum();
        }
    }
    out
}

fn run(f: &Fixture, q: &[f32], context: usize, order: ReductionOrder) -> Vec<f32> {
    let mut out = vec![0.0; N_HEADS * LAYOUT.head_dim];
    let mut scratch = AttentionScratch::new();
    let (k, v, bt) = (&f.k_cache, &f.v_cache, &f.block_table);
    paged_attention(
        &LAYOUT,
        q,
        N_HEADS,
        k,
        v,
        bt,
        context,
        0.125,
        order,
        &mut out,
        &mut scratch,
    );
    out
}

#[test]
fn matches_dense_reference_through_shuffled_block_table() {
    let mut rng = StdRng::seed_from_u64(11);
    for context in [1, 3, 4, 5, 31, 32, 33, 70] {
        let f = fixture(&mut rng, context, 40);
        let q: Vec<f32> = (0..N_HEADS * LAYOUT.head_dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let want = naive(&f, &q, context, 0.125);
        for order in [ReductionOrder::VecDot, ReductionOrder::TinyBlas] {
            let got = run(&f, &q, context, order);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                // f16 probabilities limit agreement to ~1e-3 relative.
                assert!(
                    (f64::from(*g) - w).abs() < 2e-3,
                    "ctx {context} {order:?} [{i}]: {g} vs {w}"
                );
            }
        }
    }
}

#[test]
fn dispatching_path_is_bit_identical_to_reference() {
    let mut rng = StdRng::seed_from_u64(5);
    for context in [1, 2, 9, 33, 100] {
        let f = fixture(&mut rng, context, 30);
        let q: Vec<f32> = (0..N_HEADS * LAYOUT.head_dim)
            .map(|_| rng.random_range(-3.0..3.0))
            .collect();
        for order in [ReductionOrder::VecDot, ReductionOrder::TinyBlas] {
            let got = run(&f, &q, context, order);
            let mut want = vec![0.0; got.len()];
            let (k, v, bt) = (&f.k_cache, &f.v_cache, &f.block_table);
            paged_attention_reference(
                &LAYOUT, &q, N_HEADS, k, v, bt, context, 0.125, order, &mut want,
            );
            assert_eq!(got, want, "ctx {context} {order:?}");
        }
    }
}

#[test]
fn physical_block_placement_does_not_change_the_result() {
    let mut rng = StdRng::seed_from_u64(9);
    let context = 23;
    let f = fixture(&mut rng, context, 12);
    let q: Vec<f32> = (0..N_HEADS * LAYOUT.head_dim)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    // Copy every logical block to a different physical block and remap the table.
    let mut moved = Fixture {
        k_cache: vec![f16::ZERO; f.k_cache.len() * 2],
        v_cache: vec![f16::ZERO; f.v_cache.len() * 2],
        block_table: Vec::new(),
        k_dense: Vec::new(),
        v_dense: Vec::new(),
    };
    let be = LAYOUT.block_elems();
    for (i, &b) in f.block_table.iter().enumerate() {
        let target = 23 - i as u32;
        let (src, dst) = (b as usize * be, target as usize * be);
        moved.k_cache[dst..dst + be].copy_from_slice(&f.k_cache[src..src + be]);
        moved.v_cache[dst..dst + be].copy_from_slice(&f.v_cache[src..src + be]);
        moved.block_table.push(target);
    }
    for order in [ReductionOrder::VecDot, ReductionOrder::TinyBlas] {
        assert_eq!(run(&f, &q, context, order), run(&moved, &q, context, order));
    }
}

#[test]
fn single_position_returns_its_value() {
    let mut rng = StdRng::seed_from_u64(1);
    let f = fixture(&mut rng, 1, 3);
    let q = vec![0.5; N_HEADS * LAYOUT.head_dim];
    let out = run(&f, &q, 1, ReductionOrder::VecDot);
    for h in 0..N_HEADS {
        let kvh = h / 3;
        for d in 0..LAYOUT.head_dim {
            assert_eq!(
                out[h * LAYOUT.head_dim + d],
                f.v_dense[kvh * LAYOUT.head_dim + d]
            );
        }
    }
}

#[test]
fn reduction_order_follows_what_the_token_is() {
    // Prompt tokens: tinyBLAS (llama.cpp's prefill step), unless the prompt is one token.
    assert_eq!(ReductionOrder::for_token(0, 2), ReductionOrder::TinyBlas);
    assert_eq!(
        ReductionOrder::for_token(511, 512),
        ReductionOrder::TinyBlas
    );
    assert_eq!(ReductionOrder::for_token(0, 1), ReductionOrder::VecDot);
    // Generated tokens: vec_dot (llama.cpp's decode steps).
    assert_eq!(ReductionOrder::for_token(2, 2), ReductionOrder::VecDot);
    assert_eq!(ReductionOrder::for_token(600, 512), ReductionOrder::VecDot);
}

#[test]
fn vec_dot_reduction_pairs_accumulators_like_ggml() {
    // acc[0]+acc[2], acc[1]+acc[3], then lanes (k, k+4), then (t0+t1)+(t2+t3).
    let mut acc = [[0.0f32; 8]; 4];
    acc[0][0] = 1.0e8;
    acc[2][0] = -1.0e8;
    acc[1][0] = 1.0;
    acc[3][4] = 3.0;
    assert_eq!(scalar::reduce_vec_dot(&acc), 4.0);
}

#[test]
fn batch_matches_per_row_calls() {
    let mut rng = StdRng::seed_from_u64(17);
    // Two sequences sharing one cache: write both through disjoint block tables.
    let f = fixture(&mut rng, 45, 40);
    let other_table: Vec<u32> = (0..40u32)
        .filter(|b| !f.block_table.contains(b))
        .take(3)
        .collect();
    let mut k_cache = f.k_cache.clone();
    let mut v_cache = f.v_cache.clone();
    let n = LAYOUT.slot_elems();
    for pos in 0..10 {
        let k: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
        let v: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        write_kv(
            &LAYOUT,
            &mut k_cache,
            &mut v_cache,
            LAYOUT.slot_of(&other_table, pos),
            &k,
            &v,
        );
    }
    let rows = [
        AttentionRow {
            block_table: &f.block_table,
            context_len: 45,
        },
        AttentionRow {
            block_table: &other_table,
            context_len: 10,
        },
        AttentionRow {
            block_table: &f.block_table,
            context_len: 7,
        },
    ];
    let width = N_HEADS * LAYOUT.head_dim;
    let q: Vec<f32> = (0..rows.len() * width)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    // 3 rows × 2 threads: a task per (row, KV head); 1 row × 3 threads: a task per query head.
    for (threads, n_rows) in [(2, rows.len()), (3, 1), (2, 1)] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let rows = &rows[..n_rows];
        let q = &q[..n_rows * width];
        for order in [ReductionOrder::VecDot, ReductionOrder::TinyBlas] {
            let mut out = vec![0.0; q.len()];
            paged_attention_batch(
                &LAYOUT, q, rows, N_HEADS, &k_cache, &v_cache, 0.125, order, &mut out, &pool,
            );
            for (i, row) in rows.iter().enumerate() {
                let mut want = vec![0.0; width];
                let qi = &q[i * width..(i + 1) * width];
                let mut scratch = AttentionScratch::new();
                let (bt, ctx) = (row.block_table, row.context_len);
                paged_attention(
                    &LAYOUT,
                    qi,
                    N_HEADS,
                    &k_cache,
                    &v_cache,
                    bt,
                    ctx,
                    0.125,
                    order,
                    &mut want,
                    &mut scratch,
                );
                assert_eq!(
                    &out[i * width..(i + 1) * width],
                    &want[..],
                    "row {i} {order:?} threads {threads} rows {n_rows}"
                );
            }
        }
    }
}

#[test]
fn small_head_dim_uses_portable_path_consistently() {
    let layout = KvLayout {
        block_size: 2,
        num_kv_heads: 1,
        head_dim: 8,
    };
    let mut k_cache = vec![f16::ZERO; 4 * layout.block_elems()];
    let mut v_cache = k_cache.clone();
    let table = [3u32, 0, 2];
    for pos in 0..5 {
        let k: Vec<f32> = (0..8).map(|d| (pos * 8 + d) as f32 * 0.05 - 1.0).collect();
        let v: Vec<f32> = (0..8).map(|d| (d as f32 - pos as f32) * 0.1).collect();
        write_kv(
            &layout,
            &mut k_cache,
            &mut v_cache,
            layout.slot_of(&table, pos),
            &k,
            &v,
        );
    }
    let q: Vec<f32> = (0..16).map(|i| i as f32 * 0.1 - 0.7).collect();
    for order in [ReductionOrder::VecDot, ReductionOrder::TinyBlas] {
        let (mut got, mut want) = (vec![0.0; 16], vec![0.0; 16]);
        let mut scratch = AttentionScratch::new();
        paged_attention(
            &layout,
            &q,
            2,
            &k_cache,
            &v_cache,
            &table,
            5,
            0.3,
            order,
            &mut got,
            &mut scratch,
        );
        paged_attention_reference(
            &layout, &q, 2, &k_cache, &v_cache, &table, 5, 0.3, order, &mut want,
        );
        assert_eq!(got, want);
        assert!(got.iter().all(|v| v.is_finite()));
    }
}

#[test]
#[should_panic(expected = "block id outside the cache")]
fn block_ids_beyond_the_cache_are_rejected() {
    let cache = vec![f16::ZERO; 2 * LAYOUT.block_elems()];
    let q = vec![0.0; N_HEADS * LAYOUT.head_dim];
    let mut out = q.clone();
    let mut scratch = AttentionScratch::new();
    let order = ReductionOrder::VecDot;
    paged_attention(
        &LAYOUT,
        &q,
        N_HEADS,
        &cache,
        &cache,
        &[1, 2],
        5,
        0.125,
        order,
        &mut out,
        &mut scratch,
    );
}

/// The head index is the one thing the per-head kernels take that `check_row` cannot see: a
/// head past the layout must stop at the entry, not read the neighbouring slot's K/V (or,
/// for the last slot, memory past the cache).
#[test]
#[should_panic(expected = "kv_head 3 out of range for 3 KV heads")]
fn a_kv_head_outside_the_layout_is_refused_at_the_entry() {
    let mut rng = StdRng::seed_from_u64(7);
    let f = fixture(&mut rng, 5, 4);
    let args = HeadArgs {
        layout: &LAYOUT,
        k_cache: &f.k_cache,
        v_cache: &f.v_cache,
        block_table: &f.block_table,
        context_len: 5,
        scale: 0.125,
        order: ReductionOrder::TinyBlas,
    };
    let group = N_HEADS / LAYOUT.num_kv_heads;
    let q = vec![0.5; group * LAYOUT.head_dim];
    let mut out = vec![0.0; q.len()];
    attention_group(
        &args,
        &q,
        LAYOUT.num_kv_heads,
        &mut out,
        &mut AttentionScratch::new(),
    );
}
