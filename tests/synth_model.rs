//! `kvgate synth-model` through the real binary: the README's example (write a tiny model,
//! generate from it) works, the same seed writes the same file, and bad arguments get one
//! clear error line.

use std::path::PathBuf;
use std::process::{Command, Output};

fn kvgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvgate"))
        .args(args)
        .output()
        .expect("the kvgate binary runs")
}

fn temp_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvgate-synth-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
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
    let model = dir.join("tiny.gguf");
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

    let again = dir.join("again.gguf");
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
        err.contains("cannot write /nonexistent/dir/x.gguf.partial"),
        "{err}"
    );
}
