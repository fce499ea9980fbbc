//! `tokenizer.ggml.add_bos_token` / `add_eos_token` read from GGUF metadata, with llama.cpp's
//! defaults when a key is absent, and applied where llama.cpp applies them: prompts tokenized
//! with `add_special` (`/completion`, `kvgate tokenize --add-special`) and chat prompts.
//! None of llama.cpp's vocabulary test files that kvgate supports sets `add_eos_token`, so the
//! files here are tiny GGUFs written by the test writer.

use super::super::*;
use crate::gguf::testutil::{GgufBuilder, write_temp};

/// Writes `bytes` as a GGUF file and builds its tokenizer.
fn load(name: &str, bytes: Vec<u8>) -> Result<Tokenizer, TokenizerError> {
    let path = write_temp(&format!("{name}.gguf"), &bytes);
    let gguf = GgufFile::open(&path).expect("opens");
    Tokenizer::from_gguf(&gguf)
}

/// A SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, the byte tokens, `▁a`, `▁b`.
fn spm_file(add_bos: Option<bool>, add_eos: Option<bool>, template: Option<&str>) -> Vec<u8> {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    let mut types = vec![2, 3, 3];
    for b in 0..=255u8 {
        tokens.push(format!("<0x{b:02X}>"));
        types.push(6);
    }
    tokens.extend(["▁a", "▁b"].map(String::from));
    types.extend([1, 1]);
    let scores = vec![0.0; tokens.len()];
    let tokens: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let mut file = GgufBuilder::new()
        .str("tokenizer.ggml.model", "llama")
        .str_array("tokenizer.ggml.tokens", &tokens)
        .i32_array("tokenizer.ggml.token_type", &types)
        .f32_array("tokenizer.ggml.scores", &scores)
        .u32("tokenizer.ggml.bos_token_id", 1)
        .u32("tokenizer.ggml.eos_token_id", 2);
    if let Some(t) = template {
        file = file.str("tokenizer.chat_template", t);
    }
    with_add_keys(file, add_bos, add_eos).build()
}

/// `tokenizer.ggml.add_bos_token` / `add_eos_token`, each when given.
fn with_add_keys(
    mut file: GgufBuilder,
    add_bos: Option<bool>,
    add_eos: Option<bool>,
) -> GgufBuilder {
    for (key, value) in [("add_bos_token", add_bos), ("add_eos_token", add_eos)] {
        if let Some(v) = value {
            file = file.bool(&format!("tokenizer.ggml.{key}"), v);
        }
    }
    file
}

/// A byte-level BPE vocabulary with pre-tokenizer `pre`: `<|end|>` (id 0), the byte tokens and
/// `hi`; BOS/EOS id 0 when `with_eos`, no special ids otherwise.
fn bpe_file(pre: &str, add_bos: Option<bool>, add_eos: Option<bool>, with_eos: bool) -> Vec<u8> {
    let mut tokens: Vec<String> = vec!["<|end|>".into()];
    let mut types = vec![3];
    for b in 0..=255u8 {
        tokens.push(byte_to_char(b).to_string());
        types.push(1);
    }
    tokens.push("hi".into());
    types.push(1);
    let tokens: Vec<&str> = tokens.iter().map(String::as_str).collect();
    let mut file = GgufBuilder::new()
        .str("tokenizer.ggml.model", "gpt2")
        .str("tokenizer.ggml.pre", pre)
        .str_array("tokenizer.ggml.tokens", &tokens)
        .i32_array("tokenizer.ggml.token_type", &types)
        .str_array("tokenizer.ggml.merges", &["h i"]);
    if with_eos {
        file = file
            .u32("tokenizer.ggml.bos_token_id", 0)
            .u32("tokenizer.ggml.eos_token_id", 0);
    }
    with_add_keys(file, add_bos, add_eos).build()
}

#[test]
fn add_eos_token_ends_completion_prompts_with_eos() {
    let t = load("spm-eos", spm_file(None, Some(true), None)).expect("loads");
    let text = t.encode("a b", false);
    assert_eq!(text.len(), 2, "▁a ▁b: {text:?}");
    // BOS by SentencePiece's default, EOS from the key: [<s>, ▁a, ▁b, </s>].
    assert_eq!(
        t.encode_with_specials("a b", false),
        [vec![1], text, vec![2]].concat()
    );
    assert!(t.adds_bos() && t.adds_eos());
    // Like llama.cpp, text that already ends with `</s>` gets a second one.
    let ids = t.encode_with_specials("a</s>", true);
    assert_eq!(ids[ids.len() - 2..], [2, 2]);
    // An empty prompt is just the special tokens (llama.cpp: [BOS, EOS]).
    assert_eq!(t.encode_with_specials("", false), [1, 2]);
}

#[test]
fn without_the_keys_sentencepiece_adds_bos_only_and_explicit_false_wins() {
    let t = load("spm-default", spm_file(None, None, None)).expect("loads");
    assert!(t.adds_bos() && !t.adds_eos());
    assert_eq!(
        t.encode_with_specials("a", false),
        [1, t.encode("a", false)[0]]
    );

    let t = load("spm-none", spm_file(Some(false), Some(false), None)).expect("loads");
    assert!(!t.adds_bos() && !t.adds_eos());
    assert_eq!(t.encode_with_specials("a", false), t.encode("a", false));

    let t = load("spm-eos-only", spm_file(Some(false), Some(true), None)).expect("loads");
    assert_eq!(
        t.encode_with_specials("a", false),
        [t.encode("a", false)[0], 2]
    );
}

#[test]
fn chat_prompts_end_with_exactly_one_eos_when_the_vocabulary_adds_it() {
    let user = [ChatMessage::new("user", "a")];
    // A template that writes no EOS gets it appended (and BOS prepended)...
    let plain = "{% for m in messages %}{{ m.content }}{% endfor %}";
    let t = load("chat-plain", spm_file(None, Some(true), Some(plain))).expect("loads");
    let ids = t.encode_chat(&user, true).expect("renders");
    assert_eq!(ids, [vec![1], t.encode("a", false), vec![2]].concat());
    // ...one that ends with `{{ eos_token }}` keeps its one EOS (llama.cpp strips the
    // template's trailing EOS text before adding the token).
    let with_eos =
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}";
    let t = load("chat-eos", spm_file(None, Some(true), Some(with_eos))).expect("loads");
    let ids = t.encode_chat(&user, true).expect("renders");
    assert_eq!(ids, [vec![1], t.encode("a", false), vec![2]].concat());
    // Without add_eos_token the template's output is kept as it is.
    let t = load("chat-no-eos", spm_file(None, None, Some(plain))).expect("loads");
    let ids = t.encode_chat(&user, true).expect("renders");
    assert_eq!(ids, [vec![1], t.encode("a", false)].concat());
}

#[test]
fn byte_level_bpe_defaults_follow_llama_cpp_per_pre_tokenizer() {
    // llama.cpp sets add_bos for Llama 3's pre-tokenizers when the file does not say...
    let t = load("bpe-llama3", bpe_file("llama-bpe", None, None, true)).expect("loads");
    assert!(t.adds_bos() && !t.adds_eos());
    assert_eq!(t.encode_with_specials("hi", false), [0, 257]);
    // ... and for Mistral's Tekken.
    let t = load("bpe-tekken", bpe_file("tekken", None, None, true)).expect("loads");
    assert_eq!(t.encode_with_specials("hi", false), [0, 257]);
    // GPT-2 style vocabularies add nothing by default...
    let t = load("bpe-gpt2", bpe_file("gpt-2", None, None, true)).expect("loads");
    assert_eq!(t.encode_with_specials("hi", false), [257]);
    // ...and the keys override the defaults either way.
    let t = load(
        "bpe-llama3-off",
        bpe_file("llama-bpe", Some(false), None, true),
    )
    .expect("loads");
    assert_eq!(t.encode_with_specials("hi", false), [257]);
    let t = load("bpe-gpt2-eos", bpe_file("gpt-2", None, Some(true), true)).expect("loads");
    assert_eq!(t.encode_with_specials("hi", false), [257, 0]);
    let t = load(
        "bpe-gpt2-both",
        bpe_file("gpt-2", Some(true), Some(true), true),
    )
    .expect("loads");
    assert_eq!(t.encode_with_specials("hi", false), [0, 257, 0]);
}

#[test]
fn add_eos_without_an_eos_token_is_refused_with_the_key_named() {
    // Byte-level BPE has no default EOS id; llama.cpp would assert at the first prompt.
    let err =
        load("bpe-no-eos", bpe_file("gpt-2", None, Some(true), false)).expect_err("nothing to add");
    assert!(err.to_string().contains("add_eos_token"), "{err}");
    // Without add_eos_token the same vocabulary loads and adds nothing.
    let t = load("bpe-no-ids", bpe_file("gpt-2", None, None, false)).expect("loads");
    assert!(!t.adds_bos() && !t.adds_eos());
}
