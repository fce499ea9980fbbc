//! SentencePiece-style encoding (`tokenizer.ggml.model = llama`), as llama.cpp's
//! `llm_tokenizer_spm` does it: Llama 2, Mistral v0.1–v0.3, Phi-3 and their fine-tunes.
//!
//! The text (spaces already escaped to `▁`) starts as one symbol per character. Every adjacent
//! pair whose concatenation is a token is a candidate merge, scored by that token's
//! `tokenizer.ggml.scores` entry; the best-scored candidate merges first (ties: the leftmost),
//! and the new symbol's pairs with its neighbours become candidates. At the end each symbol is
//! a token, or a single character no token spells, which falls back to its UTF-8 bytes as the
//! `<0xXX>` byte tokens.
//!
//! This is why tiktoken-rs's `CoreBPE` is not used here: it merges by rank (the lowest rank of
//! the *resulting token* wins), and SentencePiece scores are not ranks: they are the unigram
//! log-probabilities the model was trained with, a merge's priority is the score of the piece
//! it creates, and a piece may be reachable only through pairs that are themselves not
//! pieces' halves in any merge list. There is no merge list to rank.

use super::vocab::Vocab;
use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// The replacement SentencePiece uses for a space (U+2581 LOWER ONE EIGHTH BLOCK).
pub(super) const SPACE: char = '\u{2581}';

pub(super) struct SpmModel {
    /// Token text → id, for every token (llama.cpp's `text_to_token`: later ids win).
    id_of_text: HashMap<Box<str>, u32>,
    scores: Vec<f32>,
    /// `<0xAB>` tokens (or, failing that, the single-byte token), for characters no token
    /// spells.
    byte_tokens: [Option<u32>; 256],
    unk: Option<u32>,
    pub(super) add_space_prefix: bool,
}

/// One symbol of the text being merged: a byte range of it, in a doubly linked list.
#[derive(Clone, Copy)]
struct Symbol {
    start: usize,
    /// Bytes; 0 once merged into its left neighbour.
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A candidate merge of symbols `left` and `right` (adjacent when it was made).
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    /// Bytes of the merged text; a stale candidate (a side has grown since) no longer matches.
    len: usize,
}

impl Ord for Bigram {
    /// Highest score first; on equal scores the leftmost (llama.cpp's `llm_bigram_spm`).
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

impl SpmModel {
    pub(super) fn new(vocab: &Vocab) -> Self {
        let id_of_text: HashMap<Box<str>, u32> = vocab
            .texts
            .iter()
            .enumerate()
            .map(|(id, text)| (Box::from(text.as_str()), id as u32))
            .collect();
        let byte_tokens = std::array::from_fn(|b| {
            let hex = format!("<0x{b:02X}>");
            id_of_text.get(hex.as_str()).copied().or_else(|| {
                // llama.cpp falls back to a token spelling the byte itself (ASCII only: a lone
                // byte >= 0x80 is not a `str`).
                let byte = u8::try_from(b).ok().filter(u8::is_ascii)?;
                id_of_text
                    .get(char::from(byte).to_string().as_str())
                    .copied()
            })
        });
        Self {
            id_of_text,
            scores: vocab.scores.clone(),
            byte_tokens,
            unk: vocab.unk,
            add_space_prefix: vocab.add_space_prefix,
        }
    }

    fn token(&self, text: &str) -> Option<u32> {
        self.id_of_text.get(text).copied()
    }

    fn score(&self, id: u32) -> f32 {
        self.scores.get(id as usize).copied().unwrap_or(0.0)
    }

    /// Appends the tokens of `text`, whose spaces are already `▁`.
    pub(super) fn encode(&self, text: &str, ids: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = text
            .char_indices()
            .enumerate()
            .map(|(i, (start, c))| Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: Some(i + 1),
            })
            .collect();
        let Some(last) = symbols.last_mut() else {
            return;
        };
        last.next = None;

        let mut queue = BinaryHeap::with_capacity(symbols.len());
        let candidate = |symbols: &[Symbol], left: Option<usize>, right: Option<usize>| {
            let (left, right) = (left?, right?);
            let (l, r) = (symbols[left], symbols[right]);
            let len = l.len + r.len;
            let id = self.token(&text[l.start..l.start + len])?;
            Some(Bigram {
                score: self.score(id),
                left,
                right,
                len,
            })
        };
        for right in 1..symbols.len() {
            queue.extend(candidate(&symbols, Some(right - 1), Some(right)));
        }
        while let Some(bigram) = queue.pop() {
            let (left, right) = (symbols[bigram.left], symbols[bigram.right]);
            if left.len == 0 || right.len == 0 || left.len + right.len != bigram.len {
                continue;
            }
            symbols[bigram.left].len = bigram.len;
            symbols[bigram.left].next = right.next;
            symbols[bigram.right].len = 0;
            if let Some(next) = right.next {
                symbols[next].prev = Some(bigram.left);
            }
            queue.extend(candidate(&symbols, left.prev, Some(bigram.left)));
            queue.extend(candidate(&symbols, Some(bigram.left), right.next));
        }

        let mut at = Some(0);
        while let Some(i) = at {
            let symbol = symbols[i];
            let piece = &text[symbol.start..symbol.start + symbol.len];
            match self.token(piece) {
                Some(id) => ids.push(id),
                // Only single characters stay unmerged without being a token (every merge makes
                // a token): spell them in bytes.
                None => ids.extend(
                    piece
                        .bytes()
                        .filter_map(|b| self.byte_tokens[b as usize].or(self.unk)),
                ),
            }
            at = symbol.next;
        }
    }
}

/// `text` with every space as `▁`, preceded by one when `prefix_space` (llama.cpp's
/// `llama_escape_whitespace` after the leading-space rule).
pub(super) fn escape_spaces(text: &str, prefix_space: bool) -> String {
    let mut escaped = String::with_capacity(text.len() + 3);
    if prefix_space {
        escaped.push(SPACE);
    }
    escaped.extend(text.chars().map(|c| if c == ' ' { SPACE } else { c }));
    escaped
}
