use super::*;
use crate::KernelError;
use crate::dot::KQuantOrder;
use crate::quant::{QK, dequantize_row};
use proptest::prelude::*;
use rand::{Rng, SeedableRng, rngs::StdRng};

fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap()
}

/// Random but realistic blocks: small positive scales, mins of both signs, random quants.
pub(crate) fn random_matrix(rng: &mut StdRng, ty: WeightType, rows: usize, cols: usize) -> Vec<u8> {
    let mut data = vec![0u8; rows * ty.row_bytes(cols)];
    rng.fill(&mut data[..]);
    match ty {
        WeightType::F32 => {
            for c in data.chunks_exact_mut(4) {
                c.copy_from_slice(&rng.random_range(-1.0f32..1.0).to_le_bytes());
            }
        }
        WeightType::F16 => {
            for c in data.chunks_exact_mut(2) {
                c.copy_from_slice(&f16::from_f32(rng.random_range(-1.0..1.0)).to_le_bytes());
            }
        }
        WeightType::Q4_K | WeightType::Q5_K | WeightType::Q6_K => {
            // Random scales, mins and values; only the f16 super-block scales need taming.
            let d_at = if ty == WeightType::Q6_K { 208 } else { 0 };
            for b in data.chunks_exact_mut(ty.block_bytes()) {
                b[d_at..d_at + 2]
                    .copy_from_slice(&f16::from_f32(rng.random_range(0.0001..0.005)).to_le_bytes());
                if ty != WeightType::Q6_K {
                    b[2..4].copy_from_slice(
                        &f16::from_f32(rng.random_range(0.0001..0.005)).to_le_bytes(),
                    );
                }
            }
        }
        _ => {
            for b in data.chunks_exact_mut(ty.block_bytes()) {
                b[0..2]
                    .copy_from_slice(&f16::from_f32(rng.random_range(0.0005..0.05)).to_le_bytes());
                if ty == WeightType::Q4_1 || ty == WeightType::Q5_1 {
                    b[2..4]
                        .copy_from_slice(&f16::from_f32(rng.random_range(-0.3..0.3)).to_le_bytes());
                }
            }
        }
    }
    data
}

fn random_acts(rng: &mut StdRng, n: usize) -> Vec<f32> {
    // Mix magnitudes so that scales differ between blocks; include an all-zero block.
    let mut x: Vec<f32> = (0..n)
        .map(|i| rng.random_range(-1.0..1.0) * if i % 97 < 40 { 8.0 } else { 0.5 })
        .collect();
    if n >= QK {
        x[..QK].fill(0.0);
    }
    x
}

const TYPES: [WeightType; 7] = [
    WeightType::Q4_1,
    WeightType::Q4_0,
    WeightType::Q8_0,
    WeightType::F16,
    WeightType::F32,
    WeightType::Q5_0,
    WeightType::Q5_1,
];

const K_TYPES: [WeightType; 3] = [WeightType::Q4_K, WeightType::Q5_K, WeightType::Q6_K];

fn check_against_reference(
    ty: WeightType,
    rows: usize,
    cols: usize,
    m: usize,
    threads: usize,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let data = random_matrix(&mut rng, ty, rows, cols);
    let w = QMatrix::new(ty, &data, rows, cols).unwrap();
    let x = random_acts(&mut rng, m * cols);
    let mut want = vec![0.0; m * rows];
    matmul_reference(&w, &x, m, &mut want);
    let mut got = vec![f32::NAN; m * rows];
    let mut scratch = MatmulScratch::new();
    matmul(&w, &x, m, &mut got, &mut scratch, &pool(threads));
    for (i, (g, r)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g.to_bits(),
            r.to_bits(),
            "{ty:?} {rows}x{cols} m={m} t={threads} [{i}]: {g} vs {r}"
        );
    }
}

#[test]
fn dispatching_matmul_is_bit_identical_to_reference() {
    for ty in TYPES {
        for (rows, cols) in [(1, 32), (5, 64), (13, 96), (64, 576), (37, 1536)] {
            for m in [1, 2, 3, 5, 8] {
                check_against_reference(ty, rows, cols, m, 2, rows as u64 * 31 + m as u64);
            }
        }
    }
}

#[test]
fn eight_row_tiles_over_long_rows_are_bit_identical_to_reference() {
    // 67 blocks per row: the AVX2 eight-row tile stages its scale products in chunks of 64
    // blocks, so this crosses a chunk boundary; m = 17 is two full tiles and a single row.
    for ty in TYPES {
        for m in [8, 17] {
            check_against_reference(ty, 6, 67 * 32, m, 2, 77 + m as u64);
        }
    }
}

#[test]
fn q5_matmul_is_bit_identical_to_reference_on_every_tile() {
    // Q5_0 and Q5_1 on the AVX2 tiles: odd row counts (decode tiles of 4 plus single rows,
    // uneven thread splits), every activation grouping (8-row tiles, 4/2/1 remainders) and
    // rows of 1, 3 and 67 blocks (the last crosses the 64-block scale chunk of the 8-row tile).
    for ty in [WeightType::Q5_0, WeightType::Q5_1] {
        for (rows, cols) in [(1, 32), (3, 96), (7, 96), (9, 67 * 32), (31, 96)] {
            for m in [1, 2, 3, 4, 5, 7, 8, 9, 15, 17] {
                for threads in [1, 3] {
                    let seed = rows as u64 * 131 + cols as u64 + m as u64 * 7 + threads as u64;
                    check_against_reference(ty, rows, cols, m, threads, seed);
                }
            }
        }
    }
}

/// `m × cols` activations of ±5 alternating by row and block: every one quantizes to ±127.
fn extreme_acts(m: usize, cols: usize) -> Vec<f32> {
    (0..m * cols)
        .map(|i| {
            if (i / cols + i / QK).is_multiple_of(2) {
                5.0
            } else {
                -5.0
            }
        })
        .collect()
}

#[test]
fn q5_products_at_the_extremes_match_reference() {
    // Every value at its largest (31; Q5_0: 15) or smallest (0; Q5_0: -16) against activations
    // that quantize to +127 / -127 (the largest `maddubs` pair sums, 2·31·127 and 2·16·127,
    // far from i16 saturation), with large scales and minimums of both signs.
    let (rows, cols) = (11, 128);
    for ty in [WeightType::Q5_0, WeightType::Q5_1] {
        for fill in [0xFFu8, 0x00] {
            let mut data = vec![fill; rows * ty.row_bytes(cols)];
            for (i, b) in data.chunks_exact_mut(ty.block_bytes()).enumerate() {
                b[0..2].copy_from_slice(&f16::from_f32(0.75).to_le_bytes());
                if ty == WeightType::Q5_1 {
                    let m = if i % 2 == 0 { -4.5 } else { 3.25 };
                    b[2..4].copy_from_slice(&f16::from_f32(m).to_le_bytes());
                }
            }
            let w = QMatrix::new(ty, &data, rows, cols).unwrap();
            for m in [1, 4, 8, 19] {
                let x = extreme_acts(m, cols);
                let mut want = vec![0.0; m * rows];
                matmul_reference(&w, &x, m, &mut want);
                let mut got = vec![f32::NAN; m * rows];
                matmul(&w, &x, m, &mut got, &mut MatmulScratch::new(), &pool(2));
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{ty:?} fill {fill:#x} m={m}");
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn q5_products_take_the_avx2_path_where_the_cpu_has_it() {
    // The bit-identity tests above compare the dispatching matmul with the scalar reference;
    // this makes sure the dispatcher really chose the AVX2 tiles (and block-major Q8_1 sums
    // for Q5_1) on a CPU that has them, so those tests are not scalar against scalar.
    let cpu_has_avx2 = is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
        && std::env::var_os("KVGATE_KERNELS_SCALAR").is_none();
    let (m, cols) = (3, 64);
    let x = random_acts(&mut StdRng::seed_from_u64(5), m * cols);
    for ty in [WeightType::Q5_0, WeightType::Q5_1] {
        let mut scratch = MatmulScratch::new();
        let path = prepare_acts(ty, &x, m, cols, &mut scratch);
        if cpu_has_avx2 {
            assert!(matches!(path, Path::Avx2(_)), "{ty:?} took {path:?}");
            let sums = ty == WeightType::Q5_1;
            assert_eq!(scratch.packed.layout(), (false, sums), "{ty:?}");
        } else {
            assert_eq!(path, Path::Scalar, "{ty:?}");
        }
    }
}

#[test]
fn k_quant_matmul_is_bit_identical_to_reference() {
    // Rows split unevenly over threads and decode tiles; m covers decode, small and tiled
    // prefill; 1, 2 and 6 super-blocks per row.
    for ty in K_TYPES {
        for (rows, cols) in [(1, 256), (13, 512), (37, 1536)] {
            for m in [1, 3, 8, 17] {
                for threads in [1, 3] {
                    check_against_reference(ty, rows, cols, m, threads, rows as u64 * 7 + m as u64);
                }
            }
        }
    }
}

#[test]
fn k_quant_orders_apply_per_activation_row() {
    // Mixed orders in one product (a step with prompt and decode rows): every row must equal
    // the reference in its own order, on the dispatching path (AVX2 where the CPU has it) as
    // on the scalar one; rows past the end of `orders` take vec_dot.
    let mut rng = StdRng::seed_from_u64(23);
    for ty in K_TYPES {
        let (rows, cols, m) = (21, 768, 11);
        let data = random_matrix(&mut rng, ty, rows, cols);
        let w = QMatrix::new(ty, &data, rows, cols).unwrap();
        let x = random_acts(&mut rng, m * cols);
        let orders: Vec<KQuantOrder> = (0..m - 2)
            .map(|i| {
                if i % 3 == 0 {
                    KQuantOrder::VecDot
                } else {
                    KQuantOrder::Tiled
                }
            })
            .collect();
        let mut tiled = vec![0.0; m * rows];
        matmul_reference_ordered(&w, &x, m, &[KQuantOrder::Tiled; 11], &mut tiled);
        let mut vec_dot = vec![0.0; m * rows];
        matmul_reference(&w, &x, m, &mut vec_dot);
        let mut reference = vec![0.0; m * rows];
        matmul_reference_ordered(&w, &x, m, &orders, &mut reference);
        let mut got = vec![0.0; m * rows];
        let mut scratch = MatmulScratch::new();
        matmul_ordered(&w, &x, m, &orders, &mut got, &mut scratch, &pool(3));
        let mut differ = 0;
        for a in 0..m {
            let want = match orders.get(a) {
                Some(KQuantOrder::Tiled) => &tiled,
                _ => &vec_dot,
            };
            let r = a * rows..(a + 1) * rows;
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&reference[r.clone()]),
                bits(&want[r.clone()]),
                "{ty:?} row {a}"
            );
            assert_eq!(
                bits(&got[r.clone()]),
                bits(&want[r.clone()]),
                "{ty:?} row {a}"
            );
            differ += usize::from(bits(&tiled[r.clone()]) != bits(&vec_dot[r]));
        }
        assert!(
            differ > 0,
            "{ty:?}: the orders never differ, the test proves nothing"
        );
    }
}

#[test]
fn k_quant_reference_approximates_float_product() {
    // Q8_K rounds each activation to 127 levels of its 256-block's largest magnitude; the
    // product is within Σ|w| · amax/254 of the f64 product of the dequantized weights.
    let mut rng = StdRng::seed_from_u64(22);
    let (rows, cols, m) = (9, 512, 2);
    for ty in K_TYPES {
        let data = random_matrix(&mut rng, ty, rows, cols);
        let w = QMatrix::new(ty, &data, rows, cols).unwrap();
        let x = random_acts(&mut rng, m * cols);
        let mut out = vec![0.0; m * rows];
        matmul_reference(&w, &x, m, &mut out);
        let mut wf = vec![0.0; cols];
        for r in 0..rows {
            dequantize_row(ty, w.row(r), &mut wf).unwrap();
            for a in 0..m {
                let xa = &x[a * cols..(a + 1) * cols];
                let exact: f64 = wf
                    .iter()
                    .zip(xa)
                    .map(|(&p, &q)| f64::from(p) * f64::from(q))
                    .sum();
                let bound: f64 =
                    wf.iter().map(|p| f64::from(p.abs())).sum::<f64>() * 8.0 / 254.0 + 1e-3;
                let got = f64::from(out[a * rows + r]);
                assert!(
                    (got - exact).abs() <= bound,
                    "{ty:?} r{r} a{a}: {got} vs {exact}"
                );
            }
        }
    }
}

#[test]
fn k_quant_rows_need_whole_super_blocks() {
    let data = vec![0u8; 144];
    assert!(matches!(
        QMatrix::new(WeightType::Q4_K, &data, 1, 128),
        Err(KernelError::ColsNotBlockMultiple { block: 256, .. })
    ));
    assert!(QMatrix::new(WeightType::Q4_K, &data, 1, 256).is_ok());
}

#[test]
fn q4_1_block_sums_at_the_extremes_do_not_saturate() {
    // The batched Q4_1 kernel adds eight `maddubs` results in 16 bits before widening; its
    // headroom argument (8 · 2 · 15 · 127 = 30 480 < 32 767) is checked here at the bound:
    // every nibble 15 against activations that all quantize to +127 or all to -127, in rows
    // long enough for several groups (m = 19) and for the decode tiles (m = 1).
    let (rows, cols) = (9, 128);
    let mut data = vec![0xFFu8; rows * WeightType::Q4_1.row_bytes(cols)];
    for b in data.chunks_exact_mut(WeightType::Q4_1.block_bytes()) {
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(-0.25).to_le_bytes());
    }
    let w = QMatrix::new(WeightType::Q4_1, &data, rows, cols).unwrap();
    for m in [1, 19] {
        let x: Vec<f32> = (0..m * cols)
            .map(|i| if (i / cols) % 2 == 0 { 3.0 } else { -3.0 })
            .collect();
        let mut want = vec![0.0; m * rows];
        matmul_reference(&w, &x, m, &mut want);
        let mut got = vec![f32::NAN; m * rows];
        matmul(&w, &x, m, &mut got, &mut MatmulScratch::new(), &pool(2));
        assert_eq!(got, want, "m={m}");
        // Exact value: per element (0.5·15 − 0.25)·(±3) = ±21.75, with 8-bit activations of
        // exactly ±127 · (3/127).
        for (i, v) in want.iter().enumerate() {
            let sign = if (i / rows) % 2 == 0 { 1.0 } else { -1.0 };
            assert!((v - sign * 21.75 * cols as f32).abs() < 0.5, "[{i}] {v}");
        }
    }
}

#[test]
fn thread_count_does_not_change_results() {
    for threads in [1, 3, 4] {
        check_against_reference(WeightType::Q4_1, 41, 128, 7, threads, 3);
        check_against_reference(WeightType::Q8_0, 9, 64, 1, threads, 4);
    }
}

#[test]
fn reference_approximates_float_product() {
    let mut rng = StdRng::seed_from_u64(21);
    let (rows, cols, m) = (16, 256, 3);
    for ty in TYPES {
        let data = random_matrix(&mut rng, ty, rows, cols);
        let w = QMatrix::new(ty, &data, rows, cols).unwrap();
        let x = random_acts(&mut rng, m * cols);
        let mut out = vec![0.0; m * rows];
        matmul_reference(&w, &x, m, &mut out);
        let mut wf = vec![0.0; cols];
        for r in 0..rows {
            dequantize_row(ty, w.row(r), &mut wf).unwrap();
            for a in 0..m {
                let xa = &x[a * cols..(a + 1) * cols];
                let exact: f64 = wf
                    .iter()
                    .zip(xa)
                    .map(|(&p, &q)| f64::from(p) * f64::from(q))
                    .sum();
                // Activation rounding: ≤ half a step of 127 levels per block (Σ|w|·amax/254).
                let bound: f64 = wf
                    .iter()
                    .zip(xa)
                    .map(|(&p, _)| f64::from(p.abs()))
                    .sum::<f64>()
                    * 8.0
                    / 254.0
                    + 1e-3;
                let got = f64::from(out[a * rows + r]);
                assert!(
                    (got - exact).abs() <= bound,
                    "{ty:?} r{r} a{a}: {got} vs {exact}"
                );
            }
        }
    }
}

#[test]
fn qmatrix_new_validates_shapes() {
    let data = vec![0u8; 2 * 20];
    assert!(QMatrix::new(WeightType::Q4_1, &data, 2, 32).is_ok());
    assert!(matches!(
        QMatrix::new(WeightType::Q4_1, &data, 3, 32),
        Err(KernelError::DataSize { .. })
    ));
    assert!(matches!(
        QMatrix::new(WeightType::Q4_1, &data, 1, 48),
        Err(KernelError::ColsNotBlockMultiple { .. })
    ));
    assert!(matches!(
        QMatrix::new(WeightType::Q8_0, &data, usize::MAX, 32),
        Err(KernelError::Overflow { .. })
    ));
}

#[test]
fn scratch_is_reused_across_shapes() {
    let mut rng = StdRng::seed_from_u64(2);
    let p = pool(2);
    let mut scratch = MatmulScratch::new();
    for (ty, rows, cols, m) in [
        (WeightType::Q4_1, 8, 64, 4),
        (WeightType::Q8_0, 3, 128, 1),
        (WeightType::Q4_1, 8, 64, 2),
    ] {
        let data = random_matrix(&mut rng, ty, rows, cols);
        let w = QMatrix::new(ty, &data, rows, cols).unwrap();
        let x = random_acts(&mut rng, m * cols);
        let (mut got, mut want) = (vec![0.0; m * rows], vec![0.0; m * rows]);
        matmul(&w, &x, m, &mut got, &mut scratch, &p);
        matmul_reference(&w, &x, m, &mut want);
        assert_eq!(got, want);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn random_shapes_match_reference(
        ty_index in 0usize..7, rows in 1usize..40, blocks in 1usize..6, m in 1usize..10, seed in any::<u64>()
    ) {
        check_against_reference(TYPES[ty_index], rows, blocks * QK, m, 2, seed);
    }
}

#[test]
fn fused_matmul_equals_separate_matmuls() {
    let mut rng = StdRng::seed_from_u64(77);
    let p = pool(2);
    let mut scratch = MatmulScratch::new();
    for ty in TYPES {
        for m in [1, 3, 9] {
            let cols = 96;
            // Row counts that split unevenly across threads and tiles.
            let shapes = [13, 4, 27];
            let data: Vec<Vec<u8>> = shapes
                .iter()
                .map(|&rows| random_matrix(&mut rng, ty, rows, cols))
                .collect();
            let ws: Vec<QMatrix> = data
                .iter()
                .zip(shapes)
                .map(|(d, rows)| QMatrix::new(ty, d, rows, cols).unwrap())
                .collect();
            let x = random_acts(&mut rng, m * cols);
            let mut fused: Vec<Vec<f32>> = shapes.iter().map(|&r| vec![f32::NAN; m * r]).collect();
            let [o0, o1, o2] = &mut fused[..] else {
                unreachable!()
            };
            matmul_fused(
                [
                    (&ws[0], &mut o0[..]),
                    (&ws[1], &mut o1[..]),
                    (&ws[2], &mut o2[..]),
                ],
                &x,
                m,
                &mut scratch,
                &p,
            );
            for (w, got) in ws.iter().zip(&fused) {
                let mut want = vec![0.0; m * w.rows];
                matmul_reference(w, &x, m, &mut want);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(got), bits(&want), "{ty:?} m={m} rows={}", w.rows);
            }
        }
    }
}

#[test]
fn fused_matmul_of_mixed_types_runs_each_part() {
    let mut rng = StdRng::seed_from_u64(78);
    let (cols, m) = (64, 2);
    let a = random_matrix(&mut rng, WeightType::Q4_1, 8, cols);
    let b = random_matrix(&mut rng, WeightType::Q8_0, 5, cols);
    let wa = QMatrix::new(WeightType::Q4_1, &a, 8, cols).unwrap();
    let wb = QMatrix::new(WeightType::Q8_0, &b, 5, cols).unwrap();
    let x = random_acts(&mut rng, m * cols);
    let (mut oa, mut ob) = (vec![0.0; m * 8], vec![0.0; m * 5]);
    let mut scratch = MatmulScratch::new();
    matmul_fused(
        [(&wa, &mut oa[..]), (&wb, &mut ob[..])],
        &x,
        m,
        &mut scratch,
        &pool(2),
    );
    let (mut ra, mut rb) = (vec![0.0; m * 8], vec![0.0; m * 5]);
    matmul_reference(&wa, &x, m, &mut ra);
    matmul_reference(&wb, &x, m, &mut rb);
    assert_eq!((oa, ob), (ra, rb));
}

/// `w × x` on `path`, forced (the dispatcher would pick one path per process), over all rows in
/// one call. `path` must use the activation packing that the dispatcher chooses for `w.ty`.
#[cfg(target_arch = "x86_64")]
fn matmul_on_path(path: Path, w: &QMatrix, x: &[f32], m: usize) -> Vec<f32> {
    let mut scratch = MatmulScratch::new();
    let chosen = prepare_acts(w.ty, x, m, w.cols, &mut scratch);
    assert!(
        matches!(chosen, Path::Avx2(_) | Path::Vnni(_)),
        "{chosen:?}"
    );
    let mut out = vec![f32::NAN; m * w.rows];
    compute_rows(
        path,
        w,
        x,
        m,
        &[],
        &scratch,
        0..w.rows,
        OutPtr::new(&mut out),
    );
    out
}

/// Whether this CPU has AVX512-VNNI (and AVX2): the VNNI kernels can run here.
#[cfg(target_arch = "x86_64")]
fn cpu_has_vnni() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
        && is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512vl")
        && is_x86_feature_detected!("avx512vnni")
}

/// `KVGATE_REQUIRE_VNNI=1`: a CPU without AVX512-VNNI (or a level capped below it) fails the
/// VNNI tests instead of running only the AVX2 half of them.
#[cfg(target_arch = "x86_64")]
fn vnni_required() -> bool {
    std::env::var("KVGATE_REQUIRE_VNNI").is_ok_and(|v| v == "1")
}

#[cfg(target_arch = "x86_64")]
#[test]
fn batched_q4_1_takes_the_vnni_path_where_the_cpu_has_it() {
    // The bit-identity tests compare the dispatching matmul with the scalar reference; this
    // makes sure that on a CPU with AVX512-VNNI the dispatcher chose the VNNI kernel for Q4_1
    // (and only for it), so those tests check it, and that every other CPU gets AVX2's.
    let level = crate::simd_level();
    let expect_vnni = cpu_has_vnni()
        && std::env::var_os("KVGATE_KERNELS_SCALAR").is_none()
        && std::env::var_os("KVGATE_KERNELS_AVX2").is_none();
    assert!(
        expect_vnni || !vnni_required(),
        "KVGATE_REQUIRE_VNNI=1 but the kernels run at {level:?}"
    );
    assert_eq!(
        level == crate::SimdLevel::Avx512Vnni,
        expect_vnni,
        "{level:?}"
    );
    let (m, cols) = (9, 64);
    let x = random_acts(&mut StdRng::seed_from_u64(6), m * cols);
    for ty in TYPES {
        let mut scratch = MatmulScratch::new();
        let path = prepare_acts(ty, &x, m, cols, &mut scratch);
        if !crate::avx2::supports(ty) || Avx2Fma::detect().is_none() {
            continue;
        }
        if expect_vnni && ty == WeightType::Q4_1 {
            assert!(matches!(path, Path::Vnni(_)), "{ty:?} took {path:?}");
            assert_eq!(scratch.packed.layout(), (true, true), "{ty:?}");
        } else {
            assert!(matches!(path, Path::Avx2(_)), "{ty:?} took {path:?}");
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn batched_q4_1_avx2_and_vnni_kernels_are_bit_identical_to_reference() {
    // Both batched Q4_1 kernels forced on one CPU (the dispatcher runs only the best one):
    // weight rows that end mid row-block, tiles of one to six activation groups (and, past six,
    // several tiles of balanced sizes: 7 groups as 4 + 3, 13 as 5 + 4 + 4), a partial last
    // group, rows of 1, 3, 18 (SmolLM2's width) and 67 blocks.
    let Some(avx2) = Avx2Fma::detect() else {
        return;
    };
    let vnni = Avx512Vnni::detect();
    assert!(
        vnni.is_some() || !vnni_required(),
        "KVGATE_REQUIRE_VNNI=1 but no VNNI"
    );
    for (rows, blocks) in [(1, 1), (17, 3), (33, 18), (5, 67)] {
        for m in [2, 7, 8, 9, 16, 17, 24, 33, 41, 49, 100] {
            let seed = rows as u64 * 1000 + blocks as u64 * QK as u64 + m as u64;
            check_q4_1_kernels(avx2, vnni, rows, blocks * QK, m, seed);
        }
    }
}

/// A random Q4_1 product on the forced AVX2 kernel and (given its token) the VNNI one, each
/// compared bit for bit with the scalar reference.
#[cfg(target_arch = "x86_64")]
fn check_q4_1_kernels(
    avx2: Avx2Fma,
    vnni: Option<Avx512Vnni>,
    rows: usize,
    cols: usize,
    m: usize,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    let data = random_matrix(&mut rng, WeightType::Q4_1, rows, cols);
    let w = QMatrix::new(WeightType::Q4_1, &data, rows, cols).unwrap();
    let x = random_acts(&mut rng, m * cols);
    let mut want = vec![0.0; m * rows];
    matmul_reference(&w, &x, m, &mut want);
    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    let got = matmul_on_path(Path::Avx2(avx2), &w, &x, m);
    assert_eq!(bits(&got), bits(&want), "AVX2 {rows}x{cols} m={m}");
    if let Some(vnni) = vnni {
        let got = matmul_on_path(Path::Vnni(vnni), &w, &x, m);
        assert_eq!(bits(&got), bits(&want), "VNNI {rows}x{cols} m={m}");
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn batched_q4_1_kernels_at_the_extremes_match_reference() {
    // Every nibble 15 (or 0) against activations of ±127, large scales, mins of both signs:
    // the largest block sums, on both forced kernels.
    let Some(avx2) = Avx2Fma::detect() else {
        return;
    };
    let (rows, cols) = (9, 128);
    for fill in [0xFFu8, 0x00] {
        let mut data = vec![fill; rows * WeightType::Q4_1.row_bytes(cols)];
        for (i, b) in data
            .chunks_exact_mut(WeightType::Q4_1.block_bytes())
            .enumerate()
        {
            b[0..2].copy_from_slice(&f16::from_f32(0.75).to_le_bytes());
            let mw = if i % 2 == 0 { -4.5 } else { 3.25 };
            b[2..4].copy_from_slice(&f16::from_f32(mw).to_le_bytes());
        }
        let w = QMatrix::new(WeightType::Q4_1, &data, rows, cols).unwrap();
        for m in [2, 8, 19] {
            let x = extreme_acts(m, cols);
            let mut want = vec![0.0; m * rows];
            matmul_reference(&w, &x, m, &mut want);
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            let got = matmul_on_path(Path::Avx2(avx2), &w, &x, m);
            assert_eq!(bits(&got), bits(&want), "AVX2 fill {fill:#x} m={m}");
            if let Some(vnni) = Avx512Vnni::detect() {
                let got = matmul_on_path(Path::Vnni(vnni), &w, &x, m);
                assert_eq!(bits(&got), bits(&want), "VNNI fill {fill:#x} m={m}");
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]
    #[test]
    fn batched_q4_1_kernels_on_random_shapes_match_reference(
        rows in 1usize..40, blocks in 1usize..8, m in 2usize..30, seed in any::<u64>()
    ) {
        if let Some(avx2) = Avx2Fma::detect() {
            check_q4_1_kernels(avx2, Avx512Vnni::detect(), rows, blocks * QK, m, seed);
        }
    }
}
