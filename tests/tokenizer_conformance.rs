//! Tokenizer conformance with llama.cpp's own test vectors, and the chat templates of the model
//! families those vocabularies belong to.
//!
//! llama.cpp ships vocabulary-only GGUF files (`models/ggml-vocab-*.gguf`: no weights) with
//! test inputs (`.inp`, separated by `\n__ggml_vocab_test__\n`) and the token ids llama.cpp and
//! the model's Hugging Face tokenizer produce for them (`.out`, one line per input), as its
//! `tests/test-tokenizer-0.cpp` reads them: `llama_tokenize(text, add_special = false,
//! parse_special = false)`. They come from the PyPI sdist llama-cpp-python==0.3.36, which
//! `scripts/fetch-llama-cpp-vocab.py` (run by scripts/test.sh) unpacks into the model cache.
//! Without it these tests skip with a note, and fail under `KVGATE_REQUIRE_MODEL=1` (CI).

mod common;

use common::process::{run, scratch_dir};
use kvgate_runtime::chat_template::{ChatMessage, ChatTemplate};
use kvgate_runtime::gguf::GgufFile;
use kvgate_runtime::provision::{REQUIRE_MODEL_ENV, cache_dir};
use kvgate_runtime::tokenizer::Tokenizer;
use std::path::PathBuf;

/// Where scripts/fetch-llama-cpp-vocab.py puts llama.cpp's `models/` folder.
const SDIST_DIR: &str = "llama-cpp-python-0.3.36";

/// llama.cpp's `models/` folder, or `None` (after a note) when it has not been fetched.
fn models_dir() -> Option<PathBuf> {
    let dir = match cache_dir() {
        Ok(cache) => cache.join(SDIST_DIR).join("models"),
        Err(e) => panic!("no model cache: {e}"),
    };
    if dir.is_dir() {
        return Some(dir);
    }
    assert!(
        std::env::var(REQUIRE_MODEL_ENV).as_deref() != Ok("1"),
        "{REQUIRE_MODEL_ENV}=1 but {} is missing: run scripts/fetch-llama-cpp-vocab.py",
        dir.display()
    );
    eprintln!(
        "skipping: {} is missing (python3 scripts/fetch-llama-cpp-vocab.py fetches it)",
        dir.display()
    );
    None
}

fn vocab_path(models: &std::path::Path, name: &str) -> PathBuf {
    models.join(format!("ggml-vocab-{name}.gguf"))
}

fn tokenizer(models: &std::path::Path, name: &str) -> Tokenizer {
    let path = vocab_path(models, name);
    let gguf = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The (input, expected ids) pairs of `ggml-vocab-NAME.gguf`, read as test-tokenizer-0.cpp
/// reads them.
fn vectors(models: &std::path::Path, name: &str) -> Vec<(String, Vec<u32>)> {
    let base = vocab_path(models, name);
    let read = |ext: &str| {
        let path = PathBuf::from(format!("{}.{ext}", base.display()));
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    };
    let (inputs, outputs) = (read("inp"), read("out"));
    let mut texts: Vec<&str> = inputs.split("\n__ggml_vocab_test__\n").collect();
    // The file ends with a separator: the last piece is empty and not a test.
    if texts.last() == Some(&"") {
        texts.pop();
    }
    let expected: Vec<Vec<u32>> = outputs
        .lines()
        .map(|line| {
            line.split_whitespace()
                .map(|id| id.parse().expect("token id"))
                .collect()
        })
        .collect();
    assert_eq!(
        texts.len(),
        expected.len(),
        "{name}: .inp and .out disagree"
    );
    texts
        .into_iter()
        .map(str::to_string)
        .zip(expected)
        .collect()
}

/// Encodes every vector of `name`; prints the count and fails listing every mismatch.
fn assert_conformance(name: &str, min_vectors: usize) {
    let Some(models) = models_dir() else { return };
    let t = tokenizer(&models, name);
    let vectors = vectors(&models, name);
    assert!(
        vectors.len() >= min_vectors,
        "{name}: only {} vectors",
        vectors.len()
    );
    let mismatches: Vec<String> = vectors
        .iter()
        .filter_map(|(text, expected)| {
            let ids = t.encode(text, false);
            (&ids != expected)
                .then(|| format!("{text:?}\n  kvgate    {ids:?}\n  llama.cpp {expected:?}"))
        })
        .collect();
    eprintln!(
        "ggml-vocab-{name}: {}/{} llama.cpp vectors match",
        vectors.len() - mismatches.len(),
        vectors.len()
    );
    assert!(
        mismatches.is_empty(),
        "ggml-vocab-{name}: {} of {} vectors differ:\n{}",
        mismatches.len(),
        vectors.len(),
        mismatches.join("\n")
    );
}

#[test]
fn llama_spm_matches_every_llama_cpp_vector() {
    assert_conformance("llama-spm", 30);
}

#[test]
fn phi_3_matches_every_llama_cpp_vector() {
    assert_conformance("phi-3", 30);
}

#[test]
fn llama_bpe_matches_every_llama_cpp_vector() {
    assert_conformance("llama-bpe", 30);
}

#[test]
fn qwen2_matches_every_llama_cpp_vector() {
    assert_conformance("qwen2", 30);
}

#[test]
fn gpt_2_matches_every_llama_cpp_vector() {
    assert_conformance("gpt-2", 30);
}
