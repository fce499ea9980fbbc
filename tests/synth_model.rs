//! `kvgate synth-model` through the real binary: the README's example (write a tiny model,
//! generate from it) works, the same seed writes the same file, and bad arguments get one
//! clear error line.

use std::path::Path;
use std::process::{Command, Output};

use tempfile::TempDir;

fn kvgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(args)
        .output()
        .expect("the kvgate binary runs")
}

/// A fresh dir for a test's model files, removed with them when the guard drops.
fn temp_dir() -> TempDir {
    tempfile::Builder::new()
        .prefix("kvgate-synth-cli-")
        .tempdir()
        .expect("temp dir")
}

/// The README's command: `kvgate synth-model --shape tiny --dtype q4_1 --seed 1 OUT`.
fn synth_tiny_seed_1(out: &str) -> Output {
    kvgate(&[
        "synth-model",
        "--shape",
        "tiny",
        "--dtype",
        "q4_1",
        "--seed",
        "1",
        out,
    ])
}

#[test]
fn readme_example_writes_a_tiny_model_and_generates_from_it() {
    let dir = temp_dir();
    let model = dir.path().join("tiny.gguf");
    let model = model.to_str().expect("utf-8 temp path");
    let out = synth_tiny_seed_1(model);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary = String::from_utf8_lossy(&out.stdout);
    assert!(summary.contains("synthetic tiny q4_1 seed 1"), "{summary}");

    let out = kvgate(&[
        "generate",
        "--model",
        model,
        "--raw",
        "--max-tokens",
        "8",
        "--threads",
        "1",
        "hello",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.stdout.is_empty(),
        "random weights still generate tokens"
    );

    let again = dir.path().join("again.gguf");
    let again = again.to_str().expect("utf-8 temp path");
    let out = synth_tiny_seed_1(again);
    assert!(out.status.success());
    assert!(
        std::fs::read(model).expect("read") == std::fs::read(again).expect("read"),
        "the same seed writes the same bytes"
    );
}

#[test]
fn bad_arguments_are_one_clear_error_line() {
    let out = kvgate(&["synth-model", "--shape", "llama3", "x.gguf"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("unknown shape `llama3`") && err.contains("llama2-13b"),
        "{err}"
    );

    let out = kvgate(&["synth-model", "--shape", "tiny", "/nonexistent/dir/x.gguf"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("kvgate: error: cannot write /nonexistent/dir/x.gguf: "),
        "{err}"
    );
}

/// Overwrites the `N` bytes that follow `marker` (plus `skip`) in `bytes`.
fn patch<const N: usize>(bytes: &mut [u8], marker: &str, skip: usize, value: [u8; N]) {
    let at = bytes
        .windows(marker.len())
        .position(|w| w == marker.as_bytes())
        .unwrap_or_else(|| panic!("`{marker}` is in the header"))
        + marker.len()
        + skip;
    bytes[at..at + N].copy_from_slice(&value);
}

/// `kvgate generate` on `bytes` (written to `name` in `dir`): fails with one line containing
/// `expected`.
fn generate_refuses(dir: &Path, name: &str, bytes: &[u8], expected: &str) {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write patched model");
    let path = path.to_str().expect("utf-8 temp path");
    let out = kvgate(&[
        "generate",
        "--model",
        path,
        "--raw",
        "--max-tokens",
        "4",
        "--threads",
        "1",
        "hello",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "{name}: exit 0, stdout {:?}",
        out.stdout
    );
    assert!(out.stdout.is_empty(), "{name}: {:?}", out.stdout);
    assert_eq!(err.trim_end().lines().count(), 1, "{name}: {err}");
    assert!(err.contains(expected), "{name}: {err}");
}

#[test]
fn malformed_model_files_are_refused_with_one_line_naming_the_cause() {
    let dir = temp_dir();
    let model = dir.path().join("tiny-malformed-base.gguf");
    let out = synth_tiny_seed_1(model.to_str().expect("utf-8 temp path"));
    assert!(out.status.success());
    let good = std::fs::read(&model).expect("read model");
    // The tiny shape's vocabulary size (`llama.vocab_size`), which the errors below name.
    let vocab = 512u32;

    // token_embd.weight is the first tensor (data offset 0): name, 2 dims (u32 + 2 u64), type
    // (u32), then its offset (u64). Offset 3 is not a multiple of the default alignment 32.
    let mut bytes = good.clone();
    patch(
        &mut bytes,
        "token_embd.weight",
        4 + 16 + 4,
        3u64.to_le_bytes(),
    );
    generate_refuses(
        dir.path(),
        "misaligned.gguf",
        &bytes,
        "tensor `token_embd.weight` starts at data offset 3, which is not a multiple of the alignment 32",
    );

    // add_bos_token (a bool: u32 type, one byte) switched on, BOS id (u32 type, u32) moved out.
    for bos in [vocab, u32::MAX] {
        let mut bytes = good.clone();
        patch(&mut bytes, "tokenizer.ggml.add_bos_token", 4, [1u8]);
        patch(
            &mut bytes,
            "tokenizer.ggml.bos_token_id",
            4,
            bos.to_le_bytes(),
        );
        generate_refuses(
            dir.path(),
            &format!("bos-{bos}.gguf"),
            &bytes,
            &format!(
                "tokenizer.ggml.bos_token_id is {bos}, outside the vocabulary of {vocab} tokens"
            ),
        );
    }
    let mut bytes = good.clone();
    patch(
        &mut bytes,
        "tokenizer.ggml.eos_token_id",
        4,
        vocab.to_le_bytes(),
    );
    generate_refuses(
        dir.path(),
        "eos.gguf",
        &bytes,
        &format!(
            "tokenizer.ggml.eos_token_id is {vocab}, outside the vocabulary of {vocab} tokens"
        ),
    );
}
