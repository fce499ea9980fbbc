//! K-quant conformance against an independent reference: the PyPI `gguf` package's NumPy
//! dequantization (and a NumPy transcription of ggml's Q8_K quantizer), captured in
//! tests/fixtures/kquants by scripts/kquant-fixtures.py.

use kvgate_kernels::dot::{dot_q4_k_q8_k, dot_q5_k_q8_k, dot_q6_k_q8_k};
use kvgate_kernels::quant::{
    KQuantType, Q8_K_BLOCK_BYTES, QK_K, dequantize_row_k, quantize_row_q8_k,
};

struct Fixture {
    ty: KQuantType,
    blocks: &'static [u8],
    values: &'static [u8],
    dot: fn(&[u8], &[u8]) -> f32,
}

macro_rules! fixture {
    ($ty:expr, $name:literal, $dot:expr) => {
        Fixture {
            ty: $ty,
            blocks: include_bytes!(concat!("../../tests/fixtures/kquants/", $name, ".blocks")),
            values: include_bytes!(concat!("../../tests/fixtures/kquants/", $name, ".f32")),
            dot: $dot,
        }
    };
}

fn fixtures() -> [Fixture; 3] {
    [
        fixture!(KQuantType::Q4K, "q4_k", dot_q4_k_q8_k),
        fixture!(KQuantType::Q5K, "q5_k", dot_q5_k_q8_k),
        fixture!(KQuantType::Q6K, "q6_k", dot_q6_k_q8_k),
    ]
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn dequantization_matches_gguf_numpy_bit_for_bit() {
    for f in fixtures() {
        let expected = f32s(f.values);
        assert_eq!(f.blocks.len() / f.ty.block_bytes() * QK_K, expected.len());
        let mut got = vec![0.0f32; expected.len()];
        dequantize_row_k(f.ty, f.blocks, &mut got).unwrap();
        let mismatches: Vec<_> = got
            .iter()
            .zip(&expected)
            .enumerate()
            .filter(|(_, (a, b))| a.to_bits() != b.to_bits())
            .collect();
        assert!(
            mismatches.is_empty(),
            "{:?}: {} of {} values differ, first {:?}",
            f.ty,
            mismatches.len(),
            expected.len(),
            mismatches.first()
        );
    }
}

#[test]
fn q8_k_quantization_matches_ggml_reference_transcription() {
    let x = f32s(include_bytes!("../../tests/fixtures/kquants/q8_k.in.f32"));
    let expected: &[u8] = include_bytes!("../../tests/fixtures/kquants/q8_k.blocks");
    let mut got = vec![0u8; x.len() / QK_K * Q8_K_BLOCK_BYTES];
    quantize_row_q8_k(&x, &mut got);
    for (i, (g, e)) in got
        .chunks_exact(Q8_K_BLOCK_BYTES)
        .zip(expected.chunks_exact(Q8_K_BLOCK_BYTES))
        .enumerate()
    {
        assert_eq!(g, e, "Q8_K block {i} differs");
    }
}

#[test]
fn dots_over_fixture_blocks_match_f64_sum_of_reference_values() {
    // The weights' values come from the reference (not from kvgate's dequantization), so this
    // checks the dot products' unpacking independently. The activation row is quantized from
    // the Q8_K fixture input, repeated to the weights' length.
    let x_in = f32s(include_bytes!("../../tests/fixtures/kquants/q8_k.in.f32"));
    for f in fixtures() {
        let w_values = f32s(f.values);
        let n = w_values.len();
        let x: Vec<f32> = x_in.iter().cycle().take(n).copied().collect();
        let mut xq = vec![0u8; n / QK_K * Q8_K_BLOCK_BYTES];
        quantize_row_q8_k(&x, &mut xq);
        // Per block, so that the wide-range (any finite f16 scale) blocks are checked against
        // their own magnitude rather than drowned by their neighbours.
        for (b, (wb, xb)) in f
            .blocks
            .chunks_exact(f.ty.block_bytes())
            .zip(xq.chunks_exact(Q8_K_BLOCK_BYTES))
            .enumerate()
        {
            let d = f64::from(f32::from_le_bytes([xb[0], xb[1], xb[2], xb[3]]));
            let (exact, magnitude) = w_values[b * QK_K..(b + 1) * QK_K]
                .iter()
                .zip(&xb[4..4 + QK_K])
                .map(|(&w, &q)| f64::from(w) * d * f64::from(q as i8))
                .fold((0.0, 0.0), |(s, m), p: f64| (s + p, m + p.abs()));
            let got = f64::from((f.dot)(wb, xb));
            let tol = magnitude * 2f64.powi(-20);
            assert!(
                (got - exact).abs() <= tol,
                "{:?} block {b}: {got} vs {exact} (tol {tol:e})",
                f.ty
            );
        }
    }
}

#[test]
fn q5_0_and_q5_1_dequantization_match_gguf_numpy_bit_for_bit() {
    use kvgate_kernels::quant::{WeightType, dequantize_row};
    let cases: [(WeightType, &[u8], &[u8]); 2] = [
        (
            WeightType::Q5_0,
            include_bytes!("../../tests/fixtures/kquants/q5_0.blocks"),
            include_bytes!("../../tests/fixtures/kquants/q5_0.f32"),
        ),
        (
            WeightType::Q5_1,
            include_bytes!("../../tests/fixtures/kquants/q5_1.blocks"),
            include_bytes!("../../tests/fixtures/kquants/q5_1.f32"),
        ),
    ];
    for (ty, blocks, values) in cases {
        let expected = f32s(values);
        assert_eq!(
            blocks.len() / ty.block_bytes() * 32,
            expected.len(),
            "{ty:?}"
        );
        let mut got = vec![0.0f32; expected.len()];
        dequantize_row(ty, blocks, &mut got).unwrap();
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(g.to_bits(), e.to_bits(), "{ty:?} value {i}: {g} vs {e}");
        }
    }
}
