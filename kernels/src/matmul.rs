//! Threaded quantized matrix product `out[m × rows] = x[m × cols] · Wᵀ`, the operation behind
//! every linear layer.
//!
//! Activations are first converted per row to the weight's `vec_dot_type` (as ggml does), then
//! each thread of the pool computes one contiguous range of weight rows for all `m` activation
//! rows, so every weight byte is read from memory once per call whatever `m` is. The AVX2 path
//! tiles several weight rows × activation rows per block load (K-quants: one row pair at a time
//! on Q8_K activations; batched Q4_1 with `vpdpbusd` where the CPU has AVX512-VNNI, see
//! [`crate::SimdLevel`]); the scalar path is the reference (`matmul_reference`) and the fallback
//! on CPUs without AVX2. Both give bit-identical results.

use crate::dot::{
    KQuantOrder, dot_f16_f16, dot_f32_f32, dot_k_q8_k_ordered, dot_q4_0_q8_0, dot_q4_1_q8_1,
    dot_q5_0_q8_0, dot_q5_1_q8_1, dot_q8_0_q8_0,
};
use crate::matrix::OutPtr;
pub use crate::matrix::QMatrix;
use crate::quant::{
    ActivationType, Q8_K_BLOCK_BYTES, QK_K, WeightType, quantize_row_q8_0, quantize_row_q8_1,
    quantize_row_q8_k,
};
#[cfg(target_arch = "x86_64")]
use crate::simd::{Avx2Fma, Avx512Vnni};
use half::f16;
use std::ops::Range;

/// Reusable activation-conversion buffers, so that the hot path does not allocate once the
/// largest batch has been seen (they grow to `m × cols` of the biggest call and stay there).
#[derive(Default)]
pub struct MatmulScratch {
    /// Activations in ggml's block layout (scalar path).
    pub(crate) ggml_bytes: Vec<u8>,
    /// Activations rounded to f16 (f16 weights).
    pub(crate) halves: Vec<f16>,
    /// Activations in the SIMD-friendly split layout (AVX2 path).
    #[cfg(target_arch = "x86_64")]
    pub(crate) packed: crate::avx2::PackedActs,
}

impl MatmulScratch {
    pub fn new() -> Self {
        Self::default()
    }
}

/// `out[i * w.rows + r] = dot(W row r, x row i)` for `i in 0..m`; `x` is `m × w.cols`.
pub fn matmul(
    w: &QMatrix,
    x: &[f32],
    m: usize,
    out: &mut [f32],
    scratch: &mut MatmulScratch,
    pool: &rayon::ThreadPool,
) {
    matmul_fused([(w, out)], x, m, scratch, pool);
}

/// [`matmul`] with a K-quant product order per activation row (`orders[i]` for row `i`;
/// rows past the end of `orders` take [`KQuantOrder::VecDot`]). Other weight types have one
/// order only and ignore it.
pub fn matmul_ordered(
    w: &QMatrix,
    x: &[f32],
    m: usize,
    orders: &[KQuantOrder],
    out: &mut [f32],
    scratch: &mut MatmulScratch,
    pool: &rayon::ThreadPool,
) {
    matmul_fused_ordered([(w, out)], x, m, orders, scratch, pool);
}

/// Several matrices applied to the same activations (a layer's Q, K and V; gate and up), as
/// one product: `x` is quantized once and the rows of all matrices are split over the pool in
/// a single fork/join. A decode step issues a few hundred small matmuls, so halving their
/// count and their activation passes is measurable; every output is bit-identical to
/// [`matmul`] on that matrix alone. Matrices of differing type or width (possible in a GGUF)
/// are simply run one after another.
pub fn matmul_fused<const N: usize>(
    parts: [(&QMatrix, &mut [f32]); N],
    x: &[f32],
    m: usize,
    scratch: &mut MatmulScratch,
    pool: &rayon::ThreadPool,
) {
    matmul_fused_ordered(parts, x, m, &[], scratch, pool);
}

/// [`matmul_fused`] with a K-quant product order per activation row, as [`matmul_ordered`].
pub fn matmul_fused_ordered<const N: usize>(
    parts: [(&QMatrix, &mut [f32]); N],
    x: &[f32],
    m: usize,
    orders: &[KQuantOrder],
    scratch: &mut MatmulScratch,
    pool: &rayon::ThreadPool,
) {
    let Some((first, _)) = parts.first() else {
        return;
    };
    let (ty, cols) = (first.ty, first.cols);
    if parts.iter().any(|(w, _)| w.ty != ty || w.cols != cols) {
        for (w, out) in parts {
            matmul_fused_ordered([(w, out)], x, m, orders, scratch, pool);
        }
        return;
    }
    assert_eq!(x.len(), m * cols, "matmul: x must be m × cols");
    for (w, out) in &parts {
        w.assert_valid();
        assert_eq!(out.len(), m * w.rows, "matmul: out must be m × rows");
    }
    let total_rows: usize = parts.iter().map(|(w, _)| w.rows).sum();
    if m == 0 || total_rows == 0 {
        return;
    }
    let targets: [(&QMatrix, OutPtr<'_>); N] = parts.map(|(w, out)| (w, OutPtr::new(out)));
    let path = prepare_acts(ty, x, m, cols, scratch);
    let scratch = &*scratch;
    // Global row g of the fused product is row g - offset of the part that holds it.
    let work = |rows: Range<usize>| {
        let mut offset = 0;
        for (w, out) in &targets {
            let part = offset..offset + w.rows;
            let start = rows.start.max(part.start);
            let end = rows.end.min(part.end);
            if start < end {
                let rows = start - offset..end - offset;
                compute_rows(path, w, x, m, orders, scratch, rows, *out);
            }
            offset = part.end;
        }
    };
    for_each_row_chunk(pool, total_rows, path.row_align(), &work);
}

/// Which kernels a product runs on, decided once per call from the CPU and the weight type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    /// Portable reference kernels on ggml-layout activations.
    Scalar,
    /// AVX2 kernels on the packed activation layout; the token proves the CPU has them.
    #[cfg(target_arch = "x86_64")]
    Avx2(Avx2Fma),
    /// The AVX2 path with the VNNI variants of the kernels that have one (batched Q4_1); the
    /// token proves the CPU has AVX512-VNNI too.
    #[cfg(target_arch = "x86_64")]
    Vnni(Avx512Vnni),
    /// AVX2 K-quant kernels on ggml-layout Q8_K activations.
    #[cfg(target_arch = "x86_64")]
    Avx2KQuant(Avx2Fma),
}

impl Path {
    /// Row-chunk alignment between threads (the AVX2 decode tile height).
    fn row_align(self) -> usize {
        match self {
            Path::Scalar => 1,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2(_) | Path::Vnni(_) => crate::avx2::ROW_TILE,
            #[cfg(target_arch = "x86_64")]
            Path::Avx2KQuant(_) => 1,
        }
    }
}

/// Converts the activations for `ty`'s kernels into `scratch` and says which kernels to use.
fn prepare_acts(
    ty: WeightType,
    x: &[f32],
    m: usize,
    cols: usize,
    scratch: &mut MatmulScratch,
) -> Path {
    #[cfg(target_arch = "x86_64")]
    if let Some(cpu) = Avx2Fma::detect() {
        if ty.kquant().is_some() {
            // Q8_K quantization is ggml's reference on every build, so the scalar one serves.
            prepare_scalar_acts(ty, x, m, cols, scratch);
            return Path::Avx2KQuant(cpu);
        }
        if crate::avx2::supports(ty) {
            crate::avx2::prepare_acts(cpu, ty, x, m, cols, &mut scratch.packed);
            return match Avx512Vnni::detect() {
                Some(vnni) if crate::avx2::has_vnni_kernel(ty) => Path::Vnni(vnni),
                _ => Path::Avx2(cpu),
            };
        }
    }
    prepare_scalar_acts(ty, x, m, cols, scratch);
    Path::Scalar
}

#[allow(clippy::too_many_arguments)]
fn compute_rows(
    path: Path,
    w: &QMatrix,
    x: &[f32],
    m: usize,
    orders: &[KQuantOrder],
    scratch: &MatmulScratch,
    rows: Range<usize>,
    out: OutPtr<'_>,
) {
    match path {
        Path::Scalar => scalar_rows(w, x, m, orders, scratch, rows, out),
        #[cfg(target_arch = "x86_64")]
        Path::Avx2(cpu) => crate::avx2::compute_rows(cpu, None, w, m, &scratch.packed, rows, out),
        #[cfg(target_arch = "x86_64")]
        Path::Vnni(vnni) => {
            crate::avx2::compute_rows(vnni.avx2(), Some(vnni), w, m, &scratch.packed, rows, out)
        }
        #[cfg(target_arch = "x86_64")]
        Path::Avx2KQuant(cpu) => {
            crate::avx2::compute_k_rows(cpu, w, m, orders, &scratch.ggml_bytes, rows, out)
        }
    }
}

/// Single-threaded scalar oracle: ggml-layout quantization plus the `dot` reference functions.
pub fn matmul_reference(w: &QMatrix, x: &[f32], m: usize, out: &mut [f32]) {
    let mut scratch = MatmulScratch::new();
    w.assert_valid();
    assert_eq!(x.len(), m * w.cols);
    assert_eq!(out.len(), m * w.rows);
    prepare_scalar_acts(w.ty, x, m, w.cols, &mut scratch);
    scalar_rows(w, x, m, &[], &scratch, 0..w.rows, OutPtr::new(out));
}

/// [`matmul_reference`] with a K-quant product order per activation row, as
/// [`matmul_ordered`].
pub fn matmul_reference_ordered(
    w: &QMatrix,
    x: &[f32],
    m: usize,
    orders: &[KQuantOrder],
    out: &mut [f32],
) {
    let mut scratch = MatmulScratch::new();
    w.assert_valid();
    assert_eq!(x.len(), m * w.cols);
    assert_eq!(out.len(), m * w.rows);
    prepare_scalar_acts(w.ty, x, m, w.cols, &mut scratch);
    scalar_rows(w, x, m, orders, &scratch, 0..w.rows, OutPtr::new(out));
}

fn prepare_scalar_acts(
    ty: WeightType,
    x: &[f32],
    m: usize,
    cols: usize,
    scratch: &mut MatmulScratch,
) {
    match ty.vec_dot_type() {
        ActivationType::F32 => {}
        ActivationType::F16 => {
            scratch.halves.clear();
            scratch.halves.extend(x.iter().map(|&v| f16::from_f32(v)));
        }
        ActivationType::Q8_0 | ActivationType::Q8_1 => {
            let q8_1 = ty.vec_dot_type() == ActivationType::Q8_1;
            let block = if q8_1 {
                crate::quant::Q8_1_BLOCK_BYTES
            } else {
                crate::quant::Q8_0_BLOCK_BYTES
            };
            let row_bytes = cols / crate::QK * block;
            scratch.ggml_bytes.resize(m * row_bytes, 0);
            for (xr, qr) in x
                .chunks_exact(cols)
                .zip(scratch.ggml_bytes.chunks_exact_mut(row_bytes))
            {
                if q8_1 {
                    quantize_row_q8_1(xr, qr)
                } else {
                    quantize_row_q8_0(xr, qr)
                }
            }
        }
        ActivationType::Q8_K => {
            let row_bytes = cols / QK_K * Q8_K_BLOCK_BYTES;
            scratch.ggml_bytes.resize(m * row_bytes, 0);
            for (xr, qr) in x
                .chunks_exact(cols)
                .zip(scratch.ggml_bytes.chunks_exact_mut(row_bytes))
            {
                quantize_row_q8_k(xr, qr);
            }
        }
    }
}

fn scalar_rows(
    w: &QMatrix,
    x: &[f32],
    m: usize,
    orders: &[KQuantOrder],
    scratch: &MatmulScratch,
    rows: Range<usize>,
    out: OutPtr<'_>,
) {
    let cols = w.cols;
    let act_bytes = scratch.ggml_bytes.len().checked_div(m).unwrap_or(0);
    let quantized_dot: fn(&[u8], &[u8]) -> f32 = match w.ty {
        WeightType::F32 | WeightType::F16 => |_, _| unreachable!("float weights"),
        WeightType::Q8_0 => dot_q8_0_q8_0,
        WeightType::Q4_0 => dot_q4_0_q8_0,
        WeightType::Q4_1 => dot_q4_1_q8_1,
        WeightType::Q5_0 => dot_q5_0_q8_0,
        WeightType::Q5_1 => dot_q5_1_q8_1,
        WeightType::Q4_K | WeightType::Q5_K | WeightType::Q6_K => |_, _| unreachable!("K-quant"),
    };
    for r in rows {
        let wr = w.row(r);
        for a in 0..m {
            let value = match w.ty {
                WeightType::F32 => dot_f32_f32(wr, &x[a * cols..(a + 1) * cols]),
                WeightType::F16 => dot_f16_f16(wr, &scratch.halves[a * cols..(a + 1) * cols]),
                ty => {
                    let xa = &scratch.ggml_bytes[a * act_bytes..(a + 1) * act_bytes];
                    match ty.kquant() {
                        Some(kq) => {
                            let order = orders.get(a).copied().unwrap_or_default();
                            dot_k_q8_k_ordered(kq, order, wr, xa)
                        }
                        None => quantized_dot(wr, xa),
                    }
                }
            };
            // SAFETY: each thread owns a distinct range of rows `r`.
            unsafe { out.write(a * w.rows + r, value) };
        }
    }
}

/// Runs `work` over `rows` split into one contiguous range per pool thread (each a multiple of
/// `align` except the last). Splitting once per call keeps the per-matmul overhead to a single
/// fork/join, which matters when a decode step issues ~200 small matmuls.
pub(crate) fn for_each_row_chunk(
    pool: &rayon::ThreadPool,
    rows: usize,
    align: usize,
    work: &(dyn Fn(Range<usize>) + Sync),
) {
    let threads = pool.current_num_threads().max(1);
    let units = rows.div_ceil(align.max(1));
    let chunks = threads.min(units);
    if chunks <= 1 {
        work(0..rows);
        return;
    }
    let bounds = |c: usize| (units * c / chunks * align).min(rows);
    pool.install(|| split_join(0, chunks, &bounds, work));
}

fn split_join(
    first: usize,
    end: usize,
    bounds: &(dyn Fn(usize) -> usize + Sync),
    work: &(dyn Fn(Range<usize>) + Sync),
) {
    if end - first == 1 {
        work(bounds(first)..bounds(first + 1));
        return;
    }
    let mid = first + (end - first) / 2;
    rayon::join(
        || split_join(first, mid, bounds, work),
        || split_join(mid, end, bounds, work),
    );
}

#[cfg(test)]
pub(crate) mod tests;
