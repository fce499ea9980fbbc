//! The Q4_K_M requantization of the default model (what `llama-quantize --allow-requantize`
//! writes): kvgate's quantizer must write llama.cpp's file byte for byte, and greedy decoding on
//! it must follow llama.cpp's under the margin-aware rule of llama_cpp_parity.rs. Fixture:
//! tests/fixtures/llama_cpp/q4km_greedy.json (gen_q4km_fixtures.py: llama.cpp's quantizer and
//! greedy run, file and per-tensor SHA-256).
//!
//! The file is mostly fallback types, which is the point: SmolLM2's 576-wide rows are not whole
//! 256-value super-blocks, so llama.cpp stores them as Q5_0 (for Q4_K) and Q8_0 (for Q6_K);
//! only the 1536-wide ffn_down rows are real Q4_K/Q6_K.

mod common;

use std::path::PathBuf;
use std::sync::OnceLock;

use kvgate_runtime::requant::{QuantMix, QuantizeReport, quantize_file};
use sha2::{Digest, Sha256};

use common::{assert_first_step_close, assert_greedy_matches, backend_at, model_path};

/// llama_cpp_parity.rs's threshold: a divergence is accepted where llama.cpp's top-2 margin is
/// below this, or below [`self_flip_margin`] when that is larger.
const MAX_MARGIN_FOR_DIVERGENCE: f64 = 0.1;
/// Bound on one first-step logit's distance from llama.cpp's, and on the mean: as in
/// llama_cpp_parity.rs.
const LOGIT_TOLERANCE: f32 = 0.75;
const MEAN_LOGIT_TOLERANCE: f64 = 0.25;

/// The largest top-2 margin at which llama.cpp disagrees with itself on this file: the fixture
/// records, per greedy step, llama.cpp's pick when it evaluates the same context as one batch
/// instead of token by token (`batched_ids`). The two orders round the 8-bit activation blocks
/// differently, and that noise is the same kind that separates kvgate from llama.cpp (each
/// engine sums its quantized products in its own order). Measured on this file: 6 flips, at
/// margins 0.025..0.164; on the Q4_1 file of llama_cpp_parity.rs every divergence stays under
/// 0.1, so that test keeps 0.1.
fn self_flip_margin() -> f64 {
    let mut worst = 0.0f64;
    for case in fixtures()["cases"].as_array().expect("cases") {
        let ids = common::json_ids(&case["greedy_ids"]);
        let batched = common::json_ids(&case["batched_ids"]);
        let margins = case["top2_margins"].as_array().expect("margins");
        for (i, (a, b)) in ids.iter().zip(&batched).enumerate() {
            if a != b {
                worst = worst.max(margins[i].as_f64().expect("a margin"));
            }
        }
    }
    worst
}

fn max_margin() -> f64 {
    MAX_MARGIN_FOR_DIVERGENCE.max(self_flip_margin())
}

fn fixtures() -> &'static serde_json::Value {
    static F: OnceLock<serde_json::Value> = OnceLock::new();
    F.get_or_init(|| common::llama_cpp_fixture("q4km_greedy.json"))
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Writes the requantization next to the default model once per test run (the cached file is
/// what `kvgate bench` and scripts/test.sh use too); returns its path, bytes and directory.
fn requantized() -> &'static (PathBuf, Vec<u8>, QuantizeReport) {
    static FILE: OnceLock<(PathBuf, Vec<u8>, QuantizeReport)> = OnceLock::new();
    FILE.get_or_init(|| {
        let input = model_path();
        let source = std::fs::read(&input).expect("the default model reads");
        assert_eq!(
            sha256_hex(&source),
            fixtures()["source_sha256"].as_str().expect("source_sha256"),
            "the default model is not the file the fixture was generated from"
        );
        let out = input.with_file_name("SmolLM2-135M-Instruct.Q4_K_M.gguf");
        let report = quantize_file(&input, &out, QuantMix::Q4_K_M)
            .unwrap_or_else(|e| panic!("quantize: {e}"));
        let bytes = std::fs::read(&out).expect("the written file reads");
        (out, bytes, report)
    })
}

#[test]
fn requantization_is_llama_cpps_file_byte_for_byte() {
    let (_, bytes, report) = requantized();
    let want = fixtures()["tensors"].as_array().expect("tensors");
    assert_eq!(report.tensors.len(), want.len(), "tensor count");
    let mut differ = Vec::new();
    for (got, want) in report.tensors.iter().zip(want) {
        assert_eq!(
            got.name,
            want["name"].as_str().expect("name"),
            "tensor order"
        );
        assert_eq!(
            got.to.name(),
            want["type"].as_str().expect("type"),
            "{}: tensor type",
            got.name
        );
        let data = &bytes[got.offset as usize..(got.offset + got.len) as usize];
        if sha256_hex(data) != want["sha256"].as_str().expect("sha256") {
            differ.push(got.name.clone());
        }
    }
    assert!(differ.is_empty(), "tensors whose bytes differ: {differ:?}");
    assert_eq!(
        bytes.len() as u64,
        fixtures()["model_bytes"].as_u64().expect("size")
    );
    assert_eq!(
        sha256_hex(bytes),
        fixtures()["model_sha256"].as_str().expect("model_sha256"),
        "the tensors match but the header does not"
    );
    let requantized = report.tensors.iter().filter(|t| t.from != t.to).count();
    println!(
        "{} tensors identical, {requantized} requantized",
        report.tensors.len()
    );
}

#[test]
fn greedy_on_the_q4_k_m_file_matches_llama_cpp() {
    let (path, _, _) = requantized();
    let mut be = backend_at(path, 64, 2);
    let report = assert_greedy_matches(&mut be, fixtures(), max_margin());
    println!("threshold {:.3}\n{}", max_margin(), report.join("\n"));
}

#[test]
fn first_step_logits_on_the_q4_k_m_file_are_close_to_llama_cpp() {
    let (path, _, _) = requantized();
    let mut be = backend_at(path, 64, 2);
    let mean = assert_first_step_close(&mut be, fixtures(), LOGIT_TOLERANCE, max_margin());
    println!("first-step logits: mean |deviation| {mean:.3}");
    assert!(
        mean < MEAN_LOGIT_TOLERANCE,
        "mean logit deviation {mean:.3}"
    );
}
