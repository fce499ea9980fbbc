//! Q4_1 × Q8_1 products in block-sum form (see `dot::dot_q4_1_q8_1`): per weight row ×
//! activation row pair, each block's exact integer dot product is converted once and added with
//! one fused multiply-add by the block's scale `dw·da`; `Σ mw·s` runs in a second chain.
//!
//! Why this form rather than ggml's eight-lane one: with eight lanes per pair, every block of
//! every pair costs two integer multiplies, a conversion and an FMA, and batched decode is bound
//! by exactly those pipes. Here the eight f32 lanes carry eight *different* pairs:
//! - batched ([`grouped_rows`]): one weight row × one or two groups of eight activation rows.
//!   Each 4-element piece of the weight block is broadcast to all lanes (one in-lane shuffle),
//!   the activations are stored grouped (see `pack::PackedActs`), and `maddubs` yields for all
//!   eight rows at once the partial sums of those four elements. The eight partial vectors are
//!   added in 16 bits (each lane is at most 8 · 2 · 15 · 127 = 30 480, so nothing saturates) and
//!   widened once: nine multiplies, one conversion and one FMA per block for eight pairs,
//!   instead of sixteen, eight and eight. Measured (criterion, `matmul/q4_1_*/16`): 1.5–1.7×
//!   the eight-lane kernel. On CPUs with AVX512-VNNI ([`grouped_rows_vnni`]) four 512-bit
//!   `vpdpbusd` replace the multiplies and 16-bit additions: the same integers, the same float
//!   code (one macro text for both kernels), about twice the AVX2 kernel's speed.
//! - decode ([`decode_rows`], one activation row): four weight rows' integer sums are reduced
//!   into four lanes, so conversions and FMAs are shared by four rows.
//!
//! Both compute the same integer per (pair, block) and the same two FMA chains in block order,
//! so a sequence's logits do not depend on whether it was decoded alone or in a batch.

use super::pack::{GROUP, PackedActs};
use super::{f16_at, hsum_i32_8, nibbles};
use crate::matrix::{OutPtr, QMatrix};
use crate::quant::{Q4_1_BLOCK_BYTES, QK};
use crate::simd::{Avx2Fma, Avx512Vnni};
use std::arch::x86_64::*;
use std::ops::Range;

/// Weight rows per decode tile (the row-chunk alignment between threads is a multiple of it).
const DECODE_ROWS: usize = 4;
const _: () = assert!(super::ROW_TILE.is_multiple_of(DECODE_ROWS));

/// The 32 values (0..15) of the Q4_1 block at `p`, in element order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn values(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees a whole block at `p`; its nibbles start after (d, m).
    unsafe { nibbles(p.add(4)) }
}

/// Weight rows `rows` of the Q4_1 matrix `w` × the activations packed by `pack_acts`; with a
/// [`Avx512Vnni`] token (`vnni`), the batched kernel sums blocks with `vpdpbusd` (decode is
/// bound by memory bandwidth and stays AVX2's).
pub(super) fn compute_rows(
    _cpu: Avx2Fma,
    vnni: Option<Avx512Vnni>,
    w: &QMatrix,
    acts: &PackedActs,
    rows: Range<usize>,
    out: OutPtr<'_>,
) {
    let row_bytes = w.row_bytes();
    assert!(rows.end <= w.rows && w.data.len() >= w.rows * row_bytes);
    assert!(acts.nb * Q4_1_BLOCK_BYTES == row_bytes && acts.s.len() >= acts.d.len());
    // SAFETY: `_cpu` proves AVX2/FMA/F16C, `vnni` AVX512F/VL/VNNI on top; shapes asserted above
    // and in the callees.
    unsafe {
        match (acts.grouped, vnni) {
            (true, Some(_)) => grouped_rows_vnni(w, acts, rows, out),
            (true, None) => grouped_rows(w, acts, rows, out),
            (false, _) => decode_rows(w, acts, rows, out),
        }
    }
}

/// One activation row: tiles of [`DECODE_ROWS`] weight rows streamed from memory.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_rows(w: &QMatrix, acts: &PackedActs, rows: Range<usize>, out: OutPtr<'_>) {
    assert!(acts.m == 1 && acts.qs.len() == acts.nb * QK && acts.d.len() == acts.nb);
    assert!(acts.s.len() >= acts.nb * acts.s_stride);
    let row_bytes = w.row_bytes();
    let base = w.data.as_ptr();
    let mut r = rows.start;
    while r < rows.end {
        // SAFETY: rows r..r+DECODE_ROWS (or r) are in bounds (asserted by the caller).
        unsafe {
            if rows.end - r >= DECODE_ROWS {
                decode_tile4(base.add(r * row_bytes), row_bytes, acts, r, out);
                r += DECODE_ROWS;
            } else {
                decode_tile1(base.add(r * row_bytes), acts, r, out);
                r += 1;
            }
        }
    }
}

/// Four weight rows from `wp` × activation row 0; lane `i` of the chains is row `r0 + i`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_tile4(
    wp: *const u8,
    row_bytes: usize,
    acts: &PackedActs,
    r0: usize,
    out: OutPtr<'_>,
) {
    let ones = _mm256_set1_epi16(1);
    let mut acc = _mm_setzero_ps();
    let mut summs = _mm_setzero_ps();
    for b in 0..acts.nb {
        // SAFETY: block b of activation row 0 and of rows r0..r0+4 exist (asserted above).
        unsafe {
            let av = _mm256_loadu_si256(acts.qs.as_ptr().add(b * QK).cast());
            let block = |i: usize| wp.add(i * row_bytes + b * Q4_1_BLOCK_BYTES);
            let isum = |i: usize| {
                let p = block(i);
                // Decode streams weights from DRAM and the hardware prefetcher alone falls
                // behind: fetch this block two tiles ahead (prefetches never fault).
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(2 * DECODE_ROWS * row_bytes).cast());
                _mm256_madd_epi16(_mm256_maddubs_epi16(values(p), av), ones)
            };
            let (s0, s1, s2, s3) = (isum(0), isum(1), isum(2), isum(3));
            // hadd twice: [r0 r1 r2 r3] partial sums in each 128-bit half.
            let h = _mm256_hadd_epi32(_mm256_hadd_epi32(s0, s1), _mm256_hadd_epi32(s2, s3));
            let sums = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            // The four rows' (d, m) f16 pairs → [d0 m0 d1 m1 | d2 m2 d3 m3].
            let dm = _mm256_cvtph_ps(_mm_setr_epi32(
                block(0).cast::<i32>().read_unaligned(),
                block(1).cast::<i32>().read_unaligned(),
                block(2).cast::<i32>().read_unaligned(),
                block(3).cast::<i32>().read_unaligned(),
            ));
            let (lo, hi) = (_mm256_castps256_ps128(dm), _mm256_extractf128_ps(dm, 1));
            let dw = _mm_shuffle_ps::<0b10_00_10_00>(lo, hi);
            let mw = _mm_shuffle_ps::<0b11_01_11_01>(lo, hi);
            let scale = _mm_mul_ps(dw, _mm_set1_ps(acts.d[b]));
            acc = _mm_fmadd_ps(scale, _mm_cvtepi32_ps(sums), acc);
            summs = _mm_fmadd_ps(mw, _mm_set1_ps(acts.s[b * acts.s_stride]), summs);
        }
    }
    let mut results = [0.0f32; 4];
    // SAFETY: `results` holds 4 floats.
    unsafe { _mm_storeu_ps(results.as_mut_ptr(), _mm_add_ps(acc, summs)) };
    for (i, value) in results.into_iter().enumerate() {
        // SAFETY: this thread owns weight rows r0..r0+4.
        unsafe { out.write(r0 + i, value) };
    }
}

/// One weight row at `wp` × activation row 0 (the rows left over after the four-row tiles).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_tile1(wp: *const u8, acts: &PackedActs, r: usize, out: OutPtr<'_>) {
    let ones = _mm256_set1_epi16(1);
    let (mut acc, mut summs) = (0.0f32, 0.0f32);
    for b in 0..acts.nb {
        // SAFETY: block b of activation row 0 and of this weight row exist.
        unsafe {
            let p = wp.add(b * Q4_1_BLOCK_BYTES);
            let av = _mm256_loadu_si256(acts.qs.as_ptr().add(b * QK).cast());
            let isum = hsum_i32_8(_mm256_madd_epi16(_mm256_maddubs_epi16(values(p), av), ones));
            let (dw, mw) = (f16_at(p), f16_at(p.add(2)));
            acc = (dw * acts.d[b]).mul_add(isum as f32, acc);
            summs = mw.mul_add(acts.s[b * acts.s_stride], summs);
        }
    }
    // SAFETY: this thread owns weight row r.
    unsafe { out.write(r, acc + summs) };
}

/// Weight rows whose bytes stay in L1 while every activation group passes over them.
const ROW_BLOCK: usize = 16;

/// Defines a batched kernel `$rows` (two or more activation rows, grouped: for each block of
/// [`ROW_BLOCK`] weight rows, the activation groups pass in tiles of the listed sizes `$g`, a
/// weight block unpacked once serving the whole tile) and its tile `$tile` (the Q4_1 row at `wp` ×
/// activation groups `g0..g0+G`; lane `j` of result `i` is activation row `8(g0+i) + j`),
/// compiled for `$features`, with `$isum` making a block's eight integer sums. AVX2 has sixteen
/// vector registers: `G` ≤ 2 keeps the eight broadcast weight pieces and the accumulators in them.
/// AVX-512 has thirty-two and four weight registers (`weight_pairs`), so the VNNI kernel takes up
/// to six groups a tile: at the ~36-row steps of a decode-heavy batch, 5 groups in one tile
/// instead of 2 + 2 + 1 ran 1.1–1.2× faster (criterion, `matmul/q4_1_*/36` and `/104`, alternated).
/// Only `$isum` differs between the AVX2 and the VNNI kernels: the float arithmetic is this one
/// text, and a tile's size does not change any pair's arithmetic, so every form gives the same
/// bits.
macro_rules! grouped_kernel {
    ($rows:ident, $tile:ident, $pieces:ident, $isum:ident, [$($g:literal),+], $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $rows(w: &QMatrix, acts: &PackedActs, rows: Range<usize>, out: OutPtr<'_>) {
            let (nb, groups) = (acts.nb, acts.groups);
            let slots = nb * groups * GROUP;
            assert!(acts.qs.len() == slots * QK && acts.d.len() == slots && acts.s.len() == slots);
            // The groups pass in as few tiles as the registers allow, of balanced sizes: a
            // weight block is unpacked once per tile, so 5 groups run as 3 + 2, not 2 + 2 + 1.
            // The tile sizes are 1..=max, so their count is the largest.
            let max_groups = [$($g),+].len();
            let tiles = groups.div_ceil(max_groups);
            let mut start = rows.start;
            while start < rows.end {
                let end = (start + ROW_BLOCK).min(rows.end);
                let mut g = 0;
                for t in 0..tiles {
                    let n = (groups - g).div_ceil(tiles - t);
                    // SAFETY: rows start..end < w.rows; groups g..g+n exist.
                    unsafe {
                        // Balanced tiles of at most `max_groups` groups: n is one of them.
                        match n {
                            $($g => tile_rows::<$g>(w, acts, g, start..end, out),)+
                            _ => unreachable!("a tile of {n} groups (at most {max_groups})"),
                        }
                    }
                    g += n;
                }
                start = end;
            }

            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn tile_rows<const G: usize>(
                w: &QMatrix,
                acts: &PackedActs,
                g: usize,
                rows: Range<usize>,
                out: OutPtr<'_>,
            ) {
                let row_bytes = w.row_bytes();
                for row in rows {
                    // SAFETY: `row` < w.rows; groups g..g+G exist (the caller's contract).
                    unsafe {
                        let wp = w.data.as_ptr().add(row * row_bytes);
                        let sums = $tile::<G>(wp, acts, g);
                        for (gi, &s) in sums.iter().enumerate() {
                            write_group(s, acts, g + gi, row, w.rows, out);
                        }
                    }
                }
            }
        }

        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn $tile<const G: usize>(
            wp: *const u8,
            acts: &PackedActs,
            g0: usize,
        ) -> [__m256; G] {
            let (nb, groups) = (acts.nb, acts.groups);
            let mut acc = [_mm256_setzero_ps(); G];
            for b in 0..nb {
                // SAFETY: block b of the row and groups g0..g0+G of block b exist.
                unsafe {
                    let p = wp.add(b * Q4_1_BLOCK_BYTES);
                    let wq = $pieces(p);
                    let dw = _mm256_set1_ps(f16_at(p));
                    for (gi, acc_g) in acc.iter_mut().enumerate() {
                        let slot = (b * groups + g0 + gi) * GROUP;
                        let isum = $isum(&wq, acts.qs.as_ptr().add(slot * QK));
                        let scale = _mm256_mul_ps(dw, _mm256_loadu_ps(acts.d.as_ptr().add(slot)));
                        *acc_g = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum), *acc_g);
                    }
                }
            }
            // SAFETY: as above.
            let summs = unsafe { min_chains::<G>(wp, acts, g0) };
            std::array::from_fn(|gi| _mm256_add_ps(acc[gi], summs[gi]))
        }
    };
}

grouped_kernel!(
    grouped_rows,
    group_tile,
    weight_pieces,
    isum_maddubs,
    [1, 2],
    "avx2,fma,f16c"
);
grouped_kernel!(
    grouped_rows_vnni,
    group_tile_vnni,
    weight_pairs,
    isum_vnni,
    [1, 2, 3, 4, 5, 6],
    "avx2,fma,f16c,avx512f,avx512vl,avx512vnni"
);

/// The Q4_1 block at `p` as four 512-bit registers, register `k` holding piece `2k`
/// ([`weight_pieces`]) in its low 256 bits and piece `2k + 1` in its high 256 bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn weight_pairs(p: *const u8) -> [__m512i; 4] {
    // SAFETY: the caller guarantees a whole block at `p`; its nibbles start after (d, m).
    let values = unsafe { values(p) };
    // Dwords 0..4: pieces 0..4 (low nibbles), 4..8: pieces 4..8 (high nibbles).
    let v = _mm512_castsi256_si512(values);
    let pair = |k: i32| {
        let lo = _mm256_set1_epi32(2 * k);
        let hi = _mm256_set1_epi32(2 * k + 1);
        _mm512_permutexvar_epi32(_mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi), v)
    };
    [pair(0), pair(1), pair(2), pair(3)]
}

/// [`isum_maddubs`] with `vpdpbusd` on 512-bit registers: each instruction multiplies two
/// pieces' unsigned weights ([`weight_pairs`]) by the signed activations and adds the four
/// products of every dword straight into i32 lanes; the two 256-bit halves (even and odd pieces)
/// are added at the end. The same exact integers (no partial sum comes near the i32 range); two
/// chains, so that the instruction's latency does not bound the loop. Measured against the
/// 256-bit form (eight `vpdpbusd` per block): 1.3–1.6× on an Emerald Rapids core.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl,avx512vnni")]
unsafe fn isum_vnni(wq: &[__m512i; 4], av: *const i8) -> __m256i {
    // SAFETY: the caller guarantees the group block's 256 bytes at `av`.
    let a = |k: usize| unsafe { _mm512_loadu_si512(av.add(k * 2 * QK).cast()) };
    let even = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[0], a(0));
    let odd = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[1], a(1));
    let even = _mm512_dpbusd_epi32(even, wq[2], a(2));
    let odd = _mm512_dpbusd_epi32(odd, wq[3], a(3));
    let sum = _mm512_add_epi32(even, odd);
    _mm256_add_epi32(
        _mm512_castsi512_si256(sum),
        _mm512_extracti64x4_epi64::<1>(sum),
    )
}

/// The Q4_1 block at `p` as eight registers, register `j` holding elements `4j..4j+4` (values
/// 0..15) in every dword: both 128-bit halves hold the 16 nibble bytes, low nibbles are elements
/// 0..16, high nibbles 16..32, and an in-lane dword shuffle broadcasts one 4-element piece.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn weight_pieces(p: *const u8) -> [__m256i; 8] {
    let mask = _mm256_set1_epi8(0x0F);
    // SAFETY: the caller guarantees a whole block at `p`; its nibbles start after (d, m).
    let raw = unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(p.add(4).cast())) };
    let lo = _mm256_and_si256(raw, mask);
    let hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
    [
        _mm256_shuffle_epi32::<0x00>(lo),
        _mm256_shuffle_epi32::<0x55>(lo),
        _mm256_shuffle_epi32::<0xAA>(lo),
        _mm256_shuffle_epi32::<0xFF>(lo),
        _mm256_shuffle_epi32::<0x00>(hi),
        _mm256_shuffle_epi32::<0x55>(hi),
        _mm256_shuffle_epi32::<0xAA>(hi),
        _mm256_shuffle_epi32::<0xFF>(hi),
    ]
}

/// Lane `r`: the exact integer dot product of the weight block `wq` ([`weight_pieces`]) with
/// row `r` of the activation group block at `av` (eight registers, see `pack::PackedActs`).
/// `maddubs` yields for all eight rows the partial sums of one 4-element piece; the eight
/// partial vectors are added in 16 bits (each lane is at most 8 · 2 · 15 · 127 = 30 480, so
/// nothing saturates) and widened once.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn isum_maddubs(wq: &[__m256i; 8], av: *const i8) -> __m256i {
    // SAFETY: the caller guarantees the group block's 256 bytes at `av`.
    let piece = |j: usize| unsafe {
        _mm256_maddubs_epi16(wq[j], _mm256_loadu_si256(av.add(j * QK).cast()))
    };
    let s16 = _mm256_add_epi16(
        _mm256_add_epi16(
            _mm256_add_epi16(piece(0), piece(1)),
            _mm256_add_epi16(piece(2), piece(3)),
        ),
        _mm256_add_epi16(
            _mm256_add_epi16(piece(4), piece(5)),
            _mm256_add_epi16(piece(6), piece(7)),
        ),
    );
    _mm256_madd_epi16(s16, _mm256_set1_epi16(1))
}

/// The `Σ mw·s` chains of the row at `wp` × groups `g0..g0+G`, in a pass of their own (fewer
/// live registers in the main loop).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn min_chains<const G: usize>(wp: *const u8, acts: &PackedActs, g0: usize) -> [__m256; G] {
    let groups = acts.groups;
    let mut summs = [_mm256_setzero_ps(); G];
    for b in 0..acts.nb {
        // SAFETY: block b of the row and groups g0..g0+G of block b exist (the caller's
        // contract).
        unsafe {
            let p = wp.add(b * Q4_1_BLOCK_BYTES);
            let mw = _mm256_set1_ps(f16_at(p.add(2)));
            for (gi, summs_g) in summs.iter_mut().enumerate() {
                let slot = (b * groups + g0 + gi) * GROUP;
                *summs_g =
                    _mm256_fmadd_ps(mw, _mm256_loadu_ps(acts.s.as_ptr().add(slot)), *summs_g);
            }
        }
    }
    summs
}

/// Writes lane `j` of `sums` as activation row `8g + j`'s output for weight row `row` (lanes of
/// the padding rows past `m` are dropped).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn write_group(
    sums: __m256,
    acts: &PackedActs,
    g: usize,
    row: usize,
    rows: usize,
    out: OutPtr<'_>,
) {
    let live = (acts.m - g * GROUP).min(GROUP);
    let mut results = [0.0f32; GROUP];
    // SAFETY: `results` holds 8 floats.
    unsafe { _mm256_storeu_ps(results.as_mut_ptr(), sums) };
    for (j, &value) in results[..live].iter().enumerate() {
        // SAFETY: this thread owns weight row `row`.
        unsafe { out.write((g * GROUP + j) * rows + row, value) };
    }
}
