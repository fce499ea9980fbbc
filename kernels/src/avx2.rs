//! AVX2 + FMA + F16C quantized matmul kernels (activation packing lives in `pack`, the Q4_1
//! kernels in `q4_1`).
//!
//! Results are bit-identical to the scalar reference in `dot.rs`. For Q4_0, Q5_0, Q5_1 and Q8_0
//! (this module) that is ggml's AVX2 arithmetic:
//! per weight-row × activation-row pair, eight f32 lanes receive `fma(dw·da, lane_sum, acc)` per
//! block and are reduced with `hsum8`; integer lane sums are exact whichever instructions make
//! them. Q5_1's minimum adds ggml's second chain, `summs = fma(mw, s, summs)` per block (`s` the
//! activation block's `da·Σq`), added to the reduced lanes at the end. Speed comes from reuse
//! and memory-level parallelism, never from reordering the float arithmetic: decode (m = 1)
//! interleaves 4 weight rows and prefetches ahead because it streams the weights from DRAM;
//! prefill tiles 1 weight row × 8 activation rows so that each unpacked weight block is reused
//! 8 times, over a block of rows that stays in L1.

mod kquants;
pub(crate) mod math;
mod pack;
mod q4_1;

use crate::matrix::{OutPtr, QMatrix};
use crate::quant::{ActivationType, Q4_0_BLOCK_BYTES, Q8_0_BLOCK_BYTES, QK, WeightType};
use crate::simd::{Avx2Fma, Avx512Vnni};
pub(crate) use kquants::compute_rows as compute_k_rows;
pub(crate) use pack::PackedActs;
use std::arch::x86_64::*;
use std::ops::Range;

/// Whether the packed-activation kernels of this module handle `ty` (float weights take the
/// scalar path: they do not occur in the supported llama GGUFs' matmuls, and the reference
/// compiled with FMA is fast enough; K-quants have their own kernels on Q8_K rows,
/// [`compute_k_rows`]).
pub(crate) fn supports(ty: WeightType) -> bool {
    matches!(
        ty,
        WeightType::Q8_0
            | WeightType::Q4_0
            | WeightType::Q4_1
            | WeightType::Q5_0
            | WeightType::Q5_1
    )
}

/// Whether [`compute_rows`] has a VNNI variant for `ty` (given an [`Avx512Vnni`] token).
pub(crate) fn has_vnni_kernel(ty: WeightType) -> bool {
    ty == WeightType::Q4_1
}

/// Quantizes the `m × cols` activations into the packed layout for `ty`'s kernels.
pub(crate) fn prepare_acts(
    cpu: Avx2Fma,
    ty: WeightType,
    x: &[f32],
    m: usize,
    cols: usize,
    packed: &mut PackedActs,
) {
    let with_sums = ty.vec_dot_type() == ActivationType::Q8_1;
    // Only the Q4_1 kernels read the grouped layout; Q5_1 runs on the block-major tiles.
    let grouped = ty == WeightType::Q4_1;
    pack::pack_acts(cpu, x, m, cols, with_sums, grouped, packed);
}

/// Weight rows `rows` of `w` × the `m` activation rows packed by [`prepare_acts`]; `vnni`
/// (present when the CPU has AVX512-VNNI) selects the VNNI variant of the kernels that have one
/// (batched Q4_1).
pub(crate) fn compute_rows(
    cpu: Avx2Fma,
    vnni: Option<Avx512Vnni>,
    w: &QMatrix,
    m: usize,
    acts: &PackedActs,
    rows: Range<usize>,
    out: OutPtr<'_>,
) {
    match w.ty {
        WeightType::Q4_1 => q4_1::compute_rows(cpu, vnni, w, acts, rows, out),
        // SAFETY: `cpu` proves AVX2/FMA/F16C; `w` was validated by the caller and
        // `rows_kernel` checks the shapes it indexes with.
        WeightType::Q4_0 => unsafe { rows_kernel::<Q4_0>(w, acts, m, rows, out) },
        // SAFETY: as for Q4_0.
        WeightType::Q8_0 => unsafe { rows_kernel::<Q8_0>(w, acts, m, rows, out) },
        // SAFETY: as for Q4_0.
        WeightType::Q5_0 => unsafe { rows_kernel::<Q5_0>(w, acts, m, rows, out) },
        // SAFETY: as for Q4_0 (`rows_kernel` also checks the activation sums Q5_1 reads).
        WeightType::Q5_1 => unsafe { rows_kernel::<Q5_1>(w, acts, m, rows, out) },
        WeightType::F32
        | WeightType::F16
        | WeightType::Q4_K
        | WeightType::Q5_K
        | WeightType::Q6_K => {
            unreachable!("{:?} never takes this AVX2 path (see `supports`)", w.ty)
        }
    }
}

/// ggml's `hsum_float_8`: `((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum8(x: __m256) -> f32 {
    let mut r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// Sum of the eight i32 lanes (exact; any order).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn hsum_i32_8(a: __m256i) -> i32 {
    let sum128 = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
    let hi64 = _mm_unpackhi_epi64(sum128, sum128);
    let sum64 = _mm_add_epi32(hi64, sum128);
    let hi32 = _mm_shuffle_epi32(sum64, 0b10_11_00_01);
    _mm_cvtsi128_si32(_mm_add_epi32(sum64, hi32))
}

/// The f16 at `p` (a block scale or minimum) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes at `p`.
    let bits = unsafe { p.cast::<u16>().read_unaligned() };
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(bits))))
}

/// One quantized weight format (Q4_0, Q5_0, Q8_0: signed values; Q5_1: unsigned values and a
/// minimum) as the kernels of this module see it.
trait WeightBlock {
    const BYTES: usize;
    /// Blocks carry a minimum `m` ([`WeightBlock::min`]) and take Q8_1 activations: each pair
    /// then runs ggml's second chain `summs = fma(m, s, summs)`, added after `hsum8`.
    const HAS_MIN: bool = false;
    /// The 32 values of the block at `p` (signed, or unsigned below 128 when `HAS_MIN`).
    unsafe fn values(p: *const u8) -> __m256i;
    /// The scale `d` of the block at `p`.
    unsafe fn scale(p: *const u8) -> f32;
    /// The minimum `m` of the block at `p` (only called when `HAS_MIN`).
    unsafe fn min(_p: *const u8) -> f32 {
        unreachable!("only formats with HAS_MIN have a minimum")
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles(p: *const u8) -> __m256i {
    // Low nibbles are elements 0..16, high nibbles 16..32 (ggml's bytes_from_nibbles_32).
    // SAFETY: the caller guarantees 16 readable bytes at `p`.
    let tmp = unsafe { _mm_loadu_si128(p.cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16(tmp, 4), tmp);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

struct Q4_0;
struct Q5_0;
struct Q5_1;
struct Q8_0;

/// 32 bytes, byte `j` = 0xFF where bit `j` of the little-endian u32 at `p` is set (ggml's
/// `bytes_from_bits_32`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes_from_bits(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 4 readable bytes at `p`.
    let bits = unsafe { p.cast::<u32>().read_unaligned() };
    let shuffle = _mm256_set_epi64x(
        0x0303_0303_0303_0303,
        0x0202_0202_0202_0202,
        0x0101_0101_0101_0101,
        0,
    );
    let bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), shuffle);
    // Every bit but the byte's own one set: the byte becomes all ones iff its bit was set.
    let others = _mm256_or_si256(bytes, _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe));
    _mm256_cmpeq_epi8(others, _mm256_set1_epi64x(-1))
}

impl WeightBlock for Q5_0 {
    const BYTES: usize = crate::quant::Q5_0_BLOCK_BYTES;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values(p: *const u8) -> __m256i {
        // nibble | 0xF0 where the fifth bit is clear: the i8 value nibble + 16·bit − 16.
        // SAFETY: a whole block at `p` (qh at 2, qs at 6).
        unsafe {
            let high = _mm256_andnot_si256(bytes_from_bits(p.add(2)), _mm256_set1_epi8(-16));
            _mm256_or_si256(nibbles(p.add(6)), high)
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale(p: *const u8) -> f32 {
        unsafe { f16_at(p) }
    }
}

impl WeightBlock for Q5_1 {
    const BYTES: usize = crate::quant::Q5_1_BLOCK_BYTES;
    const HAS_MIN: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values(p: *const u8) -> __m256i {
        // nibble | 0x10 where the fifth bit is set: the value 0..31 (ggml's AVX2 q5_1 dot).
        // SAFETY: a whole block at `p` (d at 0, m at 2, qh at 4, qs at 8).
        unsafe {
            let high = _mm256_and_si256(bytes_from_bits(p.add(4)), _mm256_set1_epi8(0x10));
            _mm256_or_si256(nibbles(p.add(8)), high)
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale(p: *const u8) -> f32 {
        unsafe { f16_at(p) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn min(p: *const u8) -> f32 {
        unsafe { f16_at(p.add(2)) }
    }
}

impl WeightBlock for Q4_0 {
    const BYTES: usize = Q4_0_BLOCK_BYTES;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values(p: *const u8) -> __m256i {
        unsafe { _mm256_sub_epi8(nibbles(p.add(2)), _mm256_set1_epi8(8)) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale(p: *const u8) -> f32 {
        unsafe { f16_at(p) }
    }
}

impl WeightBlock for Q8_0 {
    const BYTES: usize = Q8_0_BLOCK_BYTES;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn values(p: *const u8) -> __m256i {
        unsafe { _mm256_loadu_si256(p.add(2).cast()) }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scale(p: *const u8) -> f32 {
        unsafe { Q4_0::scale(p) }
    }
}

/// Weight rows per decode tile (also the row-chunk alignment between threads).
const WR: usize = 4;
pub(crate) const ROW_TILE: usize = WR;
/// Weight rows whose bytes are reused from L1 across all activation groups (prefill).
const ROW_BLOCK: usize = 16;

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_kernel<T: WeightBlock>(
    w: &QMatrix,
    acts: &PackedActs,
    m: usize,
    rows: Range<usize>,
    out: OutPtr<'_>,
) {
    let row_bytes = w.row_bytes();
    assert!(rows.end <= w.rows && w.data.len() >= w.rows * row_bytes);
    assert!(acts.m == m && acts.nb * T::BYTES == row_bytes);
    assert!(!acts.grouped && acts.qs.len() == m * acts.nb * QK && acts.d.len() == m * acts.nb);
    // Minimum chains read the sums of 8 activation rows from any row < m of a block.
    assert!(
        !T::HAS_MIN || (acts.s_stride >= m + 8 && acts.s.len() >= acts.nb * acts.s_stride),
        "{} weights need block-major Q8_1 activation sums",
        std::any::type_name::<T>()
    );
    let base = w.data.as_ptr();
    let mut r = rows.start;
    if m == 1 {
        // Decode: bandwidth bound; interleave WR rows for instruction-level parallelism.
        while r < rows.end {
            // SAFETY: rows r..r+WR (or r) are in bounds (asserted above).
            unsafe {
                if rows.end - r >= WR {
                    tile_rows::<T, WR>(base.add(r * row_bytes), row_bytes, acts, r, out);
                    r += WR;
                } else {
                    tile_rows::<T, 1>(base.add(r * row_bytes), row_bytes, acts, r, out);
                    r += 1;
                }
            }
        }
        return;
    }
    // Prefill / batched decode: compute bound; one weight row × up to 8 activation rows per
    // tile, rows blocked so that their bytes stay in L1 while every activation group passes.
    while r < rows.end {
        let block_end = (r + ROW_BLOCK).min(rows.end);
        let mut a = 0;
        while a < m {
            let left = m - a;
            let group = if left >= 8 {
                8
            } else if left >= 4 {
                4
            } else if left >= 2 {
                2
            } else {
                1
            };
            for row in r..block_end {
                // SAFETY: `row` < w.rows and activation rows a..a+group < m (asserted above).
                unsafe {
                    let wp = base.add(row * row_bytes);
                    match group {
                        8 => tile_acts8::<T>(wp, acts, a, row, w.rows, out),
                        4 => tile_acts::<T, 4>(wp, acts, a, row, w.rows, out),
                        2 => tile_acts::<T, 2>(wp, acts, a, row, w.rows, out),
                        _ => tile_acts::<T, 1>(wp, acts, a, row, w.rows, out),
                    }
                }
            }
            a += group;
        }
        r = block_end;
    }
}

/// Integer lane sums of one weight block against one activation block, as f32. `w_abs` is
/// `|wv|`; for unsigned values (Q5_1) it is `wv` itself and the sign step only zeroes
/// activations facing a zero weight, which changes no product.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn lane_sums(wv: __m256i, w_abs: __m256i, av: __m256i) -> __m256 {
    let prod = _mm256_maddubs_epi16(w_abs, _mm256_sign_epi8(av, wv));
    _mm256_cvtepi32_ps(_mm256_madd_epi16(prod, _mm256_set1_epi16(1)))
}

/// `R` consecutive weight rows starting at `wp` × activation row 0 (decode).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_rows<T: WeightBlock, const R: usize>(
    wp: *const u8,
    row_bytes: usize,
    acts: &PackedActs,
    r0: usize,
    out: OutPtr<'_>,
) {
    let mut acc = [_mm256_setzero_ps(); R];
    let mut summs = [0.0f32; R];
    for b in 0..acts.nb {
        // SAFETY: block b of activation row 0 exists (nb blocks per row).
        let av = unsafe { _mm256_loadu_si256(acts.qs.as_ptr().add(b * QK).cast()) };
        let da = acts.d[b];
        for (i, (acc_i, summs_i)) in acc.iter_mut().zip(&mut summs).enumerate() {
            // SAFETY: rows r0..r0+R each hold nb blocks of T::BYTES.
            let p = unsafe { wp.add(i * row_bytes + b * T::BYTES) };
            // Decode streams weights from DRAM and the hardware prefetcher alone falls behind
            // (measured ~2x): fetch this block two tiles ahead. Prefetches never fault, so
            // running past the end of the matrix is harmless.
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(2 * R * row_bytes).cast());
            let dw = unsafe { T::scale(p) };
            let wv = unsafe { T::values(p) };
            let sums = unsafe { lane_sums(wv, _mm256_sign_epi8(wv, wv), av) };
            *acc_i = _mm256_fmadd_ps(_mm256_set1_ps(dw * da), sums, *acc_i);
            if T::HAS_MIN {
                // SAFETY: a whole block at `p`; row 0's sum of block b exists (asserted by
                // the caller).
                *summs_i = unsafe { T::min(p) }.mul_add(acts.s[b * acts.s_stride], *summs_i);
            }
        }
    }
    for (i, (acc_i, summs_i)) in acc.iter().zip(summs).enumerate() {
        // SAFETY: this function's own target features (the caller's contract).
        let mut value = unsafe { hsum8(*acc_i) };
        if T::HAS_MIN {
            value += summs_i;
        }
        // SAFETY: this thread owns weight rows r0..r0+R.
        unsafe { out.write(r0 + i, value) };
    }
}

/// One weight row at `wp` × activation rows `a0..a0+A`: the 4-, 2- and 1-row remainders of
/// the activation groups (full groups of 8 take [`tile_acts8`]).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_acts<T: WeightBlock, const A: usize>(
    wp: *const u8,
    acts: &PackedActs,
    a0: usize,
    r: usize,
    rows: usize,
    out: OutPtr<'_>,
) {
    let (nb, m) = (acts.nb, acts.m);
    let mut acc = [_mm256_setzero_ps(); A];
    let mut summs = [0.0f32; A];
    for b in 0..nb {
        // SAFETY: block b of this weight row exists.
        let p = unsafe { wp.add(b * T::BYTES) };
        if T::HAS_MIN {
            let mw = unsafe { T::min(p) };
            let s = &acts.s[b * acts.s_stride + a0..][..A];
            for (summs_j, &s_j) in summs.iter_mut().zip(s) {
                *summs_j = mw.mul_add(s_j, *summs_j);
            }
        }
        let dw = unsafe { T::scale(p) };
        let wv = unsafe { T::values(p) };
        let w_abs = _mm256_sign_epi8(wv, wv);
        let dwv = _mm256_set1_ps(dw);
        // SAFETY: activation rows a0..a0+A < m exist for block b (asserted by the caller).
        let (qs, d) = unsafe {
            (
                acts.qs.as_ptr().add((b * m + a0) * QK),
                acts.d.as_ptr().add(b * m + a0),
            )
        };
        for (j, acc_j) in acc.iter_mut().enumerate() {
            let (av, da) = unsafe {
                (
                    _mm256_loadu_si256(qs.add(j * QK).cast()),
                    _mm256_broadcast_ss(&*d.add(j)),
                )
            };
            let sums = unsafe { lane_sums(wv, w_abs, av) };
            *acc_j = _mm256_fmadd_ps(_mm256_mul_ps(dwv, da), sums, *acc_j);
        }
    }
    for (j, (acc_j, summs_j)) in acc.iter().zip(summs).enumerate() {
        // SAFETY: this function's own target features (the caller's contract).
        let mut value = unsafe { hsum8(*acc_j) };
        if T::HAS_MIN {
            value += summs_j;
        }
        // SAFETY: this thread owns weight row r.
        unsafe { out.write((a0 + j) * rows + r, value) };
    }
}

/// Blocks whose scale products one [`tile_acts8`] pass stages (2 KiB of stack).
const SCALE_CHUNK: usize = 64;

/// Eight block scales `dw·da`, aligned for one vector store.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Scales8([f32; 8]);

/// [`tile_acts`] for a full group of 8 activation rows, the batched-decode and prefill
/// workhorse. Its per-pair work is two integer multiplies, a conversion and an FMA; computing
/// each pair's scale `dw·da` inline (a multiply and a register broadcast) put two more
/// operations per pair on the pipes the FMAs and integer multiplies use. Here one pass first
/// stores the products of a chunk of blocks (one vector multiply per block), and the main loop
/// broadcasts each from memory, which costs only a load. Same products, same rounding, same
/// order of the FMA chains: results are identical to [`tile_acts`] run on 8 rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_acts8<T: WeightBlock>(
    wp: *const u8,
    acts: &PackedActs,
    a0: usize,
    r: usize,
    rows: usize,
    out: OutPtr<'_>,
) {
    let (nb, m) = (acts.nb, acts.m);
    let mut acc = [_mm256_setzero_ps(); 8];
    // Lane j: activation row a0 + j's `Σ mw·s` chain (formats with a minimum).
    let mut summs = _mm256_setzero_ps();
    // Uninitialised: every slot a pass reads was written by the same pass.
    let mut scales = [const { std::mem::MaybeUninit::<Scales8>::uninit() }; SCALE_CHUNK];
    let mut start = 0;
    while start < nb {
        let end = (start + SCALE_CHUNK).min(nb);
        for (b, slot) in (start..end).zip(scales.iter_mut()) {
            // SAFETY: block b of this weight row exists; rows a0..a0+8 < m have a scale for it.
            unsafe {
                let dw = T::scale(wp.add(b * T::BYTES));
                let da = _mm256_loadu_ps(acts.d.as_ptr().add(b * m + a0));
                let product = _mm256_mul_ps(_mm256_set1_ps(dw), da);
                _mm256_store_ps(slot.as_mut_ptr().cast::<f32>(), product);
                if T::HAS_MIN {
                    // Rows a0..a0+8 of block b's sums (s_stride ≥ m + 8, asserted by caller).
                    let s = _mm256_loadu_ps(acts.s.as_ptr().add(b * acts.s_stride + a0));
                    let mw = _mm256_set1_ps(T::min(wp.add(b * T::BYTES)));
                    summs = _mm256_fmadd_ps(mw, s, summs);
                }
            }
        }
        for (b, slot) in (start..end).zip(scales.iter()) {
            // SAFETY: as above; activation rows a0..a0+8 hold block b (asserted by the caller).
            unsafe {
                let p = wp.add(b * T::BYTES);
                let wv = T::values(p);
                let w_abs = _mm256_sign_epi8(wv, wv);
                let qs = acts.qs.as_ptr().add((b * m + a0) * QK);
                for (j, acc_j) in acc.iter_mut().enumerate() {
                    let av = _mm256_loadu_si256(qs.add(j * QK).cast());
                    let sums = lane_sums(wv, w_abs, av);
                    let scale = _mm256_broadcast_ss(&slot.assume_init_ref().0[j]);
                    *acc_j = _mm256_fmadd_ps(scale, sums, *acc_j);
                }
            }
        }
        start = end;
    }
    let mut sums = hsum8x8(&acc);
    if T::HAS_MIN {
        sums = _mm256_add_ps(sums, summs);
    }
    let mut results = [0.0f32; 8];
    // SAFETY: `results` holds 8 floats.
    unsafe { _mm256_storeu_ps(results.as_mut_ptr(), sums) };
    for (j, value) in results.into_iter().enumerate() {
        // SAFETY: this thread owns weight row r.
        unsafe { out.write((a0 + j) * rows + r, value) };
    }
}

/// `[hsum8(acc[0]), …, hsum8(acc[7])]` as one vector: the same additions of the same operands
/// as eight [`hsum8`] calls (so bit-identical), done eight lanes at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum8x8(acc: &[__m256; 8]) -> __m256 {
    // x[i] + x[i+4] for two accumulators per vector: [acc j | acc j+1].
    let halves = |j: usize| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(acc[j], acc[j + 1]),
            _mm256_permute2f128_ps::<0x31>(acc[j], acc[j + 1]),
        )
    };
    let (h01, h23, h45, h67) = (halves(0), halves(2), halves(4), halves(6));
    // (r0 + r2, r1 + r3): lanes [j, j, j+2, j+2 | j+1, j+1, j+3, j+3].
    let pairs = |a: __m256, b: __m256| {
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b01_00_01_00>(a, b),
            _mm256_shuffle_ps::<0b11_10_11_10>(a, b),
        )
    };
    let (p0123, p4567) = (pairs(h01, h23), pairs(h45, h67));
    // Sums in lane order [0, 2, 4, 6 | 1, 3, 5, 7].
    let sums = _mm256_add_ps(
        _mm256_shuffle_ps::<0b10_00_10_00>(p0123, p4567),
        _mm256_shuffle_ps::<0b11_01_11_01>(p0123, p4567),
    );
    _mm256_permutevar8x32_ps(sums, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
}
