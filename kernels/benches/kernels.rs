//! Kernel benchmarks at SmolLM2-135M shapes (d=576, ff=1536, vocab 49152, head_dim 64):
//! quantized matmul for decode (m = 1, bandwidth bound) and prefill / batched decode
//! (m = 16, 64, compute bound), plus paged attention. Run with
//! `cargo bench -p kvgate-kernels -- --quick`; set KVGATE_KERNELS_SCALAR=1 for the scalar path.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::f16;
use kvgate_kernels::attention::{KvLayout, ReductionOrder, paged_attention};
use kvgate_kernels::matmul::{MatmulScratch, QMatrix, matmul};
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
        b[0..2].copy_from_slice(&f16::from_f32(0.01).to_le_bytes());
        if ty == WeightType::Q4_1 {
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
    ];
    let mut group = c.benchmark_group("matmul");
    for (name, ty, rows, cols) in shapes {
        let data = weights(ty, rows, cols);
        let w = QMatrix::new(ty, &data, rows, cols).expect("valid matrix");
        for m in [1usize, 16, 64] {
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

criterion_group!(benches, bench_matmul, bench_attention);
criterion_main!(benches);
