//! SentencePiece encoding on a small synthetic vocabulary: merge order by score, byte fallback,
//! the leading-space rule and decoding. `tests/tokenizer_conformance.rs` checks real vocabularies
//! (Llama 2, Phi-3) against llama.cpp's vectors.

use super::super::vocab::{ModelKind, Vocab};
use super::super::*;
use proptest::prelude::*;

/// `<unk>`, `<s>`, `</s>`, the 256 byte tokens, then `pieces` with their scores.
fn spm_vocab(pieces: &[(&str, f32)], add_space_prefix: bool) -> Vocab {
    let mut texts: Vec<String> = ["<unk>", "<s>", "</s>"].map(String::from).to_vec();
    let mut kinds = vec![TokenKind::Unknown, TokenKind::Control, TokenKind::Control];
    let mut scores = vec![0.0; 3];
    for b in 0..=255u8 {
        texts.push(format!("<0x{b:02X}>"));
        kinds.push(TokenKind::Byte);
        scores.push(0.0);
    }
    for (piece, score) in pieces {
        texts.push(piece.to_string());
        kinds.push(TokenKind::Normal);
        scores.push(*score);
    }
    let mut vocab = Vocab {
        model: ModelKind::SentencePiece,
        texts,
        kinds,
        scores,
        merges: None,
        pre: "default".into(),
        bos: Some(1),
        eos: Some(2),
        add_bos: true,
        add_eos: false,
        add_space_prefix,
        rstrip_specials: false,
        unk: Some(0),
        eog_ids: [2].into(),
        chat_template: None,
    };
    vocab.mark_end_of_generation(&[None, None, None]);
    vocab
}

fn spm(pieces: &[(&str, f32)]) -> Tokenizer {
    Tokenizer::from_vocab(spm_vocab(pieces, true)).expect("SentencePiece vocabulary loads")
}

fn pieces(t: &Tokenizer, ids: &[u32]) -> Vec<String> {
    ids.iter()
        .map(|&i| t.token_text(i).unwrap_or("?").to_string())
        .collect()
}

const PIECES: &[(&str, f32)] = &[
    ("▁", -1.0),
    ("a", -2.0),
    ("b", -2.0),
    ("c", -2.0),
    ("ab", -5.0),
    ("bc", -1.5),
    ("▁a", -3.0),
    ("▁ab", -4.0),
];

#[test]
fn the_best_scored_pair_merges_first_not_the_leftmost() {
    // "ab" would be first in any left-to-right or id order; "bc" scores higher and wins, and
    // "a"+"bc" is not a piece, so "abc" is never reached.
    let t = Tokenizer::from_vocab(spm_vocab(PIECES, false)).expect("loads");
    assert_eq!(pieces(&t, &t.encode("abc", false)), ["a", "bc"]);
}

#[test]
fn equal_scores_merge_leftmost_first() {
    let t = Tokenizer::from_vocab(spm_vocab(&[("x", -1.0), ("xx", -2.0)], false)).expect("loads");
    assert_eq!(pieces(&t, &t.encode("xxx", false)), ["xx", "x"]);
}

#[test]
fn a_space_goes_in_front_of_the_text_and_after_each_special_token() {
    let t = spm(PIECES);
    assert_eq!(pieces(&t, &t.encode("ab", false)), ["▁ab"]);
    assert_eq!(pieces(&t, &t.encode("a b", false)), ["▁a", "▁", "b"]);
    // After `<s>` the text starts again: its leading space comes back.
    assert_eq!(
        pieces(&t, &t.encode("ab<s>ab", true)),
        ["▁ab", "<s>", "▁ab"]
    );
    // Without parse_special the control-token text is ordinary text (bytes here).
    assert_eq!(
        pieces(&t, &t.encode("<s>", false)),
        ["▁", "<0x3C>", "<0x73>", "<0x3E>"]
    );
    let no_prefix = Tokenizer::from_vocab(spm_vocab(PIECES, false)).expect("loads");
    assert_eq!(pieces(&no_prefix, &no_prefix.encode("ab", false)), ["ab"]);
}

#[test]
fn characters_without_a_piece_fall_back_to_byte_tokens() {
    let t = spm(PIECES);
    assert_eq!(
        pieces(&t, &t.encode("aé", false)),
        ["▁a", "<0xC3>", "<0xA9>"]
    );
    assert_eq!(t.decode(&t.encode("aé", false)), " aé");
}

#[test]
fn bos_is_added_by_default_for_sentencepiece() {
    let t = spm(PIECES);
    assert_eq!(
        t.encode_with_specials("a", false),
        [1, t.encode("a", false)[0]]
    );
}

#[test]
fn chat_prompts_start_with_exactly_one_bos() {
    // The fallback ChatML template writes no BOS: it is added.
    let t = spm(PIECES);
    let user = [ChatMessage::new("user", "ab")];
    let ids = t.encode_chat(&user, true).expect("renders");
    assert_eq!(ids[0], 1);
    assert_eq!(
        ids[1..],
        t.encode(&t.apply_chat_template(&user, true).expect("renders"), true)
    );
    // A template that writes `{{ bos_token }}` keeps its one BOS.
    let mut vocab = spm_vocab(PIECES, true);
    vocab.chat_template =
        Some("{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}".into());
    let t = Tokenizer::from_vocab(vocab).expect("loads");
    assert_eq!(
        pieces(&t, &t.encode_chat(&user, true).expect("renders")),
        ["<s>", "▁ab"]
    );
    // Without add_bos nothing is added.
    let mut vocab = spm_vocab(PIECES, true);
    vocab.add_bos = false;
    let t = Tokenizer::from_vocab(vocab).expect("loads");
    assert_ne!(t.encode_chat(&user, true).expect("renders")[0], 1);
}

#[test]
fn decoding_turns_the_space_marker_back_into_spaces_and_drops_control_tokens() {
    let t = spm(PIECES);
    let ids = t.encode("<s>ab a", true);
    assert_eq!(t.decode(&ids), " ab a");
    assert_eq!(t.decode_with_special(&ids), "<s> ab a");
}

proptest! {
    /// Every text survives the round trip (with the added leading space): each character is a
    /// piece or falls back to bytes.
    #[test]
    fn decode_inverts_encode(text in "\\PC{1,40}") {
        let t = spm(PIECES);
        prop_assert_eq!(t.decode(&t.encode(&text, false)), format!(" {text}"));
    }
}
