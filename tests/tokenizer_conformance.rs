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

use common::process::{one_error_line, run, scratch_dir};
use kvgate_runtime::chat_template::{ChatMessage, ChatTemplate};
use kvgate_runtime::gguf::GgufFile;
use kvgate_runtime::provision::{REQUIRE_MODEL_ENV, cache_dir};
use kvgate_runtime::tokenizer::Tokenizer;
use std::path::{Path, PathBuf};

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

fn vocab_path(models: &Path, name: &str) -> PathBuf {
    models.join(format!("ggml-vocab-{name}.gguf"))
}

fn tokenizer(models: &Path, name: &str) -> Tokenizer {
    let path = vocab_path(models, name);
    let gguf = GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The (input, expected ids) pairs of `ggml-vocab-NAME.gguf`, read as test-tokenizer-0.cpp
/// reads them.
fn vectors(models: &Path, name: &str) -> Vec<(String, Vec<u32>)> {
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

/// Decoding gives the text back: byte-level BPE exactly, SentencePiece with the leading space
/// its `add_space_prefix` rule added (every character is a piece or byte-fallback bytes; empty
/// text has no fragment to prefix, as in llama.cpp).
#[test]
fn every_vector_decodes_back_to_its_text() {
    let Some(models) = models_dir() else { return };
    for (name, prefix) in [
        ("llama-spm", " "),
        ("phi-3", " "),
        ("llama-bpe", ""),
        ("qwen2", ""),
        ("gpt-2", ""),
    ] {
        let t = tokenizer(&models, name);
        for (text, expected) in vectors(&models, name) {
            let prefix = if text.is_empty() { "" } else { prefix };
            assert_eq!(
                t.decode(&expected),
                format!("{prefix}{text}"),
                "ggml-vocab-{name}: decoding llama.cpp's ids of {text:?}"
            );
        }
    }
}

/// `kvgate tokenize FLAGS --model ggml-vocab-NAME.gguf TEXT`, run in `home`.
fn kvgate_tokenize(
    models: &Path,
    name: &str,
    flags: &[&str],
    text: &str,
    home: &Path,
) -> std::process::Output {
    let path = vocab_path(models, name);
    let model = path.to_str().expect("UTF-8 path");
    let args: Vec<&str> = [&["tokenize"][..], flags, &["--model", model, text][..]].concat();
    run(&args, home)
}

/// `kvgate tokenize --model` works on the vocabulary-only files (they have no weights); with
/// `--add-special` it adds BOS / EOS as a prompt gets them (llama.cpp's `add_special`).
#[test]
fn kvgate_tokenize_reads_vocabulary_only_files() {
    let Some(models) = models_dir() else { return };
    let home = scratch_dir("tokenize-vocab");
    let add_special: &[&str] = &["--add-special"];
    for (name, flags, expected) in [
        ("llama-spm", &[][..], "[15043,3186]"),
        ("llama-bpe", &[], "[9906,1917]"),
        ("qwen2", &[], "[9707,1879]"),
        ("llama-spm", add_special, "[1,15043,3186]"),
        ("llama-bpe", add_special, "[128000,9906,1917]"),
        ("gpt-2", add_special, "[15496,995]"),
    ] {
        let out = kvgate_tokenize(&models, name, flags, "Hello world", &home);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(stdout.trim().replace(' ', ""), expected, "{name} {flags:?}");
    }
}

/// A vocabulary kvgate does not implement is refused with one line naming it.
#[test]
fn unsupported_vocabularies_fail_with_one_line_naming_the_model() {
    let Some(models) = models_dir() else { return };
    let home = scratch_dir("tokenize-unsupported");
    let line = one_error_line(&kvgate_tokenize(&models, "bert-bge", &[], "hi", &home));
    assert!(line.contains("`bert` is not supported"), "{line}");
}

/// Pre-tokenizers kvgate does not implement (llama.cpp's vocabulary files for Qwen3.5,
/// DeepSeek LLM, Falcon; GPT-NeoX's names none: llama.cpp's "default") are refused by
/// `kvgate tokenize` with one line naming them; architectures it does not run (Phi-3's file is
/// `phi3`, BERT's `bert`) by `kvgate generate`, naming the architecture, before any weights.
#[test]
fn unsupported_pre_tokenizers_and_architectures_fail_with_one_line_naming_them() {
    let Some(models) = models_dir() else { return };
    let home = scratch_dir("tokenize-unsupported-pre");
    for (name, pre) in [
        ("qwen35", "qwen35"),
        ("deepseek-llm", "deepseek-llm"),
        ("falcon", "falcon"),
        ("gpt-neox", "default"),
    ] {
        let line = one_error_line(&kvgate_tokenize(&models, name, &[], "hi", &home));
        assert!(
            line.contains(&format!("pre-tokenizer `{pre}` is not supported")),
            "{name}: {line}"
        );
    }
    for (name, arch) in [("phi-3", "phi3"), ("bert-bge", "bert")] {
        let path = vocab_path(&models, name);
        let model = path.to_str().expect("UTF-8 path");
        let out = run(
            &["generate", "--device", "cpu", "--model", model, "hi"],
            &home,
        );
        let line = one_error_line(&out);
        assert!(
            line.contains(&format!("unsupported model architecture `{arch}`")),
            "{name}: {line}"
        );
    }
}

/// The conversation llama.cpp's tests/test-chat-template.cpp renders with every template.
const CONVERSATION: &[(&str, &str)] = &[
    ("system", "You are a helpful assistant"),
    ("user", "Hello"),
    ("assistant", "Hi there"),
    ("user", "Who are you"),
    ("assistant", "   I am an assistant   "),
    ("user", "Another question"),
];

fn conversation() -> Vec<ChatMessage> {
    CONVERSATION
        .iter()
        .map(|&(role, content)| ChatMessage::new(role, content))
        .collect()
}

/// `models/templates/FILE` compiled with these special-token texts; `None` (after a note) when
/// the sdist has not been fetched.
fn sdist_template(file: &str, bos: &str, eos: &str) -> Option<ChatTemplate> {
    let path = models_dir()?.join("templates").join(file);
    let source =
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    Some(ChatTemplate::new(&source, bos, eos).unwrap_or_else(|e| panic!("{file}: {e}")))
}

/// Llama 3.1's template: a system header with the knowledge cut-off and default date, content
/// trimmed, `<|eot_id|>` after every turn.
#[test]
fn llama_3_1_template_renders_as_its_semantics_say() {
    let Some(t) = sdist_template(
        "meta-llama-Llama-3.1-8B-Instruct.jinja",
        "<|begin_of_text|>",
        "<|eot_id|>",
    ) else {
        return;
    };
    let turn = |role: &str, text: &str| {
        format!("<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>")
    };
    let expected = [
        "<|begin_of_text|>".to_string(),
        turn(
            "system",
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\nYou are a helpful assistant",
        ),
        turn("user", "Hello"),
        turn("assistant", "Hi there"),
        turn("user", "Who are you"),
        turn("assistant", "I am an assistant"),
        turn("user", "Another question"),
        "<|start_header_id|>assistant<|end_header_id|>\n\n".to_string(),
    ]
    .concat();
    assert_eq!(t.render(&conversation(), true).expect("renders"), expected);
}

/// Qwen2.5's template: ChatML, with its own default system prompt when none is given.
#[test]
fn qwen2_5_template_renders_as_its_semantics_say() {
    let Some(t) = sdist_template("Qwen-Qwen2.5-7B-Instruct.jinja", "", "<|im_end|>") else {
        return;
    };
    let chatml = |pairs: &[(&str, &str)]| -> String {
        pairs
            .iter()
            .map(|(role, text)| format!("<|im_start|>{role}\n{text}<|im_end|>\n"))
            .collect()
    };
    // No tools: plain ChatML over the messages as given.
    let expected = chatml(CONVERSATION) + "<|im_start|>assistant\n";
    assert_eq!(t.render(&conversation(), true).expect("renders"), expected);

    let no_system = t
        .render(&[ChatMessage::new("user", "Hi")], false)
        .expect("renders");
    assert_eq!(
        no_system,
        chatml(&[
            (
                "system",
                "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
            ),
            ("user", "Hi"),
        ])
    );
}

/// Mistral Nemo's (v3-tekken) template: no spaces around `[INST]`, the system prompt joined to
/// the last user turn, roles checked to alternate. llama.cpp's test-chat-template.cpp expects
/// the same string for its copy of this template.
#[test]
fn mistral_nemo_template_renders_as_its_semantics_say() {
    let Some(t) = sdist_template("mistralai-Mistral-Nemo-Instruct-2407.jinja", "<s>", "</s>")
    else {
        return;
    };
    assert_eq!(
        t.render(&conversation(), true).expect("renders"),
        "<s>[INST]Hello[/INST]Hi there</s>[INST]Who are you[/INST]   I am an assistant   </s>\
         [INST]You are a helpful assistant\n\nAnother question[/INST]"
    );
    let out_of_order = [ChatMessage::new("user", "a"), ChatMessage::new("user", "b")];
    let err = t
        .render(&out_of_order, true)
        .expect_err("roles must alternate");
    assert!(err.to_string().contains("must alternate"), "{err}");
}

/// The GGUF's own template (Qwen2's and Phi-3's vocabulary files carry one) renders through the
/// tokenizer, and its markup becomes the vocabulary's special tokens.
#[test]
fn the_gguf_files_own_template_renders_and_tokenizes() {
    let Some(models) = models_dir() else { return };
    let qwen = tokenizer(&models, "qwen2");
    let messages = [ChatMessage::new("user", "Hello")];
    let rendered = qwen.apply_chat_template(&messages, true).expect("renders");
    assert_eq!(
        rendered,
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n\
         <|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    );
    let ids = qwen.encode_chat(&messages, true).expect("encodes");
    let im_start = qwen.encode("<|im_start|>", true);
    assert_eq!(im_start.len(), 1, "<|im_start|> is one special token");
    assert_eq!(ids[0], im_start[0]);
    assert_eq!(qwen.decode_with_special(&ids), rendered);

    let phi = tokenizer(&models, "phi-3");
    let rendered = phi.apply_chat_template(&messages, true).expect("renders");
    assert_eq!(rendered, "<s><|user|>\nHello<|end|>\n<|assistant|>\n");
    let ids = phi.encode_chat(&messages, true).expect("encodes");
    // llama.cpp drops the whitespace after Phi-3's special tokens (their `rstrip`), so the
    // newlines vanish and "Hello" starts a fragment again: `▁Hello`.
    let special = |text: &str| {
        let ids = phi.encode(text, true);
        assert_eq!(ids.len(), 1, "{text} is one special token");
        ids[0]
    };
    assert_eq!(
        ids,
        [
            phi.bos_id().expect("Phi-3 has BOS"),
            special("<|user|>"),
            15043, // ▁Hello
            special("<|end|>"),
            special("<|assistant|>"),
        ]
    );
}

/// A raw `/v1/completions` prompt starts with BOS when the vocabulary adds one (Llama 2 /
/// Mistral SentencePiece; Llama 3, whose file has no `add_bos_token`, by llama.cpp's default
/// for `llama-bpe`), as llama.cpp's server tokenizes it (`add_special = true`), and gets none
/// from a vocabulary that does not (GPT-2). None of these files adds EOS.
#[test]
fn completion_prompts_start_with_bos_when_the_vocabulary_adds_one() {
    use kvgate_gateway::validate::PromptCodec;
    let Some(models) = models_dir() else { return };
    let spm = tokenizer(&models, "llama-spm");
    let bos = spm.bos_id().expect("llama-spm names a BOS token");
    let ids = PromptCodec::encode(&spm, "Hello world");
    assert_eq!(ids.first(), Some(&bos), "{ids:?}");
    assert_eq!(&ids[1..], spm.encode("Hello world", true).as_slice());
    assert_eq!(ids.iter().filter(|&&id| id == bos).count(), 1);

    let llama3 = tokenizer(&models, "llama-bpe");
    let ids = PromptCodec::encode(&llama3, "Hello world");
    assert_eq!(ids, [128000, 9906, 1917], "<|begin_of_text|> Hello world");

    let gpt2 = tokenizer(&models, "gpt-2");
    let ids = PromptCodec::encode(&gpt2, "Hello world");
    assert_eq!(ids, gpt2.encode("Hello world", true));
}
