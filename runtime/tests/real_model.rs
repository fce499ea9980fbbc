//! The real default model: its config, error handling for damaged files, and the paged
//! forward pass (finite logits; chunked prefill equals one-shot prefill).

mod common;

use std::sync::Arc;

use common::{Part, backend, model_path, open_model, step};
use kvgate_runtime::gguf::GgufFile;
use kvgate_runtime::loader::{LoadError, Runtime, RuntimeOptions};

#[test]
fn config_is_read_from_the_real_file() {
    let (gguf, config) = open_model();
    assert_eq!(config.architecture, "llama");
    assert_eq!(config.num_layers, 30);
    assert_eq!(config.hidden_size, 576);
    assert_eq!(config.ffn_size, 1536);
    assert_eq!(config.num_heads, 9);
    assert_eq!(config.num_kv_heads, 3);
    assert_eq!(config.head_dim, 64);
    assert_eq!(config.rope_dim, 64);
    assert_eq!(config.vocab_size, 49152);
    assert_eq!(config.context_length, 8192);
    assert_eq!(config.rope_freq_base, 100_000.0);
    assert!((config.rms_eps - 1e-5).abs() < 1e-9);
    assert!(
        config.tied_embeddings,
        "SmolLM2 ties the output head to the embedding"
    );
    // 30 layers × K,V × 3 heads × 64 × 2 bytes.
    assert_eq!(config.kv_shape().bytes_per_token(), 23_040);
    assert!(gguf.tensor_bytes() > 90_000_000);
}

/// `bytes` written to `name` in `dir`.
fn temp_copy(dir: &tempfile::TempDir, name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let path = dir.path().join(name);
    std::fs::write(&path, bytes).expect("write temp model");
    path
}

#[test]
fn truncated_or_corrupt_files_fail_with_clear_errors() {
    // Removed with the copies in it when the test ends (they are up to 48 MB).
    let dir = tempfile::Builder::new()
        .prefix("kvgate-real-model-")
        .tempdir()
        .expect("temp dir");
    let bytes = std::fs::read(model_path()).expect("read model");
    let truncated = temp_copy(&dir, "truncated.gguf", &bytes[..bytes.len() / 2]);
    let err = Runtime::start(&truncated, RuntimeOptions::default())
        .err()
        .expect("half a model must not load");
    assert!(matches!(err, LoadError::Gguf(_)), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains("truncated") && msg.contains("extends past the end"),
        "{msg}"
    );

    let mut garbage = bytes[..4096].to_vec();
    garbage[..4].copy_from_slice(b"GGML");
    let corrupt = temp_copy(&dir, "corrupt.gguf", &garbage);
    let err = Runtime::start(&corrupt, RuntimeOptions::default())
        .err()
        .expect("bad magic must not load");
    assert!(err.to_string().contains("not a GGUF file"), "{err}");

    let header_only = temp_copy(&dir, "header.gguf", &bytes[..100_000]);
    let err = GgufFile::open(&header_only).expect_err("cut inside the metadata");
    assert!(err.to_string().contains("truncated"), "{err}");
}

#[test]
fn kv_budget_below_one_block_is_refused() {
    let opts = RuntimeOptions {
        kv_memory_bytes: 1000,
        ..RuntimeOptions::default()
    };
    let err = Runtime::start(&model_path(), opts)
        .err()
        .expect("1000 bytes hold no block");
    assert!(matches!(err, LoadError::KvBudgetTooSmall { .. }), "{err}");
}

#[test]
fn a_single_token_gives_finite_logits() {
    let mut be = backend(4, 2);
    let logits = step(
        &mut be,
        &[Part {
            tokens: &[1],
            start: 0,
            blocks: &[3],
        }],
    );
    assert_eq!(logits.len(), 1);
    assert_eq!(logits[0].len(), 49152);
    assert!(logits[0].iter().all(|v| v.is_finite()));
    let spread = logits[0].iter().cloned().fold(f32::MIN, f32::max)
        - logits[0].iter().cloned().fold(f32::MAX, f32::min);
    assert!(spread > 1.0, "logits are not all alike");
}

/// "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
/// preceded by the default system prompt (llama.cpp's tokenization, from the fixtures).
const PROMPT: [u32; 37] = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
    19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531,
    198,
];

#[test]
fn prefill_in_one_chunk_several_chunks_or_token_by_token_agrees() {
    let blocks = [7, 2, 5];
    let mut whole = backend(8, 2);
    let one = step(
        &mut whole,
        &[Part {
            tokens: &PROMPT,
            start: 0,
            blocks: &blocks,
        }],
    )
    .remove(0);

    let mut chunked = backend(8, 2);
    let mut last = Vec::new();
    for (start, end) in [(0, 16), (16, 23), (23, 37)] {
        last = step(
            &mut chunked,
            &[Part {
                tokens: &PROMPT[start..end],
                start,
                blocks: &blocks,
            }],
        )
        .remove(0);
    }
    assert_eq!(
        one, last,
        "chunks of 2+ tokens take the same arithmetic as one chunk"
    );

    let mut single = backend(8, 1);
    for pos in 0..PROMPT.len() {
        last = step(
            &mut single,
            &[Part {
                tokens: &PROMPT[pos..=pos],
                start: pos,
                blocks: &blocks,
            }],
        )
        .remove(0);
    }
    // Single-token steps too (decode, a prefix-cache hit leaving one token, a chunk of one):
    // every row sums attention in one order whatever its step holds, so a sequence's numbers
    // do not depend on how it was split into steps.
    assert_eq!(one, last, "token by token changed the logits");
}

#[test]
fn the_thread_count_does_not_change_results() {
    let blocks = [0, 1, 2];
    let one = step(
        &mut backend(4, 1),
        &[Part {
            tokens: &PROMPT,
            start: 0,
            blocks: &blocks,
        }],
    );
    let two = step(
        &mut backend(4, 2),
        &[Part {
            tokens: &PROMPT,
            start: 0,
            blocks: &blocks,
        }],
    );
    assert_eq!(one, two);
}

#[test]
fn the_runtime_reports_its_memory_and_pool() {
    let runtime = Runtime::start(
        &model_path(),
        RuntimeOptions {
            threads: Some(2),
            ..RuntimeOptions::default()
        },
    )
    .expect("runtime starts");
    assert_eq!(runtime.model_name, "SmolLM2-135M-Instruct.Q4_1");
    // 256 MiB / (23040 B × 16) = 728 whole blocks.
    assert_eq!(runtime.num_blocks, 728);
    assert_eq!(runtime.memory.kv_bytes, 728 * 16 * 23_040);
    assert!(runtime.memory.weights_bytes > 90_000_000);
    assert_eq!(runtime.engine.pool().total_blocks(), 728);
    let _ = Arc::clone(&runtime.tokenizer);
    runtime.engine.shutdown();
}
