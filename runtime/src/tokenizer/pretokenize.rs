//! Pre-tokenization: cutting text into the words BPE then merges inside, as llama.cpp does.
//!
//! llama.cpp picks a list of regexes by `tokenizer.ggml.pre` and applies them in sequence: each
//! regex cuts every piece left by the previous one, and the text between two matches is kept as a
//! piece of its own (`unicode_regex_split`). For `smollm` (and starcoder, refact, command-r, …)
//! the list is `\p{N}` — every number character a piece — then the GPT-2 pattern
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`. A single combined
//! regex is not equivalent (" 123" becomes " ", "1", "2", "3" here).
//!
//! llama.cpp does not run the GPT-2 regex: it runs a hand-written scanner
//! (`unicode_regex_split_custom_gpt2`). [`PreTokenizer::split_gpt2`] is a port of that scanner,
//! which is also several times faster than a regex engine here (no per-word search set-up).
//! Character classes come from regex-syntax's Unicode tables (`\p{L}`, `\p{N}`) and Rust's
//! `White_Space` (llama.cpp's whitespace set is the same property).

use super::TokenizerError;
use regex_syntax::hir::{Class, HirKind};

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

/// The four disjoint classes the GPT-2 scanner distinguishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CharClass {
    Letter,
    Number,
    Space,
    Other,
}

/// Character classification: a table for ASCII, sorted code point ranges for the rest.
struct CharClasses {
    ascii: [CharClass; 128],
    letters: Vec<(char, char)>,
    numbers: Vec<(char, char)>,
}

impl CharClasses {
    fn new() -> Result<Self, TokenizerError> {
        let mut classes = Self {
            ascii: [CharClass::Other; 128],
            letters: unicode_ranges(r"\p{L}")?,
            numbers: unicode_ranges(r"\p{N}")?,
        };
        for b in 0..128u8 {
            classes.ascii[b as usize] = classes.classify(char::from(b));
        }
        Ok(classes)
    }

    fn of(&self, c: char) -> CharClass {
        match self.ascii.get(c as usize) {
            Some(&class) => class,
            None => self.classify(c),
        }
    }

    fn classify(&self, c: char) -> CharClass {
        let within = |ranges: &[(char, char)]| {
            ranges
                .binary_search_by(|&(lo, hi)| {
                    if hi < c {
                        std::cmp::Ordering::Less
                    } else if lo > c {
                        std::cmp::Ordering::Greater
                    } else {
                        std::cmp::Ordering::Equal
                    }
                })
                .is_ok()
        };
        if c.is_whitespace() {
            CharClass::Space
        } else if within(&self.letters) {
            CharClass::Letter
        } else if within(&self.numbers) {
            CharClass::Number
        } else {
            CharClass::Other
        }
    }
}

/// The code point ranges of a Unicode class such as `\p{L}`, from the regex crate's tables.
fn unicode_ranges(class: &str) -> Result<Vec<(char, char)>, TokenizerError> {
    let hir = regex_syntax::Parser::new()
        .parse(class)
        .map_err(|e| TokenizerError::Regex(format!("{class}: {e}")))?;
    match hir.kind() {
        HirKind::Class(Class::Unicode(ranges)) => Ok(ranges
            .ranges()
            .iter()
            .map(|r| (r.start(), r.end()))
            .collect()),
        _ => Err(TokenizerError::Regex(format!(
            "{class} is not a Unicode class"
        ))),
    }
}

/// A pre-tokenizer for one `tokenizer.ggml.pre` value.
pub(super) struct PreTokenizer {
    /// Whether the `\p{N}` stage runs first (every number character its own piece).
    split_numbers: bool,
    classes: CharClasses,
}

impl PreTokenizer {
    /// The pre-tokenizer llama.cpp uses for `pre`; unsupported names are an error naming them.
    pub(super) fn for_pre_type(pre: &str) -> Result<Self, TokenizerError> {
        let split_numbers = if DIGITS_THEN_GPT2.contains(&pre) {
            true
        } else if GPT2_ONLY.contains(&pre) {
            false
        } else {
            return Err(TokenizerError::UnsupportedPreTokenizer(pre.to_string()));
        };
        Ok(Self {
            split_numbers,
            classes: CharClasses::new()?,
        })
    }

    /// Appends the words of `text` to `words`, in order; their concatenation is `text`.
    pub(super) fn split<'t>(&self, text: &'t str, words: &mut Vec<&'t str>) {
        if !self.split_numbers {
            return self.split_gpt2(text, words);
        }
        let mut gap_start = 0;
        for (i, c) in text.char_indices() {
            if self.classes.of(c) == CharClass::Number {
                self.split_gpt2(&text[gap_start..i], words);
                gap_start = i + c.len_utf8();
                words.push(&text[i..gap_start]);
            }
        }
        self.split_gpt2(&text[gap_start..], words);
    }

    /// Port of llama.cpp's `unicode_regex_split_custom_gpt2` over one piece.
    fn split_gpt2<'t>(&self, piece: &'t str, words: &mut Vec<&'t str>) {
        let chars: Vec<(usize, char)> = piece.char_indices().collect();
        let n = chars.len();
        // Positions past the end classify as `None`, like llama.cpp's OUT_OF_RANGE.
        let class = |i: usize| chars.get(i).map(|&(_, c)| self.classes.of(c));
        let byte_at = |i: usize| chars.get(i).map_or(piece.len(), |&(offset, _)| offset);
        let mut start = 0;
        let mut pos = 0;
        while pos < n {
            let c = chars[pos].1;
            pos = 'word: {
                // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive, as in GPT-2)
                if c == '\'' && pos + 1 < n {
                    let next = chars[pos + 1].1;
                    if matches!(next, 's' | 't' | 'm' | 'd') {
                        break 'word pos + 2;
                    }
                    let after = chars.get(pos + 2).map(|&(_, c)| c);
                    if matches!(
                        (next, after),
                        ('r', Some('e')) | ('v', Some('e')) | ('l', Some('l'))
                    ) {
                        break 'word pos + 3;
                    }
                }
                // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: an optional space, then a run.
                let run_class = if c == ' ' { class(pos + 1) } else { class(pos) };
                if let Some(run @ (CharClass::Letter | CharClass::Number | CharClass::Other)) =
                    run_class
                {
                    let mut end = pos + usize::from(c == ' ');
                    while class(end) == Some(run) {
                        end += 1;
                    }
                    break 'word end;
                }
                // `\s+(?!\S)`: a space run followed by more text gives its last character to
                // the next word (" world"); at the end it is taken whole.
                let mut spaces = 0;
                while class(pos + spaces) == Some(CharClass::Space) {
                    spaces += 1;
                }
                if spaces > 1 && pos + spaces < n {
                    break 'word pos + spaces - 1;
                }
                pos + spaces.max(1)
            };
            words.push(&piece[byte_at(start)..byte_at(pos)]);
            start = pos;
        }
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
        assert!(
            out.iter().all(|w| !w.is_empty()),
            "no empty pieces: {out:?}"
        );
        out.into_iter().map(str::to_string).collect()
    }

    #[test]
    fn smollm_splits_every_number_character_and_keeps_spaces_apart() {
        assert_eq!(words("smollm", " 123"), [" ", "1", "2", "3"]);
        assert_eq!(words("smollm", "a  1"), ["a", "  ", "1"]);
        assert_eq!(words("smollm", "x²½Ⅻ"), ["x", "²", "½", "Ⅻ"]);
        assert_eq!(words("gpt-2", " 123 x²"), [" 123", " x", "²"]);
    }

    #[test]
    fn space_runs_give_their_last_space_to_the_next_word() {
        assert_eq!(words("smollm", "Hello   world"), ["Hello", "  ", " world"]);
        assert_eq!(words("smollm", "a \n\nb"), ["a", " \n", "\n", "b"]);
        assert_eq!(words("smollm", "end  "), ["end", "  "]);
        assert_eq!(words("smollm", "\tx"), ["\t", "x"]);
        assert_eq!(words("smollm", "a \u{3000}b"), ["a", " ", "\u{3000}", "b"]);
        assert_eq!(words("smollm", "한국어 텍스트"), ["한국어", " 텍스트"]);
    }

    #[test]
    fn contractions_punctuation_and_marks() {
        assert_eq!(
            words("smollm", "it's we'll 'S ?!"),
            ["it", "'s", " we", "'ll", " '", "S", " ?!"]
        );
        assert_eq!(words("smollm", "fn(x);"), ["fn", "(", "x", ");"]);
        // A combining mark is not a letter: it ends the letter run, as in llama.cpp.
        assert_eq!(words("smollm", "कि"), ["क", "ि"]);
    }

    #[test]
    fn classes_follow_unicode_categories() {
        let c = CharClasses::new().expect("tables build");
        assert_eq!(c.of('é'), CharClass::Letter);
        assert_eq!(c.of('٣'), CharClass::Number);
        assert_eq!(c.of('\u{85}'), CharClass::Space);
        assert_eq!(c.of('\u{1c}'), CharClass::Other, "not White_Space");
        assert_eq!(c.of('\u{40000}'), CharClass::Other);
    }

    #[test]
    fn unknown_pre_tokenizer_is_named() {
        let err = PreTokenizer::for_pre_type("llama-bpe").err();
        assert!(err.is_some_and(|e| e.to_string().contains("llama-bpe")));
    }
}
