//! Pre-tokenization: cutting text into the words BPE then merges inside, as llama.cpp does.
//!
//! llama.cpp picks a list of regexes by `tokenizer.ggml.pre` and applies them in sequence: each
//! regex cuts every piece left by the previous one, and the text between two matches is kept as a
//! piece of its own (`unicode_regex_split`). For `smollm` (and starcoder, refact, command-r, …)
//! the list is `\p{N}` — every digit a piece — then the GPT-2 pattern. A single combined regex is
//! not equivalent (" 123" becomes " ", "1", "2", "3" here), which is why the stages are kept.
//!
//! The GPT-2 stage runs without look-ahead, so fancy-regex hands it to the linear-time `regex`
//! engine: `\s+(?!\S)` is emulated by matching `\s+` and giving back its last character when a
//! non-space follows, which is exactly what the look-ahead does (and what llama.cpp's hand-written
//! `unicode_regex_split_custom_gpt2` does).

use super::TokenizerError;
use fancy_regex::Regex;

/// The GPT-2 pattern with the final `\s+(?!\S)` relaxed to `\s+` (see the module doc).
const GPT2_PATTERN: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// `tokenizer.ggml.pre` values whose llama.cpp regex list is `[\p{N}, GPT-2]`.
const DIGITS_THEN_GPT2: &[&str] = &[
    "smollm",
    "starcoder",
    "refact",
    "command-r",
    "codeshell",
    "exaone",
    "minerva-7b",
    "mellum2",
];

/// `tokenizer.ggml.pre` values whose llama.cpp regex list is `[GPT-2]` alone.
const GPT2_ONLY: &[&str] = &[
    "gpt-2",
    "phi-2",
    "jina-es",
    "jina-de",
    "gigachat",
    "jina-v2-es",
    "jina-v2-de",
    "a.x-4.0",
    "mellum",
    "modern-bert",
    "jina-v1-en",
    "jina-v2-code",
    "roberta-bpe",
    "mpt",
    "olmo",
    "jais",
    "exaone4",
    "trillion",
    "granite-docling",
];

/// A compiled pre-tokenizer: the regex stages for one `tokenizer.ggml.pre` value.
pub(super) struct PreTokenizer {
    /// `\p{N}`: each match (one number character) becomes its own piece.
    digits: Option<Regex>,
    gpt2: Regex,
}

impl PreTokenizer {
    /// The pre-tokenizer llama.cpp uses for `pre`; unsupported names are an error naming them.
    pub(super) fn for_pre_type(pre: &str) -> Result<Self, TokenizerError> {
        let split_digits = if DIGITS_THEN_GPT2.contains(&pre) {
            true
        } else if GPT2_ONLY.contains(&pre) {
            false
        } else {
            return Err(TokenizerError::UnsupportedPreTokenizer(pre.to_string()));
        };
        let compile = |pattern: &str| {
            Regex::new(pattern).map_err(|e| TokenizerError::Regex(format!("{pattern}: {e}")))
        };
        Ok(Self {
            digits: if split_digits {
                Some(compile(r"\p{N}")?)
            } else {
                None
            },
            gpt2: compile(GPT2_PATTERN)?,
        })
    }

    /// Appends the words of `text` to `words`, in order; their concatenation is `text`.
    pub(super) fn split<'t>(&self, text: &'t str, words: &mut Vec<&'t str>) {
        match &self.digits {
            Some(digits) => {
                let mut chunks = Vec::new();
                split_keeping_gaps(digits, text, &mut chunks);
                for chunk in chunks {
                    self.split_gpt2(chunk, words);
                }
            }
            None => self.split_gpt2(text, words),
        }
    }

    fn split_gpt2<'t>(&self, chunk: &'t str, words: &mut Vec<&'t str>) {
        let mut pos = 0;
        while pos < chunk.len() {
            let Ok(Some(m)) = self.gpt2.find_from_pos(chunk, pos) else {
                // No further match (a plain-regex pattern cannot fail): the rest is one piece.
                words.push(&chunk[pos..]);
                return;
            };
            if m.start() > pos {
                words.push(&chunk[pos..m.start()]);
            }
            let mut end = m.end();
            let word = m.as_str();
            if end < chunk.len() && word.chars().all(char::is_whitespace) {
                // `\s+(?!\S)`: a space run followed by a non-space leaves its last character to
                // start the next word (" world"), unless that would leave the run empty.
                if let Some((last_start, _)) = word.char_indices().last()
                    && last_start > 0
                {
                    end = m.start() + last_start;
                }
            }
            words.push(&chunk[m.start()..end]);
            pos = end;
        }
    }
}

/// Cuts `text` at every match of `regex`: matches and the text between them, in order.
fn split_keeping_gaps<'t>(regex: &Regex, text: &'t str, pieces: &mut Vec<&'t str>) {
    let mut last = 0;
    for m in regex.find_iter(text) {
        let Ok(m) = m else { break };
        if m.start() > last {
            pieces.push(&text[last..m.start()]);
        }
        pieces.push(m.as_str());
        last = m.end();
    }
    if last < text.len() {
        pieces.push(&text[last..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(pre: &str, text: &str) -> Vec<String> {
        let pre = PreTokenizer::for_pre_type(pre).expect("supported pre-tokenizer");
        let mut out = Vec::new();
        pre.split(text, &mut out);
        assert_eq!(out.concat(), text, "pieces must cover the text");
        out.into_iter().map(str::to_string).collect()
    }

    #[test]
    fn smollm_splits_every_digit_and_keeps_spaces_apart() {
        assert_eq!(words("smollm", " 123"), [" ", "1", "2", "3"]);
        assert_eq!(words("smollm", "a  1"), ["a", "  ", "1"]);
        assert_eq!(words("smollm", "x²½"), ["x", "²", "½"]);
        assert_eq!(words("gpt-2", " 123"), [" 123"]);
    }

    #[test]
    fn gpt2_space_runs_give_their_last_space_to_the_next_word() {
        assert_eq!(words("smollm", "Hello   world"), ["Hello", "  ", " world"]);
        assert_eq!(words("smollm", "a \n\nb"), ["a", " \n", "\n", "b"]);
        assert_eq!(words("smollm", "end  "), ["end", "  "]);
        assert_eq!(words("smollm", "\tx"), ["\t", "x"]);
        assert_eq!(words("smollm", "한국어 텍스트"), ["한국어", " 텍스트"]);
    }

    #[test]
    fn contractions_and_punctuation() {
        assert_eq!(
            words("smollm", "it's we'll ?!"),
            ["it", "'s", " we", "'ll", " ?!"]
        );
        assert_eq!(words("smollm", "fn(x);"), ["fn", "(", "x", ");"]);
    }

    #[test]
    fn unknown_pre_tokenizer_is_named() {
        let err = PreTokenizer::for_pre_type("llama-bpe").err();
        assert!(err.is_some_and(|e| e.to_string().contains("llama-bpe")));
    }
}
