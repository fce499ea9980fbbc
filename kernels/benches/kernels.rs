//! Kernel benchmarks at SmolLM2-135M shapes (d=576, ff=1536, vocab 49152, head_dim 64):
//! quantized matmul for decode (m = 1, bandwidth bound) and prefill / batched decode
//! (m = 16, 36, 64, 104, compute bound; 36 is a decode-heavy step under a target inter-token
//! latency, 104 a prefill step), plus paged attention. Run with
//! `cargo bench -p kvgate-kernels -- --quick`; set KVGATE_KERNELS_SCALAR=1 for the scalar path.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::f16;
use kvgate_kernels::attention::{KvLayout, ReductionOrder, paged_attention};
use kvgate_kernels::matmul::{MatmulScratch, QMatrix, matmul, matmul_fused};
use kvgate_kernels::quant::WeightType;
use std::hint::black_box;

/// Deterministic pseudo-random bytes (xorshift), with plausible f16 block scales.
fn weights(ty: WeightType, rows: usize, cols: usize) -> Vec<u8> {
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut data: Vec<u8> = (0..rows * ty.row_bytes(cols))
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect();
    for b in data.chunks_exact_mut(ty.block_bytes()) {
        // Q6_K keeps its scale at the end of the block; the others at the start.
        let d_at = if ty == WeightType::Q6_K { 208 } else { 0 };
        b[d_at..d_at + 2].copy_from_slice(&f16::from_f32(0.01).to_le_bytes());
        if matches!(ty, WeightType::Q4_1 | WeightType::Q4_K | WeightType::Q5_K) {
            b[2..4].copy_from_slice(&f16::from_f32(-0.05).to_le_bytes());
        }
    }
    data
}

fn bench_matmul(c: &mut Criterion) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("thread pool");
    let shapes = [
        ("q4_1_576x576", WeightType::Q4_1, 576, 576),
        ("q4_1_1536x576", WeightType::Q4_1, 1536, 576),
        ("q4_1_576x1536", WeightType::Q4_1, 576, 1536),
        ("q8_0_49152x576", WeightType::Q8_0, 49152, 576),
        // K-quants need widths that are multiples of 256: a 1536-wide square (about Qwen2.5-1.5B's
        // hidden size) per type, with Q4_1 at the same shape as the baseline.
        ("q4_1_1536x1536", WeightType::Q4_1, 1536, 1536),
        ("q4_k_1536x1536", WeightType::Q4_K, 1536, 1536),
        ("q5_k_1536x1536", WeightType::Q5_K, 1536, 1536),
        ("q6_k_1536x1536", WeightType::Q6_K, 1536, 1536),
        ("q5_0_1536x1536", WeightType::Q5_0, 1536, 1536),
    ];
    let mut group = c.benchmark_group("matmul");
    for (name, ty, rows, cols) in shapes {
        let data = weights(ty, rows, cols);
        let w = QMatrix::new(ty, &data, rows, cols).expect("valid matrix");
        for m in [1usize, 16, 36, 64, 104] {
            if rows == 49152 && m == 64 {
                continue;
            }
            let x: Vec<f32> = (0..m * cols)
                .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
                .collect();
            let mut out = vec![0.0; m * rows];
            let mut scratch = MatmulScratch::new();
            // Decode is judged by weight bandwidth, prefill by rows processed.
            group.throughput(if m == 1 {
                Throughput::Bytes(data.len() as u64)
            } else {
                Throughput::Elements(m as u64)
            });
            group.bench_with_input(BenchmarkId::new(name, m), &m, |b, &m| {
                // Inside the pool, as the CPU backend runs a whole forward pass.
                pool.install(|| {
                    b.iter(|| matmul(&w, black_box(&x), m, &mut out, &mut scratch, &pool))
                });
            });
        }
    }
    group.finish();
}

fn bench_attention(c: &mut Criterion) {
    let layout = KvLayout {
        block_size: 16,
        num_kv_heads: 3,
        head_dim: 64,
    };
    let n_heads = 9;
    let mut group = c.benchmark_group("paged_attention");
    for context in [64usize, 512] {
        let blocks = context.div_ceil(layout.block_size);
        let cache: Vec<f16> = (0..blocks * layout.block_elems())
            .map(|i| f16::from_f32((i % 13) as f32 * 0.01))
            .collect();
        let table: Vec<u32> = (0..blocks as u32).rev().collect();
        let q: Vec<f32> = (0..n_heads * 64).map(|i| (i % 7) as f32 * 0.1).collect();
        let mut out = vec![0.0; n_heads * 64];
        let mut scratch = kvgate_kernels::attention::AttentionScratch::new();
        group.bench_function(BenchmarkId::new("decode", context), |b| {
            b.iter(|| {
                paged_attention(
                    &layout,
                    black_box(&q),
                    n_heads,
                    &cache,
                    &cache,
                    &table,
                    context,
                    0.125,
                    ReductionOrder::VecDot,
                    &mut out,
                    &mut scratch,
                )
            })
        });
    }
    group.finish();
}

/// The matrix products of one whole decode step of SmolLM2-135M (30 layers of Q4_1 attention
/// and FFN weights, the Q8_0 output head): 96.4 MB of distinct weights, more than the last-level
/// cache, so this is the DRAM-streaming rate a single-sequence decode can reach. `separate` runs
/// the 211 products one by one, `fused` shares Q/K/V and gate/up passes (121 fork/joins). The
/// `read_only` line is the same bytes merely summed by the same threads: the bandwidth bound.
fn bench_decode_pass(c: &mut Criterion) {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("thread pool");
    let (d, kv, ff, vocab) = (576, 192, 1536, 49152);
    let layer_shapes = [(d, d), (kv, d), (kv, d), (d, d), (ff, d), (ff, d), (d, ff)];
    let layers: Vec<Vec<Vec<u8>>> = (0..30)
        .map(|_| {
            layer_shapes
                .iter()
                .map(|&(rows, cols)| weights(WeightType::Q4_1, rows, cols))
                .collect()
        })
        .collect();
    let head = weights(WeightType::Q8_0, vocab, d);
    let total_bytes: usize = head.len() + layers.iter().flatten().map(Vec::len).sum::<usize>();
    let mats: Vec<Vec<QMatrix>> = layers
        .iter()
        .map(|l| {
            l.iter()
                .zip(layer_shapes)
                .map(|(data, (rows, cols))| {
                    QMatrix::new(WeightType::Q4_1, data, rows, cols).expect("valid matrix")
                })
                .collect()
        })
        .collect();
    let head = QMatrix::new(WeightType::Q8_0, &head, vocab, d).expect("valid matrix");
    let x: Vec<f32> = (0..ff)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    let (mut q, mut k, mut v, mut o) = (vec![0.0; d], vec![0.0; kv], vec![0.0; kv], vec![0.0; d]);
    let (mut g, mut u, mut dn) = (vec![0.0; ff], vec![0.0; ff], vec![0.0; d]);
    let mut logits = vec![0.0; vocab];
    let mut scratch = MatmulScratch::new();
    let mut group = c.benchmark_group("decode_pass");
    group.throughput(Throughput::Bytes(total_bytes as u64));
    group.sample_size(20);
    group.bench_function("separate", |b| {
        pool.install(|| {
            b.iter(|| {
                for m in &mats {
                    let s = &mut scratch;
                    matmul(&m[0], &x[..d], 1, &mut q, s, &pool);
                    matmul(&m[1], &x[..d], 1, &mut k, s, &pool);
                    matmul(&m[2], &x[..d], 1, &mut v, s, &pool);
                    matmul(&m[3], &x[..d], 1, &mut o, s, &pool);
                    matmul(&m[4], &x[..d], 1, &mut g, s, &pool);
                    matmul(&m[5], &x[..d], 1, &mut u, s, &pool);
                    matmul(&m[6], &x[..ff], 1, &mut dn, s, &pool);
                }
                matmul(&head, &x[..d], 1, &mut logits, &mut scratch, &pool);
            })
        })
    });
    // m = 1 is single-stream decode; m = 16 a batched decode step of 16 sequences.
    for m in [1usize, 16] {
        let x = x.repeat(m);
        let (mut q, mut k, mut v) = (vec![0.0; m * d], vec![0.0; m * kv], vec![0.0; m * kv]);
        let (mut o, mut g, mut u) = (vec![0.0; m * d], vec![0.0; m * ff], vec![0.0; m * ff]);
        let (mut dn, mut logits) = (vec![0.0; m * d], vec![0.0; m * vocab]);
        let (xd, xf) = (&x[..m * d], &x[..m * ff]);
        group.bench_with_input(BenchmarkId::new("fused", m), &m, |b, &m| {
            pool.install(|| {
                b.iter(|| {
                    for w in &mats {
                        let s = &mut scratch;
                        let qkv = [(&w[0], &mut q[..]), (&w[1], &mut k), (&w[2], &mut v)];
                        matmul_fused(qkv, xd, m, s, &pool);
                        matmul(&w[3], xd, m, &mut o, s, &pool);
                        matmul_fused([(&w[4], &mut g[..]), (&w[5], &mut u)], xd, m, s, &pool);
                        matmul(&w[6], xf, m, &mut dn, s, &pool);
                    }
                    matmul(&head, xd, m, &mut logits, &mut scratch, &pool);
                })
            })
        });
    }
    let all: Vec<&[u8]> = layers
        .iter()
        .flatten()
        .map(Vec::as_slice)
        .chain(std::iter::once(head.data))
        .collect();
    group.bench_function("read_only", |b| {
        b.iter(|| {
            // Each thread reads one half of every matrix, as the matmuls split rows.
            let sum = |second: bool| {
                all.iter()
                    .map(|p| {
                        let (a, b) = p.split_at(p.len() / 2);
                        let part = if second { b } else { a };
                        part.chunks_exact(32).fold(0u8, |acc, c| acc ^ c[0] ^ c[31])
                    })
                    .fold(0u8, |a, b| a ^ b)
            };
            pool.install(|| black_box(rayon::join(|| sum(false), || sum(true))))
        })
    });
    group.finish();
}

criterion_group!(benches, bench_matmul, bench_attention, bench_decode_pass);
criterion_main!(benches);
