//! Parity with llama.cpp: token ids and chat renderings recorded with llama-cpp-python
//! (`tests/fixtures/llama_cpp/gen_fixtures.py`) must be reproduced exactly.

use super::real_model::smollm;
use crate::chat_template::ChatMessage;

const FIXTURE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../tests/fixtures/llama_cpp/tokenize.json"
);

#[derive(serde::Deserialize)]
struct Fixture {
    cases: Vec<TokenizeCase>,
    chat: Vec<ChatCase>,
}

#[derive(serde::Deserialize)]
struct TokenizeCase {
    text: String,
    parse_special: bool,
    ids: Vec<u32>,
}

/// Rendered with `add_generation_prompt = true`, then tokenized with `parse_special`.
#[derive(serde::Deserialize)]
struct ChatCase {
    messages: Vec<ChatMessage>,
    rendered: String,
    ids: Vec<u32>,
}

fn fixture() -> Fixture {
    let json = std::fs::read_to_string(FIXTURE).expect("llama.cpp fixture is checked in");
    serde_json::from_str(&json).expect("fixture parses")
}

#[test]
fn tokenize_matches_llama_cpp_on_every_case() {
    let Some(t) = smollm() else { return };
    let fixture = fixture();
    assert!(fixture.cases.len() >= 50, "fixture has its cases");
    let mismatches: Vec<String> = fixture
        .cases
        .iter()
        .filter_map(|case| {
            let ids = t.encode(&case.text, case.parse_special);
            (ids != case.ids).then(|| {
                format!(
                    "{:?} (parse_special={}):\n  ours   {ids:?}\n  llama  {:?}",
                    case.text, case.parse_special, case.ids
                )
            })
        })
        .collect();
    assert!(mismatches.is_empty(), "{}", mismatches.join("\n"));
}

#[test]
fn chat_rendering_and_its_tokens_match_llama_cpp_python() {
    let Some(t) = smollm() else { return };
    let fixture = fixture();
    assert!(!fixture.chat.is_empty());
    for case in &fixture.chat {
        let rendered = t
            .apply_chat_template(&case.messages, true)
            .expect("SmolLM2 template renders");
        assert_eq!(rendered, case.rendered);
        assert_eq!(t.encode(&rendered, true), case.ids, "ids of {rendered:?}");
    }
}

/// Seeded random texts built from edge cases (see `gen_tokenize_adversarial.py`).
#[test]
fn tokenize_matches_llama_cpp_on_adversarial_texts() {
    let Some(t) = smollm() else { return };
    let path = FIXTURE.replace("tokenize.json", "tokenize_adversarial.json");
    let json = std::fs::read_to_string(path).expect("adversarial fixture is checked in");
    #[derive(serde::Deserialize)]
    struct Adversarial {
        cases: Vec<TokenizeCase>,
    }
    let fixture: Adversarial = serde_json::from_str(&json).expect("fixture parses");
    assert!(fixture.cases.len() >= 200);
    let mismatches: Vec<String> = fixture
        .cases
        .iter()
        .filter_map(|case| {
            let ids = t.encode(&case.text, case.parse_special);
            (ids != case.ids).then(|| {
                format!(
                    "{:?} (parse_special={}):\n  ours   {ids:?}\n  llama  {:?}",
                    case.text, case.parse_special, case.ids
                )
            })
        })
        .collect();
    assert!(
        mismatches.is_empty(),
        "{} mismatches:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
}
