//! CI's execution check, no GPU needed: every CUDA kernel runs on the CPU from the same `.cu`
//! source, compiled by g++ with the emulation layer in `kernels/cuda/emu/emu.h` (a fiber per
//! CUDA thread, `__syncthreads` as a barrier, shuffles through a per-warp exchange), and
//! is compared with this crate's CPU kernels on random inputs. Outputs are poisoned before each
//! launch (NaN), sizes are odd on purpose (rows not a multiple of the rows per block, contexts
//! not a multiple of the block size, several partitions, GQA groups, scattered block ids).

use super::{
    ARGMAX_THREADS, ATTN_HEAD_DIMS, ATTN_THREADS, KV_BLOCK, MMF_COLS, MMF_ROWS, MMF_SMEM_BYTES,
    MMF_THREADS, MMQ_COLS, MMQ_ROWS, MMQ_SMEM_BYTES, MMQ_THREADS, MV_MAX_BATCH, MV_ROWS_PER_BLOCK,
    MV_THREADS, NORM_THREADS, attention_partitions, attention_smem_bytes, attention_tile_rows,
    attention_tiled_smem_bytes,
};
use crate::attention::{KvLayout, ReductionOrder, paged_attention_reference, write_kv};
use crate::matmul::tests::random_matrix;
use crate::matmul::{QMatrix, matmul_reference};
use crate::ops::{RopeMode, rms_norm, rope, swiglu_reference};
use crate::quant::{
    Q8_K_BLOCK_BYTES, QK_K, WeightType, dequantize_row, quantize_row_q8_1, quantize_row_q8_k,
};
use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::sync::OnceLock;

mod kernels;
use kernels::Emu;

/// The launch geometry, as `emu::Launch` in emu.h.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct Launch {
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u64,
}

impl Launch {
    fn new(grid: [u32; 3], threads: u32, shared_bytes: usize) -> Launch {
        Launch {
            grid,
            block: [threads, 1, 1],
            shared_bytes: shared_bytes as u64,
        }
    }
}

/// The emulated kernels, built once per test process (and cached on disk by source hash).
fn emu() -> &'static Emu {
    static EMU: OnceLock<Emu> = OnceLock::new();
    EMU.get_or_init(|| {
        Emu::load(&super::emu_device::build_library().unwrap_or_else(|e| panic!("{e}")))
    })
}

/// A 16-byte aligned buffer (device allocations are 256-byte aligned; the kernels' 16-byte
/// loads rely on it).
struct Buf<T: Copy> {
    storage: Vec<u128>,
    len: usize,
    _t: std::marker::PhantomData<T>,
}

impl<T: Copy> Buf<T> {
    fn of(values: &[T]) -> Self {
        let bytes = std::mem::size_of_val(values);
        let mut storage = vec![0u128; bytes.div_ceil(16).max(1)];
        // SAFETY: storage holds at least `bytes` bytes; T is Copy (plain data in these tests).
        unsafe {
            std::ptr::copy_nonoverlapping(
                values.as_ptr().cast::<u8>(),
                storage.as_mut_ptr().cast::<u8>(),
                bytes,
            );
        }
        Buf {
            storage,
            len: values.len(),
            _t: std::marker::PhantomData,
        }
    }

    fn ptr(&self) -> *const T {
        self.storage.as_ptr().cast()
    }

    fn mut_ptr(&mut self) -> *mut T {
        self.storage.as_mut_ptr().cast()
    }

    fn to_vec(&self) -> Vec<T> {
        // SAFETY: the storage holds `len` initialised values of T.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.len).to_vec() }
    }
}

/// An output buffer of `n` floats, every one NaN, so an element the kernel skips fails.
fn poisoned(n: usize) -> Buf<f32> {
    Buf::of(&vec![f32::NAN; n])
}

fn random(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// Asserts |a - b| <= tol * max(1, max|b|) element-wise, naming the first bad index.
#[track_caller]
fn assert_close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(1.0f32, |m, v| m.max(v.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * scale,
            "{what}: element {i}: got {g}, want {w} (tolerance {})",
            tol * scale
        );
    }
}

#[test]
fn rms_norm_matches_cpu() {
    let mut rng = StdRng::seed_from_u64(1);
    let (rows, n) = (3, 203);
    let x = random(&mut rng, rows * n, 2.0);
    let w = random(&mut rng, n, 1.5);
    let mut out = poisoned(rows * n);
    let (xb, wb) = (Buf::of(&x), Buf::of(&w));
    emu().rms_norm(
        Launch::new([rows as u32, 1, 1], NORM_THREADS, 0),
        out.mut_ptr(),
        xb.ptr(),
        wb.ptr(),
        n as i32,
        1e-5,
    );
    let mut want = vec![0f32; rows * n];
    for (xr, wr) in x.chunks(n).zip(want.chunks_mut(n)) {
        rms_norm(xr, &w, 1e-5, wr);
    }
    assert_close("rms_norm", &out.to_vec(), &want, 1e-6);
}

#[test]
fn rope_norm_matches_cpu_at_large_positions() {
    let mut rng = StdRng::seed_from_u64(2);
    let (n_heads, head_dim) = (3, 64);
    let positions = [0i32, 1, 17, 300, 4095];
    let x = random(&mut rng, positions.len() * n_heads * head_dim, 1.0);
    let mut got = Buf::of(&x);
    let pos = Buf::of(&positions);
    emu().rope_norm(
        Launch::new([positions.len() as u32, 1, 1], 64, 0),
        got.mut_ptr(),
        pos.ptr(),
        n_heads as i32,
        head_dim as i32,
        head_dim as i32,
        10_000.0,
    );
    let mut want = x.clone();
    for (t, &p) in positions.iter().enumerate() {
        let row = &mut want[t * n_heads * head_dim..(t + 1) * n_heads * head_dim];
        rope(row, n_heads, head_dim, p as u32, 10_000.0, RopeMode::Norm);
    }
    // Same angles (cumulative theta in f32); cos/sin of large angles may differ in an ulp.
    assert_close("rope", &got.to_vec(), &want, 2e-5);
}

#[test]
fn swiglu_and_residual_add_match_cpu() {
    let mut rng = StdRng::seed_from_u64(3);
    let n = 1001;
    let gate = random(&mut rng, n, 8.0);
    let up = random(&mut rng, n, 2.0);
    let (gb, ub) = (Buf::of(&gate), Buf::of(&up));
    let mut out = poisoned(n);
    // Fewer threads than elements: the grid-stride loops must cover the tail.
    emu().swiglu(
        Launch::new([2, 1, 1], 64, 0),
        out.mut_ptr(),
        gb.ptr(),
        ub.ptr(),
        n as i64,
    );
    let mut want = vec![0f32; n];
    swiglu_reference(&gate, &up, &mut want);
    assert_close("swiglu", &out.to_vec(), &want, 1e-6);

    let mut x = Buf::of(&gate);
    emu().add_inplace(
        Launch::new([3, 1, 1], 32, 0),
        x.mut_ptr(),
        ub.ptr(),
        n as i64,
    );
    let sum: Vec<f32> = gate.iter().zip(&up).map(|(a, b)| a + b).collect();
    assert_eq!(x.to_vec(), sum);
}

fn ggml_id(ty: WeightType) -> i32 {
    super::ggml_type_id(ty).expect("a type the kernels read")
}

/// The types in 32-element blocks (and the float types) the kernels read.
const ALL_TYPES: [WeightType; 7] = [
    WeightType::F32,
    WeightType::F16,
    WeightType::Q4_0,
    WeightType::Q4_1,
    WeightType::Q5_0,
    WeightType::Q5_1,
    WeightType::Q8_0,
];

/// The K-quants (256-element super-blocks).
const K_TYPES: [WeightType; 3] = [WeightType::Q4_K, WeightType::Q5_K, WeightType::Q6_K];

#[test]
fn embedding_and_f16_dequantization_match_cpu_dequantize() {
    let mut rng = StdRng::seed_from_u64(4);
    let vocab = 11;
    // K-quant rows are whole 256-element super-blocks: two of them.
    let cases = ALL_TYPES.map(|ty| (ty, 96)).into_iter();
    for (ty, cols) in cases.chain(K_TYPES.map(|ty| (ty, 512))) {
        let table = random_matrix(&mut rng, ty, vocab, cols);
        let row_bytes = ty.row_bytes(cols);
        let ids = [3i32, 0, 10, 3];
        let (tb, ib) = (Buf::of(&table), Buf::of(&ids));
        let mut out = poisoned(ids.len() * cols);
        emu().embed_rows(
            Launch::new([ids.len() as u32, 1, 1], 64, 0),
            out.mut_ptr(),
            tb.ptr(),
            ib.ptr(),
            ggml_id(ty),
            cols as i32,
            row_bytes as i64,
        );
        let mut want = vec![0f32; ids.len() * cols];
        for (&id, w) in ids.iter().zip(want.chunks_mut(cols)) {
            let row = &table[id as usize * row_bytes..(id as usize + 1) * row_bytes];
            dequantize_row(ty, row, w).expect("valid row");
        }
        assert_eq!(out.to_vec(), want, "{ty:?} embedding");

        let mut f16_out = Buf::of(&vec![0xFFFFu16; vocab * cols]);
        emu().dequantize_f16(
            Launch::new([3, 1, 1], 128, 0),
            f16_out.mut_ptr(),
            tb.ptr(),
            ggml_id(ty),
            cols as i32,
            row_bytes as i64,
            (vocab * cols) as i64,
        );
        let mut all = vec![0f32; vocab * cols];
        for (row, w) in table.chunks(row_bytes).zip(all.chunks_mut(cols)) {
            dequantize_row(ty, row, w).expect("valid row");
        }
        let want: Vec<u16> = all.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
        assert_eq!(f16_out.to_vec(), want, "{ty:?} to f16");
    }
}

#[test]
fn argmax_takes_the_lowest_index_of_the_maximum_and_skips_nan() {
    let vocab = 1000;
    let mut rows = vec![0f32; 4 * vocab];
    rows[17] = 5.0;
    rows[900] = 5.0; // tie: 17 wins
    rows[vocab + 999] = 1.0; // the last element
    rows[vocab] = f32::NAN;
    rows[2 * vocab..3 * vocab].fill(f32::NEG_INFINITY);
    rows[3 * vocab..].fill(f32::NAN);
    rows[3 * vocab + 513] = -7.0;
    let rb = Buf::of(&rows);
    let mut out = Buf::of(&[-1i32; 4]);
    emu().argmax_rows(
        Launch::new([4, 1, 1], ARGMAX_THREADS, 0),
        out.mut_ptr(),
        rb.ptr(),
        vocab as i32,
    );
    assert_eq!(out.to_vec(), [17, 999, 0, 513]);
}

#[test]
fn q8_1_quantization_is_bit_identical_to_cpu() {
    let mut rng = StdRng::seed_from_u64(5);
    let blocks = 13;
    let mut x = random(&mut rng, blocks * 32, 3.0);
    x[32..64].fill(0.0); // an all-zero block: d = 0, no division by zero
    x[70] = 127.0 * 0.5; // exact halves exercise round-half-to-even
    let xb = Buf::of(&x);
    let mut out = Buf::of(&vec![0xAAu8; blocks * 36]);
    // 4 warps per block and 13 blocks: the last CUDA block has idle warps.
    emu().quantize_q8_1(
        Launch::new([4, 1, 1], 128, 0),
        out.mut_ptr(),
        xb.ptr(),
        blocks as i64,
    );
    let mut want = vec![0u8; blocks * 36];
    quantize_row_q8_1(&x, &mut want);
    assert_eq!(out.to_vec(), want);
}

#[test]
fn quantized_matvec_matches_cpu_matmul_for_every_type_and_batch() {
    let mut rng = StdRng::seed_from_u64(6);
    // 37 rows: the last block has one busy warp; 96 columns: fewer blocks than lanes;
    // 1088 columns: lanes wrap around the row's 34 blocks.
    for (rows, cols) in [(37usize, 96usize), (9, 1088)] {
        for ty in [
            WeightType::Q4_0,
            WeightType::Q4_1,
            WeightType::Q5_0,
            WeightType::Q5_1,
            WeightType::Q8_0,
            WeightType::F16,
        ] {
            let w = random_matrix(&mut rng, ty, rows, cols);
            let wb = Buf::of(&w);
            for batch in [1usize, 3, MV_MAX_BATCH] {
                let x = random(&mut rng, batch * cols, 1.0);
                let out = emu_matvec(ty, &wb, &Buf::of(&x), rows, cols, batch);
                let mut want = vec![0f32; batch * rows];
                let m = QMatrix::new(ty, &w, rows, cols).expect("valid matrix");
                matmul_reference(&m, &x, batch, &mut want);
                assert_close(
                    &format!("{ty:?} {rows}x{cols} batch {batch}"),
                    &out.to_vec(),
                    &want,
                    1e-5,
                );
            }
        }
    }
}

/// Per (activation row, weight row), in f64: `Σ dequantize(w) · dequantize(Q8_1(x))`, what the
/// K-quant matvec kernels compute, exactly but for their f32 roundings; and a bound on how far
/// the CPU's product (x quantized to Q8_K instead) can be from it: `Σ |w| · (e₁ + e_K)` with
/// `e` the largest rounding error of an activation in each format (0.6 of its step: half a
/// step, plus Q8_1's f16 scale rounding of at most 127 · 2⁻¹¹ steps). The weights go through
/// the CPU's dequantization (checked bit for bit against the `gguf` package), the activations
/// through the CPU's quantizers (Q8_1's bit-identical to `quantize_q8_1`).
fn q8_1_exact_products(
    ty: WeightType,
    w: &[u8],
    x: &[f32],
    rows: usize,
    cols: usize,
) -> (Vec<f32>, Vec<f32>) {
    let mut xq = vec![0u8; x.len() / 32 * 36];
    quantize_row_q8_1(x, &mut xq);
    let mut xk = vec![0u8; x.len() / QK_K * Q8_K_BLOCK_BYTES];
    quantize_row_q8_k(x, &mut xk);
    let mut xd = Vec::with_capacity(x.len());
    let mut err = Vec::with_capacity(x.len());
    for (e, b) in xq.chunks_exact(36).enumerate() {
        let d = f64::from(f16::from_le_bytes([b[0], b[1]]).to_f32());
        let kb = &xk[e * 32 / QK_K * Q8_K_BLOCK_BYTES..];
        let dk = f64::from(f32::from_le_bytes([kb[0], kb[1], kb[2], kb[3]]).abs());
        for &q in &b[4..] {
            xd.push(d * f64::from(q as i8));
            err.push(0.6 * (d + dk));
        }
    }
    let row_bytes = ty.row_bytes(cols);
    let mut wd = vec![0f32; rows * cols];
    for (wr, out) in w.chunks_exact(row_bytes).zip(wd.chunks_exact_mut(cols)) {
        dequantize_row(ty, wr, out).expect("valid row");
    }
    let (mut exact, mut bound) = (Vec::new(), Vec::new());
    for (xr, er) in xd.chunks_exact(cols).zip(err.chunks_exact(cols)) {
        for wr in wd.chunks_exact(cols) {
            let dot: f64 = wr.iter().zip(xr).map(|(&a, &b)| f64::from(a) * b).sum();
            let b: f64 = wr
                .iter()
                .zip(er)
                .map(|(&a, &e)| f64::from(a).abs() * e)
                .sum();
            exact.push(dot as f32);
            bound.push(b as f32);
        }
    }
    (exact, bound)
}

#[test]
fn k_quant_matvec_matches_the_exact_q8_1_product_and_the_cpu_matmul() {
    let mut rng = StdRng::seed_from_u64(16);
    // 13 rows: the last CUDA block has one busy warp. 256 columns: 8 sub-blocks, so 24 lanes
    // idle; 1280: 40 sub-blocks over 32 lanes, so lanes wrap into the fifth super-block.
    for (rows, cols) in [(13usize, 256usize), (6, 1280)] {
        for ty in K_TYPES {
            let w = random_matrix(&mut rng, ty, rows, cols);
            let wb = Buf::of(&w);
            for batch in [1usize, 3, MV_MAX_BATCH] {
                let x = random(&mut rng, batch * cols, 1.0);
                let got = emu_matvec(ty, &wb, &Buf::of(&x), rows, cols, batch).to_vec();
                let what = format!("{ty:?} {rows}x{cols} batch {batch}");
                // The kernel's own arithmetic: integer sums per sub-block, f32 across them.
                let (exact, bound) = q8_1_exact_products(ty, &w, &x, rows, cols);
                assert_close(&format!("{what} vs exact"), &got, &exact, 1e-5);
                // The CPU backend's product quantizes x to Q8_K (one scale per 256 values)
                // instead of Q8_1 (one per 32): the same product up to activation rounding.
                let mut cpu = vec![0f32; batch * rows];
                let m = QMatrix::new(ty, &w, rows, cols).expect("valid matrix");
                matmul_reference(&m, &x, batch, &mut cpu);
                let scale = cpu.iter().fold(1.0f32, |a, v| a.max(v.abs()));
                for (i, ((g, c), b)) in got.iter().zip(&cpu).zip(&bound).enumerate() {
                    assert!(
                        (g - c).abs() <= b + 1e-5 * scale,
                        "{what} vs CPU (Q8_K): element {i}: got {g}, CPU {c}, bound {b}"
                    );
                }
            }
        }
    }
}

/// The emulated launch of a quantized weight type's matvec kernel (`out`, `w`, Q8_1 `x`,
/// rows, cols, batch).
type QuantizedLaunch = fn(&Emu, Launch, *mut f32, *const u8, *const u8, i32, i32, i32);

/// The matvec kernel of a quantized weight type.
fn quantized_matvec(ty: WeightType) -> QuantizedLaunch {
    match ty {
        WeightType::Q4_0 => Emu::matvec_q4_0,
        WeightType::Q4_1 => Emu::matvec_q4_1,
        WeightType::Q5_0 => Emu::matvec_q5_0,
        WeightType::Q5_1 => Emu::matvec_q5_1,
        WeightType::Q8_0 => Emu::matvec_q8_0,
        WeightType::Q4_K => Emu::matvec_q4_k,
        WeightType::Q5_K => Emu::matvec_q5_k,
        WeightType::Q6_K => Emu::matvec_q6_k,
        other => panic!("no matvec kernel for {other:?}"),
    }
}

/// `x` (`m` rows of `cols`) quantized to Q8_1 on the emulated device.
fn emu_quantize_q8_1(x: &Buf<f32>, m: usize, cols: usize) -> Buf<u8> {
    let blocks = m * cols / 32;
    let mut xq = Buf::of(&vec![0u8; blocks * 36]);
    emu().quantize_q8_1(
        Launch::new([blocks.div_ceil(4) as u32, 1, 1], 128, 0),
        xq.mut_ptr(),
        x.ptr(),
        blocks as i64,
    );
    xq
}

/// `out = x · Wᵀ` for `m` Q8_1 activation rows through the matvec kernel, in launches of at
/// most `MV_MAX_BATCH` rows at offsets into `xq` and `out`, as the CUDA step ran every batch
/// before the tiled kernel.
fn emu_matvec_chunked(
    ty: WeightType,
    w: &Buf<u8>,
    xq: &Buf<u8>,
    rows: usize,
    cols: usize,
    m: usize,
) -> Vec<f32> {
    let matvec = quantized_matvec(ty);
    let mut out = poisoned(m * rows);
    let launch = Launch::new(
        [rows.div_ceil(MV_ROWS_PER_BLOCK) as u32, 1, 1],
        MV_THREADS,
        0,
    );
    for start in (0..m).step_by(MV_MAX_BATCH) {
        let batch = MV_MAX_BATCH.min(m - start);
        // SAFETY: `start` < m, so both offsets stay inside buffers of m rows.
        let (o, x) = unsafe {
            (
                out.mut_ptr().add(start * rows),
                xq.ptr().add(start * cols / 32 * 36),
            )
        };
        matvec(
            emu(),
            launch,
            o,
            w.ptr(),
            x,
            rows as i32,
            cols as i32,
            batch as i32,
        );
    }
    out.to_vec()
}

/// `out = x · Wᵀ` for `m` Q8_1 activation rows through the tiled kernel, in one launch.
fn emu_mmq(
    ty: WeightType,
    w: &Buf<u8>,
    xq: &Buf<u8>,
    rows: usize,
    cols: usize,
    m: usize,
) -> Vec<f32> {
    let mmq = match ty {
        WeightType::Q4_0 => Emu::mmq_q4_0,
        WeightType::Q4_1 => Emu::mmq_q4_1,
        WeightType::Q5_0 => Emu::mmq_q5_0,
        WeightType::Q5_1 => Emu::mmq_q5_1,
        WeightType::Q8_0 => Emu::mmq_q8_0,
        WeightType::Q4_K => Emu::mmq_q4_k,
        WeightType::Q5_K => Emu::mmq_q5_k,
        WeightType::Q6_K => Emu::mmq_q6_k,
        other => panic!("no tiled kernel for {other:?}"),
    };
    let mut out = poisoned(m * rows);
    mmq(
        emu(),
        Launch::new(
            [
                rows.div_ceil(MMQ_ROWS) as u32,
                m.div_ceil(MMQ_COLS) as u32,
                1,
            ],
            MMQ_THREADS,
            MMQ_SMEM_BYTES,
        ),
        out.mut_ptr(),
        w.ptr(),
        xq.ptr(),
        rows as i32,
        cols as i32,
        m as i32,
    );
    out.to_vec()
}

/// Asserts the tiled kernel's outputs are the matvec kernel's, bit for bit (batch invariance:
/// the CUDA step picks one or the other by step size), and none is left poisoned.
#[track_caller]
fn assert_bit_identical(what: &str, tiled: &[f32], matvec: &[f32]) {
    assert_eq!(tiled.len(), matvec.len(), "{what}: length");
    for (i, (t, m)) in tiled.iter().zip(matvec).enumerate() {
        assert!(
            t.is_finite() && t.to_bits() == m.to_bits(),
            "{what}: element {i}: tiled {t:e} ({:#010x}), matvec {m:e} ({:#010x})",
            t.to_bits(),
            m.to_bits()
        );
    }
}

#[test]
fn tiled_matmul_is_bit_identical_to_matvec_and_matches_cpu_for_32_element_types() {
    let mut rng = StdRng::seed_from_u64(17);
    // 17 rows: two row tiles of 16, the second with one row (one warp with one valid row of
    // its two, seven idle warps); 1088 columns: 34 blocks, a full 32-block stage and a 2-block
    // one; 96 columns: 3 blocks, one partial stage. Batches: one row over the matvec's 8, a
    // partial second matvec chunk, two tiles with the second partial, two full activation
    // tiles, a partial last tile.
    const BATCHES: &[usize] = &[9, 17, 40, 64, 100];
    let cases = [
        (WeightType::Q4_0, 17usize, 1088usize, BATCHES),
        (WeightType::Q8_0, 17, 1088, BATCHES),
        (WeightType::Q4_1, 17, 1088, BATCHES),
        (WeightType::Q5_0, 17, 1088, BATCHES),
        (WeightType::Q5_1, 17, 1088, BATCHES),
        (WeightType::Q4_1, 20, 96, &[33][..]),
    ];
    for (ty, rows, cols, batches) in cases {
        let w = random_matrix(&mut rng, ty, rows, cols);
        let wb = Buf::of(&w);
        let m = QMatrix::new(ty, &w, rows, cols).expect("valid matrix");
        for &batch in batches {
            let what = format!("{ty:?} {rows}x{cols} batch {batch}");
            let x = random(&mut rng, batch * cols, 1.0);
            let xq = emu_quantize_q8_1(&Buf::of(&x), batch, cols);
            let tiled = emu_mmq(ty, &wb, &xq, rows, cols, batch);
            let matvec = emu_matvec_chunked(ty, &wb, &xq, rows, cols, batch);
            assert_bit_identical(&what, &tiled, &matvec);
            let mut want = vec![0f32; batch * rows];
            matmul_reference(&m, &x, batch, &mut want);
            assert_close(&format!("{what} vs CPU"), &tiled, &want, 1e-5);
        }
    }
}

#[test]
fn tiled_matmul_is_bit_identical_to_matvec_and_matches_exact_products_for_k_quants() {
    let mut rng = StdRng::seed_from_u64(18);
    // 1280 columns: 40 sub-blocks, a 32-sub-block stage (four super-blocks) and an 8-sub-block
    // one (the fifth); 19 rows: a partial second row tile.
    let (rows, cols) = (19usize, 1280usize);
    for ty in K_TYPES {
        let w = random_matrix(&mut rng, ty, rows, cols);
        let wb = Buf::of(&w);
        for batch in [9usize, 40, 100] {
            let what = format!("{ty:?} {rows}x{cols} batch {batch}");
            let x = random(&mut rng, batch * cols, 1.0);
            let xq = emu_quantize_q8_1(&Buf::of(&x), batch, cols);
            let tiled = emu_mmq(ty, &wb, &xq, rows, cols, batch);
            let matvec = emu_matvec_chunked(ty, &wb, &xq, rows, cols, batch);
            assert_bit_identical(&what, &tiled, &matvec);
            // The kernels' own arithmetic: integer sums per sub-block, f32 across them (the
            // CPU path quantizes x to Q8_K instead; that comparison is the matvec test's).
            let (exact, _) = q8_1_exact_products(ty, &w, &x, rows, cols);
            assert_close(&format!("{what} vs exact"), &tiled, &exact, 1e-5);
        }
    }
}

/// `out = x · Wᵀ` for `m` f32 activation rows and F16 weights through `matvec_f16`, in launches
/// of at most `MV_MAX_BATCH` rows at offsets into `x` and `out` (the CUDA step's small steps).
fn emu_matvec_f16_chunked(
    w: &Buf<u16>,
    x: &Buf<f32>,
    rows: usize,
    cols: usize,
    m: usize,
) -> Vec<f32> {
    let mut out = poisoned(m * rows);
    let launch = Launch::new(
        [rows.div_ceil(MV_ROWS_PER_BLOCK) as u32, 1, 1],
        MV_THREADS,
        0,
    );
    for start in (0..m).step_by(MV_MAX_BATCH) {
        let batch = MV_MAX_BATCH.min(m - start);
        // SAFETY: `start` < m, so both offsets stay inside buffers of m rows.
        let (o, xs) = unsafe { (out.mut_ptr().add(start * rows), x.ptr().add(start * cols)) };
        emu().matvec_f16(
            launch,
            o,
            w.ptr(),
            xs,
            rows as i32,
            cols as i32,
            batch as i32,
        );
    }
    out.to_vec()
}

/// `out = x · Wᵀ` for `m` f32 activation rows and F16 weights through `mm_f16`, one launch.
fn emu_mm_f16(w: &Buf<u16>, x: &Buf<f32>, rows: usize, cols: usize, m: usize) -> Vec<f32> {
    let mut out = poisoned(m * rows);
    emu().mm_f16(
        Launch::new(
            [
                rows.div_ceil(MMF_ROWS) as u32,
                m.div_ceil(MMF_COLS) as u32,
                1,
            ],
            MMF_THREADS,
            MMF_SMEM_BYTES,
        ),
        out.mut_ptr(),
        w.ptr(),
        x.ptr(),
        rows as i32,
        cols as i32,
        m as i32,
    );
    out.to_vec()
}

#[test]
fn tiled_f16_matmul_is_bit_identical_to_matvec_f16_and_matches_a_plain_reference() {
    let mut rng = StdRng::seed_from_u64(19);
    // 17 rows: two row tiles of 16, the second with one row (one warp with one valid row of
    // its two, seven idle warps); 1088 columns: eight full 128-column stages and a 64-column
    // one (two steps of four a lane); 96: one partial stage (three steps); 100: not a multiple
    // of 32 (lanes 0..3 take a fourth column, the others three; the loader never passes such
    // rows, the kernel still handles them). The real models' widths 576 .. 13824 (partial last
    // stages at 576, 5120, 11008, 13824) with few rows to keep the emulator fast. Batches: one
    // row over the matvec's 8, a partial second matvec chunk, two activation tiles with the
    // second partial, two full tiles, a partial last tile.
    const BATCHES: &[usize] = &[9, 17, 40, 64, 100];
    let cases: &[(usize, usize, &[usize])] = &[
        (17, 1088, BATCHES),
        (37, 96, &[33]),
        (20, 100, &[9, 40]),
        (5, 576, &[40]),
        (3, 1536, &[17]),
        (2, 4096, &[33]),
        (2, 5120, &[64]),
        (1, 11008, &[17]),
        (1, 13824, &[40]),
    ];
    for &(rows, cols, batches) in cases {
        let w = random_matrix(&mut rng, WeightType::F16, rows, cols);
        let bits: Vec<u16> = w
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        let wb = Buf::of(&bits);
        let wf: Vec<f64> = bits
            .iter()
            .map(|&b| f64::from(f16::from_bits(b).to_f32()))
            .collect();
        for &batch in batches {
            let what = format!("F16 {rows}x{cols} batch {batch}");
            let x = random(&mut rng, batch * cols, 1.0);
            let xb = Buf::of(&x);
            let tiled = emu_mm_f16(&wb, &xb, rows, cols, batch);
            let matvec = emu_matvec_f16_chunked(&wb, &xb, rows, cols, batch);
            assert_bit_identical(&what, &tiled, &matvec);
            // The same math in f64: f16 weights times activations rounded to f16.
            let want: Vec<f32> = x
                .chunks_exact(cols)
                .flat_map(|xr| {
                    wf.chunks_exact(cols).map(move |wr| {
                        let dot: f64 = wr
                            .iter()
                            .zip(xr)
                            .map(|(&a, &b)| a * f64::from(f16::from_f32(b).to_f32()))
                            .sum();
                        dot as f32
                    })
                })
                .collect();
            assert_close(&format!("{what} vs f64"), &tiled, &want, 1e-5);
        }
    }
}

#[test]
fn kv_write_fills_exactly_the_mapped_slots() {
    let mut rng = StdRng::seed_from_u64(7);
    let (n_kv_heads, head_dim, num_blocks) = (3, 32, 5);
    let slots = [17i32, 0, 79, -1, 40, 41];
    let width = n_kv_heads * head_dim;
    let k = random(&mut rng, slots.len() * width, 2.0);
    let v = random(&mut rng, slots.len() * width, 2.0);
    let cache_len = num_blocks * KV_BLOCK * width;
    let poison = 0x7E00u16; // an f16 NaN
    let mut kc = Buf::of(&vec![poison; cache_len]);
    let mut vc = Buf::of(&vec![poison; cache_len]);
    let (kb, vb, sb) = (Buf::of(&k), Buf::of(&v), Buf::of(&slots));
    emu().write_kv(
        Launch::new([slots.len() as u32, 1, 1], 64, 0),
        kc.mut_ptr(),
        vc.mut_ptr(),
        kb.ptr(),
        vb.ptr(),
        sb.ptr(),
        n_kv_heads as i32,
        head_dim as i32,
    );
    // The CPU cache ([slot][head][dim]) written by the CPU kernel, then laid out as the
    // device's [block][head][slot][dim].
    let layout = KvLayout {
        block_size: KV_BLOCK,
        num_kv_heads: n_kv_heads,
        head_dim,
    };
    let nan = f16::from_bits(poison);
    let (mut kw, mut vw) = (vec![nan; cache_len], vec![nan; cache_len]);
    for (t, &slot) in slots.iter().enumerate() {
        if slot >= 0 {
            let r = t * width..(t + 1) * width;
            write_kv(
                &layout,
                &mut kw,
                &mut vw,
                slot as usize,
                &k[r.clone()],
                &v[r],
            );
        }
    }
    assert_eq!(kc.to_vec(), to_device_layout(&kw, &layout));
    assert_eq!(vc.to_vec(), to_device_layout(&vw, &layout));
}

/// CPU cache `[block][slot][head][dim]` → device cache `[block][head][slot][dim]`, as bits.
fn to_device_layout(cpu: &[f16], layout: &KvLayout) -> Vec<u16> {
    let (b, h, d) = (layout.block_size, layout.num_kv_heads, layout.head_dim);
    let mut out = vec![0u16; cpu.len()];
    for (i, v) in cpu.iter().enumerate() {
        let (block, rest) = (i / (b * h * d), i % (b * h * d));
        let (slot, rest) = (rest / (h * d), rest % (h * d));
        let (head, dim) = (rest / d, rest % d);
        out[((block * h + head) * b + slot) * d + dim] = v.to_bits();
    }
    out
}

/// One attention case: sequences (context lengths) over a shared pool with shuffled blocks,
/// and query rows (sequence, context) — decode rows, or causal prefill rows of one sequence.
struct AttentionCase {
    n_kv_heads: usize,
    group: usize,
    head_dim: usize,
    seq_lens: Vec<usize>,
    /// (sequence, context length) per query row.
    rows: Vec<(usize, usize)>,
}

impl AttentionCase {
    /// `chunks` of (sequence, first position, rows): a prefill chunk's rows at consecutive
    /// positions (context = position + 1), a decode row as a chunk of one.
    fn of_chunks(
        n_kv_heads: usize,
        group: usize,
        head_dim: usize,
        seq_lens: Vec<usize>,
        chunks: &[(usize, usize, usize)],
    ) -> AttentionCase {
        let rows = chunks
            .iter()
            .flat_map(|&(seq, first, n)| (first..first + n).map(move |pos| (seq, pos + 1)))
            .collect();
        AttentionCase {
            n_kv_heads,
            group,
            head_dim,
            seq_lens,
            rows,
        }
    }
}

/// A case's inputs on the (emulated) device and the CPU, built once and run through either
/// attention kernel.
struct AttentionSetup<'a> {
    case: &'a AttentionCase,
    layout: KvLayout,
    n_heads: usize,
    max_blocks: usize,
    tables: Vec<i32>,
    k_cpu: Vec<f16>,
    v_cpu: Vec<f16>,
    q: Vec<f32>,
    scale: f32,
    parts: usize,
    bufs: [Buf<u16>; 2],
    qb: Buf<f32>,
    int_bufs: [Buf<i32>; 3],
}

/// What one attention launch (and the reduce after it) leaves in its three outputs; entries
/// the kernels never write keep their NaN poison, so comparing whole buffers bit for bit also
/// checks that two kernels write the same entries.
struct AttentionOutputs {
    out: Vec<f32>,
    part_out: Vec<f32>,
    part_stats: Vec<f32>,
}

impl AttentionSetup<'_> {
    fn new(case: &AttentionCase, seed: u64) -> AttentionSetup<'_> {
        let mut rng = StdRng::seed_from_u64(seed);
        let layout = KvLayout {
            block_size: KV_BLOCK,
            num_kv_heads: case.n_kv_heads,
            head_dim: case.head_dim,
        };
        let n_heads = case.n_kv_heads * case.group;
        let blocks_per_seq: Vec<usize> =
            case.seq_lens.iter().map(|l| l.div_ceil(KV_BLOCK)).collect();
        let max_blocks = *blocks_per_seq.iter().max().expect("sequences");
        // A pool with spare blocks, handed out in shuffled order.
        let num_blocks = blocks_per_seq.iter().sum::<usize>() + 3;
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        for i in (1..ids.len()).rev() {
            ids.swap(i, rng.random_range(0..=i));
        }
        let mut tables = vec![0i32; case.seq_lens.len() * max_blocks];
        let mut next = ids.into_iter();
        for (s, &n) in blocks_per_seq.iter().enumerate() {
            for b in 0..n {
                tables[s * max_blocks + b] = next.next().expect("enough blocks") as i32;
            }
        }
        let cache_len = num_blocks * layout.block_elems();
        let k_cpu: Vec<f16> = (0..cache_len)
            .map(|_| f16::from_f32(rng.random_range(-1.0..1.0)))
            .collect();
        let v_cpu: Vec<f16> = (0..cache_len)
            .map(|_| f16::from_f32(rng.random_range(-1.0..1.0)))
            .collect();
        // Queries large enough that the softmax is far from uniform.
        let q = random(&mut rng, case.rows.len() * n_heads * case.head_dim, 3.0);
        let max_ctx = case.rows.iter().map(|r| r.1).max().expect("rows");
        let row_seq: Vec<i32> = case.rows.iter().map(|r| r.0 as i32).collect();
        let row_ctx: Vec<i32> = case.rows.iter().map(|r| r.1 as i32).collect();
        AttentionSetup {
            case,
            n_heads,
            max_blocks,
            scale: 1.0 / (case.head_dim as f32).sqrt(),
            parts: attention_partitions(max_ctx),
            bufs: [
                Buf::of(&to_device_layout(&k_cpu, &layout)),
                Buf::of(&to_device_layout(&v_cpu, &layout)),
            ],
            qb: Buf::of(&q),
            int_bufs: [Buf::of(&tables), Buf::of(&row_seq), Buf::of(&row_ctx)],
            layout,
            tables,
            k_cpu,
            v_cpu,
            q,
        }
    }

    /// Runs the row kernel (`tiles` None: grid y over rows) or the tiled kernel over the tile
    /// table `tiles` ((first row, rows) pairs), then the reduce.
    fn run(&self, tiles: Option<&[i32]>) -> AttentionOutputs {
        let case = self.case;
        let rows = case.rows.len();
        let width = self.n_heads * case.head_dim;
        let mut out = poisoned(rows * width);
        let mut part_out = poisoned(rows * self.n_heads * self.parts * case.head_dim);
        let mut part_stats = poisoned(rows * self.n_heads * self.parts * 2);
        let [kb, vb] = &self.bufs;
        let [tb, sb, cb] = &self.int_bufs;
        let (kv_heads, max_blocks) = (case.n_kv_heads as i32, self.max_blocks as i32);
        let (group, parts) = (case.group as i32, self.parts as i32);
        match tiles {
            None => {
                let attention = match case.head_dim {
                    32 => Emu::paged_attention_d32,
                    64 => Emu::paged_attention_d64,
                    128 => Emu::paged_attention_d128,
                    d => panic!("no instance for head_dim {d}; have {ATTN_HEAD_DIMS:?}"),
                };
                attention(
                    emu(),
                    Launch::new(
                        [kv_heads as u32, rows as u32, parts as u32],
                        ATTN_THREADS,
                        attention_smem_bytes(case.group, case.head_dim),
                    ),
                    out.mut_ptr(),
                    part_out.mut_ptr(),
                    part_stats.mut_ptr(),
                    self.qb.ptr(),
                    kb.ptr(),
                    vb.ptr(),
                    tb.ptr(),
                    sb.ptr(),
                    cb.ptr(),
                    max_blocks,
                    kv_heads,
                    group,
                    parts,
                    self.scale,
                );
            }
            Some(tiles) => {
                let attention = match case.head_dim {
                    32 => Emu::paged_attention_tiled_d32,
                    64 => Emu::paged_attention_tiled_d64,
                    128 => Emu::paged_attention_tiled_d128,
                    d => panic!("no instance for head_dim {d}; have {ATTN_HEAD_DIMS:?}"),
                };
                let tiles_buf = Buf::of(tiles);
                attention(
                    emu(),
                    Launch::new(
                        [kv_heads as u32, (tiles.len() / 2) as u32, parts as u32],
                        ATTN_THREADS,
                        attention_tiled_smem_bytes(case.head_dim),
                    ),
                    out.mut_ptr(),
                    part_out.mut_ptr(),
                    part_stats.mut_ptr(),
                    self.qb.ptr(),
                    kb.ptr(),
                    vb.ptr(),
                    tb.ptr(),
                    sb.ptr(),
                    cb.ptr(),
                    tiles_buf.ptr(),
                    max_blocks,
                    kv_heads,
                    group,
                    parts,
                    self.scale,
                );
            }
        }
        emu().attention_reduce(
            Launch::new([self.n_heads as u32, rows as u32, 1], 64, 0),
            out.mut_ptr(),
            part_out.ptr(),
            part_stats.ptr(),
            cb.ptr(),
            self.n_heads as i32,
            case.head_dim as i32,
            parts,
        );
        AttentionOutputs {
            out: out.to_vec(),
            part_out: part_out.to_vec(),
            part_stats: part_stats.to_vec(),
        }
    }

    /// Every row of `got` against the CPU backend's attention.
    fn check_against_cpu(&self, what: &str, got: &[f32]) {
        let width = self.n_heads * self.case.head_dim;
        let mb = self.max_blocks;
        for (r, &(seq, ctx)) in self.case.rows.iter().enumerate() {
            let table: Vec<u32> = self.tables[seq * mb..(seq + 1) * mb]
                .iter()
                .map(|&b| b as u32)
                .collect();
            let mut want = vec![0f32; width];
            paged_attention_reference(
                &self.layout,
                &self.q[r * width..(r + 1) * width],
                self.n_heads,
                &self.k_cpu,
                &self.v_cpu,
                &table,
                ctx,
                self.scale,
                ReductionOrder::TinyBlas,
                &mut want,
            );
            // f16 probabilities: a partitioned row rounds each partition's normalised
            // probabilities, the CPU the global ones; both round to 2^-11 relative.
            assert_close(
                &format!("{what}: row {r} (seq {seq}, context {ctx})"),
                &got[r * width..(r + 1) * width],
                &want,
                2e-3,
            );
        }
    }
}

/// The tile table the CUDA backend would build: runs of consecutive rows of one sequence at
/// consecutive positions, cut into tiles of at most `max_rows` rows, as (first row, rows).
fn tile_table(rows: &[(usize, usize)], max_rows: usize) -> Vec<i32> {
    let mut tiles: Vec<i32> = Vec::new();
    for (r, &(seq, ctx)) in rows.iter().enumerate() {
        let extends = r > 0 && rows[r - 1] == (seq, ctx - 1);
        match tiles.last_mut() {
            Some(count) if extends && (*count as usize) < max_rows => *count += 1,
            _ => tiles.extend([r as i32, 1]),
        }
    }
    tiles
}

/// Asserts that two launches left the same bits in every entry of every output.
#[track_caller]
fn assert_same_bits(what: &str, got: &AttentionOutputs, want: &AttentionOutputs, width: usize) {
    for (name, g, w, per_row) in [
        ("out", &got.out, &want.out, width),
        (
            "part_out",
            &got.part_out,
            &want.part_out,
            want.part_out.len() / (want.out.len() / width),
        ),
        (
            "part_stats",
            &got.part_stats,
            &want.part_stats,
            want.part_stats.len() / (want.out.len() / width),
        ),
    ] {
        assert_eq!(g.len(), w.len(), "{what}: {name} length");
        if let Some(i) = (0..g.len()).find(|&i| g[i].to_bits() != w[i].to_bits()) {
            panic!(
                "{what}: {name}[{i}] (row {}) is {} ({:#010x}), the row kernel's {} ({:#010x})",
                i / per_row,
                g[i],
                g[i].to_bits(),
                w[i],
                w[i].to_bits()
            );
        }
    }
}

/// Runs the row kernel against the CPU reference, and the tiled kernel — over the backend's
/// tiling and over single-row tiles — against the row kernel, bit for bit, and the CPU.
fn run_attention_case(case: &AttentionCase, seed: u64) {
    let setup = AttentionSetup::new(case, seed);
    let rows = setup.run(None);
    setup.check_against_cpu("row kernel", &rows.out);
    let width = setup.n_heads * case.head_dim;
    let max_rows = attention_tile_rows(case.group);
    for (tiling, tiles) in [
        ("tiles", tile_table(&case.rows, max_rows)),
        ("single-row tiles", tile_table(&case.rows, 1)),
    ] {
        let what = format!(
            "tiled kernel, {tiling} (head_dim {}, group {})",
            case.head_dim, case.group
        );
        let tiled = setup.run(Some(&tiles));
        assert_same_bits(&what, &tiled, &rows, width);
        setup.check_against_cpu(&what, &tiled.out);
    }
}

#[test]
fn decode_attention_matches_cpu_with_gqa_partial_blocks_and_split_contexts() {
    // SmolLM2's geometry (3 query heads per KV head, head_dim 64); contexts of 1 token, one
    // short of a block, a block and one, and 1100 (three 512-token partitions reduced).
    let seq_lens = vec![1, 15, 17, 100, 1100];
    let rows = seq_lens.iter().copied().enumerate().collect();
    run_attention_case(
        &AttentionCase {
            n_kv_heads: 2,
            group: 3,
            head_dim: 64,
            seq_lens,
            rows,
        },
        8,
    );
}

#[test]
fn decode_attention_matches_cpu_for_every_head_dim_and_the_largest_group() {
    for (head_dim, group, n_kv_heads) in [(32, 8, 1), (128, 1, 3), (128, 4, 2)] {
        let seq_lens = vec![33, 520, 16];
        let rows = seq_lens.iter().copied().enumerate().collect();
        run_attention_case(
            &AttentionCase {
                n_kv_heads,
                group,
                head_dim,
                seq_lens,
                rows,
            },
            9 + head_dim as u64,
        );
    }
}

#[test]
fn prefill_rows_attend_causally_over_the_paged_cache() {
    // A chunk of 6 tokens at positions 510..516 of a 516-token sequence (earlier chunks in the
    // cache; the chunk crosses the 512-token partition), next to another sequence's decode row.
    run_attention_case(
        &AttentionCase::of_chunks(3, 3, 64, vec![516, 40], &[(0, 510, 6), (1, 39, 1)]),
        10,
    );
}

#[test]
fn tiled_prefill_attention_is_bit_identical_to_the_row_kernel_for_every_head_dim_and_group() {
    // Per geometry, one step's rows: a chunk of 21 rows of sequence 0 at positions 500..521
    // (its first 500 tokens from the cache; the chunk crosses the 512-token partition, so its
    // rows have one or two partitions, and the partition boundary falls inside a tile), a
    // whole 19-token prompt of sequence 1 (contexts 1..19, a partial last tile), a decode row
    // of sequence 2 at context 45, and a 5-row chunk of sequence 3 at positions 1030..1035
    // (three partitions). No context is a multiple of 16 but by chance.
    let seq_lens = vec![521, 19, 45, 1035];
    let chunks = [(0, 500, 21), (1, 0, 19), (2, 44, 1), (3, 1030, 5)];
    for (head_dim, group, n_kv_heads) in [
        (32, 1, 2),
        (32, 8, 1),
        (64, 3, 2),
        (64, 4, 1),
        (128, 1, 1),
        (128, 8, 1),
    ] {
        let case = AttentionCase::of_chunks(n_kv_heads, group, head_dim, seq_lens.clone(), &chunks);
        run_attention_case(&case, 100 + (head_dim * 10 + group) as u64);
    }
}

/// `out = x · Wᵀ` for `m` activation rows on the emulated device, as the CUDA backend runs a
/// decode-sized step: F16 weights directly, quantized ones after quantizing x to Q8_1.
fn emu_matvec(
    ty: WeightType,
    w: &Buf<u8>,
    x: &Buf<f32>,
    rows: usize,
    cols: usize,
    m: usize,
) -> Buf<f32> {
    let mut out = poisoned(m * rows);
    let launch = Launch::new(
        [rows.div_ceil(MV_ROWS_PER_BLOCK) as u32, 1, 1],
        MV_THREADS,
        0,
    );
    let (r, c, b) = (rows as i32, cols as i32, m as i32);
    if ty == WeightType::F16 {
        emu().matvec_f16(launch, out.mut_ptr(), w.ptr().cast(), x.ptr(), r, c, b);
        return out;
    }
    let xq = emu_quantize_q8_1(x, m, cols);
    quantized_matvec(ty)(emu(), launch, out.mut_ptr(), w.ptr(), xq.ptr(), r, c, b);
    out
}

fn emu_rms_norm(x: &Buf<f32>, w: &Buf<f32>, rows: usize, n: usize) -> Buf<f32> {
    let mut out = poisoned(rows * n);
    emu().rms_norm(
        Launch::new([rows as u32, 1, 1], NORM_THREADS, 0),
        out.mut_ptr(),
        x.ptr(),
        w.ptr(),
        n as i32,
        1e-5,
    );
    out
}

#[test]
fn tiny_llama_forward_step_through_emulated_kernels_matches_the_cpu_kernels() {
    // Two layers of a GQA llama (4 query heads over 2 KV heads, head_dim 32) with Q4_1
    // weights, one mixed step: a 5-token prefill chunk of sequence 0 at positions 3..8 (its
    // first 3 tokens already cached) and a decode token of sequence 1 at position 19.
    let (hidden, heads, kv_heads, head_dim, ffn, vocab, layers) = (128, 4, 2, 32, 320, 96, 2);
    let kv_dim = kv_heads * head_dim;
    let mut rng = StdRng::seed_from_u64(12);
    let q41 = WeightType::Q4_1;
    let mut mat = |rows: usize, cols: usize| random_matrix(&mut rng, q41, rows, cols);
    let embd = mat(vocab, hidden);
    let out_w = mat(vocab, hidden);
    struct Layer {
        wq: Vec<u8>,
        wk: Vec<u8>,
        wv: Vec<u8>,
        wo: Vec<u8>,
        wg: Vec<u8>,
        wu: Vec<u8>,
        wd: Vec<u8>,
    }
    let weights: Vec<Layer> = (0..layers)
        .map(|_| Layer {
            wq: mat(hidden, hidden),
            wk: mat(kv_dim, hidden),
            wv: mat(kv_dim, hidden),
            wo: mat(hidden, hidden),
            wg: mat(ffn, hidden),
            wu: mat(ffn, hidden),
            wd: mat(hidden, ffn),
        })
        .collect();
    let norm: Vec<f32> = (0..hidden).map(|_| rng.random_range(0.8..1.2)).collect();
    let layout = KvLayout {
        block_size: KV_BLOCK,
        num_kv_heads: kv_heads,
        head_dim,
    };
    let num_blocks = 6;
    let tables: Vec<Vec<u32>> = vec![vec![4, 1], vec![0, 5]];
    // Cached history: random K/V for the tokens before this step, the same on both sides.
    let cache_len = num_blocks * layout.block_elems();
    let mut k_cpu: Vec<Vec<f16>> = (0..layers)
        .map(|_| {
            (0..cache_len)
                .map(|_| f16::from_f32(rng.random_range(-1.0..1.0)))
                .collect()
        })
        .collect();
    let mut v_cpu = k_cpu.clone();
    let ids = [5u32, 17, 3, 88, 40, 61];
    let pos = [3u32, 4, 5, 6, 7, 19];
    let seq_of = [0usize, 0, 0, 0, 0, 1];
    let slot = |t: usize| {
        let p = pos[t] as usize;
        tables[seq_of[t]][p / KV_BLOCK] as usize * KV_BLOCK + p % KV_BLOCK
    };
    let n = ids.len();
    let scale = 1.0 / (head_dim as f32).sqrt();
    let row_bytes = q41.row_bytes(hidden);

    // CPU: the CPU backend's kernels, step by step.
    let cpu_mm = |w: &[u8], rows: usize, cols: usize, x: &[f32]| {
        let mut out = vec![0f32; n * rows];
        matmul_reference(
            &QMatrix::new(q41, w, rows, cols).expect("valid"),
            x,
            n,
            &mut out,
        );
        out
    };
    let cpu_norm = |x: &[f32]| {
        let mut out = vec![0f32; x.len()];
        for (xr, or) in x.chunks(hidden).zip(out.chunks_mut(hidden)) {
            rms_norm(xr, &norm, 1e-5, or);
        }
        out
    };
    let mut x = vec![0f32; n * hidden];
    for (t, xr) in x.chunks_mut(hidden).enumerate() {
        let id = ids[t] as usize;
        dequantize_row(q41, &embd[id * row_bytes..(id + 1) * row_bytes], xr).expect("row");
    }
    // Device: the same weights and history, in device layouts.
    let dev = |v: &[u8]| Buf::of(v);
    let mut gx = Buf::of(&x);
    let gnorm = Buf::of(&norm);
    let mut gk_cache: Vec<Buf<u16>> = k_cpu
        .iter()
        .map(|c| Buf::of(&to_device_layout(c, &layout)))
        .collect();
    let mut gv_cache: Vec<Buf<u16>> = v_cpu
        .iter()
        .map(|c| Buf::of(&to_device_layout(c, &layout)))
        .collect();
    let gpos = Buf::of(&pos.map(|p| p as i32));
    let gslots = Buf::of(&(0..n).map(|t| slot(t) as i32).collect::<Vec<_>>());
    let max_blocks = 2;
    let gtables = Buf::of(
        &tables
            .concat()
            .iter()
            .map(|&b| b as i32)
            .collect::<Vec<_>>(),
    );
    let grow_seq = Buf::of(&seq_of.map(|s| s as i32));
    let grow_ctx = Buf::of(&pos.map(|p| p as i32 + 1));

    for (l, w) in weights.iter().enumerate() {
        // CPU layer.
        let h = cpu_norm(&x);
        let mut q = cpu_mm(&w.wq, hidden, hidden, &h);
        let mut k = cpu_mm(&w.wk, kv_dim, hidden, &h);
        let v = cpu_mm(&w.wv, kv_dim, hidden, &h);
        for t in 0..n {
            rope(
                &mut q[t * hidden..(t + 1) * hidden],
                heads,
                head_dim,
                pos[t],
                10_000.0,
                RopeMode::Norm,
            );
            rope(
                &mut k[t * kv_dim..(t + 1) * kv_dim],
                kv_heads,
                head_dim,
                pos[t],
                10_000.0,
                RopeMode::Norm,
            );
            let r = t * kv_dim..(t + 1) * kv_dim;
            write_kv(
                &layout,
                &mut k_cpu[l],
                &mut v_cpu[l],
                slot(t),
                &k[r.clone()],
                &v[r],
            );
        }
        let mut attn = vec![0f32; n * hidden];
        for t in 0..n {
            let r = t * hidden..(t + 1) * hidden;
            paged_attention_reference(
                &layout,
                &q[r.clone()],
                heads,
                &k_cpu[l],
                &v_cpu[l],
                &tables[seq_of[t]],
                pos[t] as usize + 1,
                scale,
                ReductionOrder::TinyBlas,
                &mut attn[r],
            );
        }
        let o = cpu_mm(&w.wo, hidden, hidden, &attn);
        x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
        let h = cpu_norm(&x);
        let g = cpu_mm(&w.wg, ffn, hidden, &h);
        let u = cpu_mm(&w.wu, ffn, hidden, &h);
        let mut a = vec![0f32; n * ffn];
        swiglu_reference(&g, &u, &mut a);
        let d = cpu_mm(&w.wd, hidden, ffn, &a);
        x.iter_mut().zip(&d).for_each(|(a, b)| *a += b);

        // Device layer.
        let gh = emu_rms_norm(&gx, &gnorm, n, hidden);
        let mut gq = emu_matvec(q41, &dev(&w.wq), &gh, hidden, hidden, n);
        let mut gk = emu_matvec(q41, &dev(&w.wk), &gh, kv_dim, hidden, n);
        let gv = emu_matvec(q41, &dev(&w.wv), &gh, kv_dim, hidden, n);
        let launch = Launch::new([n as u32, 1, 1], 64, 0);
        emu().rope_norm(
            launch,
            gq.mut_ptr(),
            gpos.ptr(),
            heads as i32,
            head_dim as i32,
            head_dim as i32,
            10_000.0,
        );
        emu().rope_norm(
            launch,
            gk.mut_ptr(),
            gpos.ptr(),
            kv_heads as i32,
            head_dim as i32,
            head_dim as i32,
            10_000.0,
        );
        emu().write_kv(
            launch,
            gk_cache[l].mut_ptr(),
            gv_cache[l].mut_ptr(),
            gk.ptr(),
            gv.ptr(),
            gslots.ptr(),
            kv_heads as i32,
            head_dim as i32,
        );
        let mut gattn = poisoned(n * hidden);
        let (mut po, mut ps) = (poisoned(n * heads * head_dim), poisoned(n * heads * 2));
        emu().paged_attention_d32(
            Launch::new(
                [kv_heads as u32, n as u32, 1],
                ATTN_THREADS,
                attention_smem_bytes(heads / kv_heads, head_dim),
            ),
            gattn.mut_ptr(),
            po.mut_ptr(),
            ps.mut_ptr(),
            gq.ptr(),
            gk_cache[l].ptr(),
            gv_cache[l].ptr(),
            gtables.ptr(),
            grow_seq.ptr(),
            grow_ctx.ptr(),
            max_blocks,
            kv_heads as i32,
            (heads / kv_heads) as i32,
            1,
            scale,
        );
        let go = emu_matvec(q41, &dev(&w.wo), &gattn, hidden, hidden, n);
        emu().add_inplace(launch, gx.mut_ptr(), go.ptr(), (n * hidden) as i64);
        let gh = emu_rms_norm(&gx, &gnorm, n, hidden);
        let gg = emu_matvec(q41, &dev(&w.wg), &gh, ffn, hidden, n);
        let gu = emu_matvec(q41, &dev(&w.wu), &gh, ffn, hidden, n);
        let mut ga = poisoned(n * ffn);
        emu().swiglu(launch, ga.mut_ptr(), gg.ptr(), gu.ptr(), (n * ffn) as i64);
        let gd = emu_matvec(q41, &dev(&w.wd), &ga, hidden, ffn, n);
        emu().add_inplace(launch, gx.mut_ptr(), gd.ptr(), (n * hidden) as i64);
    }
    let logits = cpu_mm(&out_w, vocab, hidden, &cpu_norm(&x));
    let glogits = emu_matvec(
        q41,
        &dev(&out_w),
        &emu_rms_norm(&gx, &gnorm, n, hidden),
        vocab,
        hidden,
        n,
    );
    // Activations are requantized to 8 bits at every matmul: a value that rounds to the other
    // side of a quantization step on one path moves a logit by about one step of that row.
    assert_close("logits", &glogits.to_vec(), &logits, 2e-2);
}
