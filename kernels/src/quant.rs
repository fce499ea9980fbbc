//! GGML block layouts (Q4_0, Q4_1, Q8_0, Q8_1), activation quantization and dequantization.
//!
//! Weight bytes come straight from a memory-mapped GGUF file, so blocks are never viewed as
//! aligned Rust structs: every field is read from a byte slice. Layouts (QK = 32 elements):
//!
//! | type | bytes | fields                         | value                         |
//! |------|-------|--------------------------------|-------------------------------|
//! | Q4_0 | 18    | d: f16, qs: [u8; 16]            | d·(q − 8)                     |
//! | Q4_1 | 20    | d: f16, m: f16, qs: [u8; 16]    | d·q + m                       |
//! | Q5_0 | 22    | d: f16, qh: u32, qs: [u8; 16]   | d·(q − 16)                    |
//! | Q5_1 | 24    | d, m: f16, qh: u32, qs: [u8; 16] | d·q + m                      |
//! | Q8_0 | 34    | d: f16, qs: [i8; 32]            | d·q                           |
//! | Q8_1 | 36    | d: f16, s: f16, qs: [i8; 32]    | d·q, with s = d·Σq            |
//!
//! In the 4- and 5-bit types the low nibbles of `qs` are elements 0..16 and the high nibbles
//! 16..32; the 5-bit types take element `j`'s fifth bit from bit `j` of the little-endian `qh`.
//! Activation quantization mirrors ggml's x86 path (`127/amax` multiplier, round half to even),
//! which is what llama.cpp runs on this hardware, not ggml's scalar `_ref` variant.

pub mod kquants;

pub use kquants::{
    KQuantSizeError, KQuantType, Q4_K_BLOCK_BYTES, Q5_K_BLOCK_BYTES, Q6_K_BLOCK_BYTES,
    Q8_K_BLOCK_BYTES, QK_K, dequantize_row_k, quantize_row_q8_k,
};

use crate::KernelError;
use half::f16;

/// Elements per quantized block.
pub const QK: usize = 32;
pub const Q4_0_BLOCK_BYTES: usize = 18;
pub const Q4_1_BLOCK_BYTES: usize = 20;
pub const Q5_0_BLOCK_BYTES: usize = 22;
pub const Q5_1_BLOCK_BYTES: usize = 24;
pub const Q8_0_BLOCK_BYTES: usize = 34;
pub const Q8_1_BLOCK_BYTES: usize = 36;

/// Storage type of a weight tensor (the subset of GGML types kvgate supports). The K-quant
/// variants keep ggml's names (`Q4_K`, as GGUF tools print them) rather than camel case.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightType {
    F32,
    F16,
    Q8_0,
    Q4_0,
    Q4_1,
    /// 5-bit values in 32-element blocks (llama.cpp's fallback for Q4_K/Q5_K tensors whose width
    /// is not a multiple of 256).
    Q5_0,
    Q5_1,
    /// 256-element super-blocks (see [`kquants`]); activations go to Q8_K.
    Q4_K,
    Q5_K,
    Q6_K,
}

/// The type activations are converted to before a dot product with a weight row
/// (ggml's `vec_dot_type`).
#[allow(non_camel_case_types)] // ggml's names
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ActivationType {
    F32,
    F16,
    Q8_0,
    Q8_1,
    /// 256-element blocks with an f32 scale and 16-element sums (the K-quants' partner).
    Q8_K,
}

impl WeightType {
    /// Bytes of one block (one element for the float types).
    pub fn block_bytes(self) -> usize {
        match self {
            WeightType::F32 => 4,
            WeightType::F16 => 2,
            WeightType::Q8_0 => Q8_0_BLOCK_BYTES,
            WeightType::Q4_0 => Q4_0_BLOCK_BYTES,
            WeightType::Q4_1 => Q4_1_BLOCK_BYTES,
            WeightType::Q5_0 => Q5_0_BLOCK_BYTES,
            WeightType::Q5_1 => Q5_1_BLOCK_BYTES,
            WeightType::Q4_K => Q4_K_BLOCK_BYTES,
            WeightType::Q5_K => Q5_K_BLOCK_BYTES,
            WeightType::Q6_K => Q6_K_BLOCK_BYTES,
        }
    }

    /// The K-quant layout of this type, if it is one.
    pub fn kquant(self) -> Option<KQuantType> {
        match self {
            WeightType::Q4_K => Some(KQuantType::Q4K),
            WeightType::Q5_K => Some(KQuantType::Q5K),
            WeightType::Q6_K => Some(KQuantType::Q6K),
            _ => None,
        }
    }

    /// Elements per block (1 for the float types).
    pub fn block_elems(self) -> usize {
        match self {
            WeightType::F32 | WeightType::F16 => 1,
            WeightType::Q8_0
            | WeightType::Q4_0
            | WeightType::Q4_1
            | WeightType::Q5_0
            | WeightType::Q5_1 => QK,
            WeightType::Q4_K | WeightType::Q5_K | WeightType::Q6_K => QK_K,
        }
    }

    /// Bytes of a row of `cols` elements; `cols` must be a multiple of `block_elems()`.
    pub fn row_bytes(self, cols: usize) -> usize {
        cols / self.block_elems() * self.block_bytes()
    }

    /// The activation type ggml pairs with this weight type in a matrix product.
    pub fn vec_dot_type(self) -> ActivationType {
        match self {
            WeightType::F32 => ActivationType::F32,
            WeightType::F16 => ActivationType::F16,
            WeightType::Q8_0 | WeightType::Q4_0 | WeightType::Q5_0 => ActivationType::Q8_0,
            WeightType::Q4_1 | WeightType::Q5_1 => ActivationType::Q8_1,
            WeightType::Q4_K | WeightType::Q5_K | WeightType::Q6_K => ActivationType::Q8_K,
        }
    }

    /// Checks that `cols` splits into whole blocks.
    pub fn check_cols(self, cols: usize) -> Result<(), KernelError> {
        let block = self.block_elems();
        if !cols.is_multiple_of(block) {
            return Err(KernelError::ColsNotBlockMultiple {
                ty: self,
                cols,
                block,
            });
        }
        Ok(())
    }
}

/// Reads a little-endian f16 at `at` as f32.
#[inline(always)]
pub(crate) fn read_f16(bytes: &[u8], at: usize) -> f32 {
    f16::from_le_bytes([bytes[at], bytes[at + 1]]).to_f32()
}

#[inline(always)]
fn write_f16(bytes: &mut [u8], at: usize, value: f32) {
    bytes[at..at + 2].copy_from_slice(&f16::from_f32(value).to_le_bytes());
}

/// One quantized block as ggml's AVX path computes it: the f32 scale `d` (before f16 rounding)
/// and the 32 int8 values.
#[inline(always)]
fn quantize_block(x: &[f32]) -> (f32, [i8; QK]) {
    // max is exact, so the reduction order is irrelevant.
    let amax = x.iter().fold(0.0f32, |acc, v| acc.max(v.abs()));
    let d = amax / 127.0;
    let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
    let mut qs = [0i8; QK];
    for (q, &v) in qs.iter_mut().zip(x) {
        // _mm256_round_ps(_MM_ROUND_NEAREST) rounds half to even; |v·id| <= 127 up to rounding.
        *q = (v * id).round_ties_even().clamp(-128.0, 127.0) as i8;
    }
    (d, qs)
}

/// Quantizes `x` (a multiple of 32 long) into Q8_0 blocks written to `out`
/// (`x.len() / 32 * 34` bytes).
pub fn quantize_row_q8_0(x: &[f32], out: &mut [u8]) {
    check_quant_lengths(x.len(), out.len(), Q8_0_BLOCK_BYTES);
    for (xb, ob) in x
        .chunks_exact(QK)
        .zip(out.chunks_exact_mut(Q8_0_BLOCK_BYTES))
    {
        let (d, qs) = quantize_block(xb);
        write_f16(ob, 0, d);
        for (o, q) in ob[2..].iter_mut().zip(qs) {
            *o = q as u8;
        }
    }
}

/// Quantizes `x` into Q8_1 blocks (`x.len() / 32 * 36` bytes); `s` is f16(d · Σq) with the f32 `d`.
pub fn quantize_row_q8_1(x: &[f32], out: &mut [u8]) {
    check_quant_lengths(x.len(), out.len(), Q8_1_BLOCK_BYTES);
    for (xb, ob) in x
        .chunks_exact(QK)
        .zip(out.chunks_exact_mut(Q8_1_BLOCK_BYTES))
    {
        let (d, qs) = quantize_block(xb);
        let sum: i32 = qs.iter().map(|&q| i32::from(q)).sum();
        write_f16(ob, 0, d);
        write_f16(ob, 2, d * sum as f32);
        for (o, q) in ob[4..].iter_mut().zip(qs) {
            *o = q as u8;
        }
    }
}

fn check_quant_lengths(x_len: usize, out_len: usize, block_bytes: usize) {
    assert!(
        x_len.is_multiple_of(QK),
        "quantize: {x_len} values is not a multiple of {QK}"
    );
    assert_eq!(
        out_len,
        x_len / QK * block_bytes,
        "quantize: output buffer has the wrong size"
    );
}

/// Converts one row of `ty` bytes into f32 (`out.len()` elements; used for embedding lookup).
pub fn dequantize_row(ty: WeightType, data: &[u8], out: &mut [f32]) -> Result<(), KernelError> {
    ty.check_cols(out.len())?;
    let expected = ty.row_bytes(out.len());
    if data.len() != expected {
        return Err(KernelError::DataSize {
            ty,
            rows: 1,
            cols: out.len(),
            expected,
            actual: data.len(),
        });
    }
    match ty {
        WeightType::F32 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        WeightType::F16 => {
            for (o, b) in out.iter_mut().zip(data.chunks_exact(2)) {
                *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        WeightType::Q8_0 => {
            for (ob, b) in out
                .chunks_exact_mut(QK)
                .zip(data.chunks_exact(Q8_0_BLOCK_BYTES))
            {
                let d = read_f16(b, 0);
                for (o, &q) in ob.iter_mut().zip(&b[2..]) {
                    *o = f32::from(q as i8) * d;
                }
            }
        }
        WeightType::Q4_0 => {
            for (ob, b) in out
                .chunks_exact_mut(QK)
                .zip(data.chunks_exact(Q4_0_BLOCK_BYTES))
            {
                let d = read_f16(b, 0);
                for (j, &q) in b[2..].iter().enumerate() {
                    ob[j] = f32::from((q & 0x0F) as i8 - 8) * d;
                    ob[j + QK / 2] = f32::from((q >> 4) as i8 - 8) * d;
                }
            }
        }
        WeightType::Q4_1 => {
            for (ob, b) in out
                .chunks_exact_mut(QK)
                .zip(data.chunks_exact(Q4_1_BLOCK_BYTES))
            {
                let d = read_f16(b, 0);
                let m = read_f16(b, 2);
                for (j, &q) in b[4..].iter().enumerate() {
                    // ggml writes `x*d + m`; GCC contracts it into one fused multiply-add.
                    ob[j] = f32::from(q & 0x0F).mul_add(d, m);
                    ob[j + QK / 2] = f32::from(q >> 4).mul_add(d, m);
                }
            }
        }
        WeightType::Q5_0 => {
            for (ob, b) in out
                .chunks_exact_mut(QK)
                .zip(data.chunks_exact(Q5_0_BLOCK_BYTES))
            {
                let d = read_f16(b, 0);
                for (o, q) in ob.iter_mut().zip(unpack_q5(&b[2..])) {
                    // d·(q − 16) is exact in f32 (11 × 5 significant bits).
                    *o = (q - 16) as f32 * d;
                }
            }
        }
        WeightType::Q5_1 => {
            for (ob, b) in out
                .chunks_exact_mut(QK)
                .zip(data.chunks_exact(Q5_1_BLOCK_BYTES))
            {
                let (d, m) = (read_f16(b, 0), read_f16(b, 2));
                for (o, q) in ob.iter_mut().zip(unpack_q5(&b[4..])) {
                    // d·q is exact, so only the addition rounds (FMA or not).
                    *o = (q as f32).mul_add(d, m);
                }
            }
        }
        // Sizes were checked above with the same block layout.
        WeightType::Q4_K => kquants::dequantize_blocks(KQuantType::Q4K, data, out),
        WeightType::Q5_K => kquants::dequantize_blocks(KQuantType::Q5K, data, out),
        WeightType::Q6_K => kquants::dequantize_blocks(KQuantType::Q6K, data, out),
    }
    Ok(())
}

/// The 32 values (0..32) of a Q5_0/Q5_1 block from its `qh` (4 bytes) and `qs` (16 bytes):
/// element `j` is nibble `j` (low nibbles first) plus bit `j` of `qh` as the fifth bit.
#[inline(always)]
pub(crate) fn unpack_q5(qh_qs: &[u8]) -> [i32; QK] {
    let qh = u32::from_le_bytes([qh_qs[0], qh_qs[1], qh_qs[2], qh_qs[3]]);
    let qs = &qh_qs[4..4 + QK / 2];
    std::array::from_fn(|j| {
        let nibble = if j < QK / 2 {
            qs[j] & 0x0F
        } else {
            qs[j - QK / 2] >> 4
        };
        i32::from(nibble) | (((qh >> j) & 1) << 4) as i32
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn q8_0_values(bytes: &[u8]) -> Vec<f32> {
        let mut out = vec![0.0; bytes.len() / Q8_0_BLOCK_BYTES * QK];
        dequantize_row(WeightType::Q8_0, bytes, &mut out).unwrap();
        out
    }

    #[test]
    fn q8_0_of_zero_block_is_all_zero() {
        let mut out = vec![0xAAu8; Q8_0_BLOCK_BYTES];
        quantize_row_q8_0(&[0.0; QK], &mut out);
        assert!(out.iter().all(|&b| b == 0));
    }

    #[test]
    fn q8_0_rounds_half_to_even() {
        // amax = 127 makes id exactly 1, so x·id keeps the .5 fractions.
        let mut x = [0.0f32; QK];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = 3.5;
        let mut out = vec![0u8; Q8_0_BLOCK_BYTES];
        quantize_row_q8_0(&x, &mut out);
        assert_eq!(
            out[2..6].iter().map(|&b| b as i8).collect::<Vec<_>>(),
            vec![127, 2, -2, 4]
        );
    }

    #[test]
    fn q8_1_sum_matches_quants() {
        let x: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
        let mut out = vec![0u8; 2 * Q8_1_BLOCK_BYTES];
        quantize_row_q8_1(&x, &mut out);
        for b in out.chunks_exact(Q8_1_BLOCK_BYTES) {
            let d = read_f16(b, 0);
            let sum: i32 = b[4..].iter().map(|&q| i32::from(q as i8)).sum();
            let s = read_f16(b, 2);
            assert!((s - d * sum as f32).abs() <= (d * sum as f32).abs() * 1e-3 + 1e-6);
        }
    }

    #[test]
    fn q4_layouts_dequantize_nibbles_in_ggml_order() {
        let mut b0 = vec![0u8; Q4_0_BLOCK_BYTES];
        b0[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b0[2] = 0x1F; // element 0 = 15, element 16 = 1
        let mut out = [0.0; QK];
        dequantize_row(WeightType::Q4_0, &b0, &mut out).unwrap();
        assert_eq!((out[0], out[16], out[1]), (3.5, -3.5, -4.0));

        let mut b1 = vec![0u8; Q4_1_BLOCK_BYTES];
        b1[0..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        b1[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        b1[4] = 0x30; // element 0 = 0, element 16 = 3
        dequantize_row(WeightType::Q4_1, &b1, &mut out).unwrap();
        assert_eq!((out[0], out[16]), (-1.0, 5.0));
    }

    #[test]
    fn q5_layouts_take_the_fifth_bit_from_qh() {
        let mut b0 = vec![0u8; Q5_0_BLOCK_BYTES];
        b0[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        // qh bit 0 (element 0) and bit 17 (element 17); qs[1] = 0x30: element 1 = 0, 17 = 3.
        b0[2..6].copy_from_slice(&(1u32 | 1 << 17).to_le_bytes());
        b0[6 + 1] = 0x30;
        let mut out = [0.0; QK];
        dequantize_row(WeightType::Q5_0, &b0, &mut out).unwrap();
        assert_eq!((out[0], out[1], out[17], out[16]), (0.0, -8.0, 1.5, -8.0));

        let mut b1 = vec![0u8; Q5_1_BLOCK_BYTES];
        b1[0..2].copy_from_slice(&f16::from_f32(2.0).to_le_bytes());
        b1[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        b1[4..8].copy_from_slice(&(1u32 << 31).to_le_bytes());
        b1[8 + 15] = 0xF0; // element 31 = 15 + 16
        dequantize_row(WeightType::Q5_1, &b1, &mut out).unwrap();
        assert_eq!((out[0], out[31], out[15]), (-1.0, 61.0, -1.0));
    }

    #[test]
    fn dequantize_rejects_wrong_sizes() {
        let mut out = [0.0; 32];
        assert!(matches!(
            dequantize_row(WeightType::Q8_0, &[0u8; 33], &mut out),
            Err(KernelError::DataSize { .. })
        ));
        let mut odd = [0.0; 31];
        assert!(matches!(
            dequantize_row(WeightType::Q4_1, &[0u8; 20], &mut odd),
            Err(KernelError::ColsNotBlockMultiple { .. })
        ));
    }

    #[test]
    fn row_bytes_match_block_sizes() {
        assert_eq!(WeightType::Q4_1.row_bytes(576), 18 * 20);
        assert_eq!(WeightType::Q8_0.row_bytes(576), 18 * 34);
        assert_eq!(WeightType::Q4_0.row_bytes(64), 36);
        assert_eq!(WeightType::F16.row_bytes(7), 14);
        assert_eq!(WeightType::F32.row_bytes(7), 28);
    }

    proptest! {
        #[test]
        fn q8_0_round_trip_error_is_within_half_step(
            x in proptest::collection::vec(-100.0f32..100.0, 1..4).prop_flat_map(|v| {
                let n = v.len() * QK;
                proptest::collection::vec(-100.0f32..100.0, n)
            })
        ) {
            let mut q = vec![0u8; x.len() / QK * Q8_0_BLOCK_BYTES];
            quantize_row_q8_0(&x, &mut q);
            let y = q8_0_values(&q);
            for (xb, yb) in x.chunks(QK).zip(y.chunks(QK)) {
                let amax = xb.iter().fold(0.0f32, |a, v| a.max(v.abs()));
                let d = amax / 127.0;
                // Half a quantization step plus the f16 rounding of d (relative 2^-11 of |q|·d).
                let tol = d * 0.5 + amax * 1.0e-3 + 1e-6;
                for (a, b) in xb.iter().zip(yb) {
                    prop_assert!((a - b).abs() <= tol, "{a} vs {b} (tol {tol})");
                }
            }
        }

        #[test]
        fn q8_1_quants_equal_q8_0_quants(x in proptest::collection::vec(-10.0f32..10.0, 64)) {
            let mut a = vec![0u8; 2 * Q8_0_BLOCK_BYTES];
            let mut b = vec![0u8; 2 * Q8_1_BLOCK_BYTES];
            quantize_row_q8_0(&x, &mut a);
            quantize_row_q8_1(&x, &mut b);
            for (ba, bb) in a.chunks(Q8_0_BLOCK_BYTES).zip(b.chunks(Q8_1_BLOCK_BYTES)) {
                prop_assert_eq!(&ba[0..2], &bb[0..2]);
                prop_assert_eq!(&ba[2..], &bb[4..]);
            }
        }
    }
}
