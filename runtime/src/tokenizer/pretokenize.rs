//! Pre-tokenization: cutting text into the words BPE then merges inside, as llama.cpp does.
//!
//! llama.cpp picks a list of regexes by `tokenizer.ggml.pre` and applies them in sequence: each
//! regex cuts every piece left by the previous one, and the text between two matches is kept as a
//! piece of its own (`unicode_regex_split`). For `smollm` (and starcoder, refact, command-r, …)
//! the list is `\p{N}` — every number character a piece — then the GPT-2 pattern
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)`. A single combined
//! regex is not equivalent (" 123" becomes " ", "1", "2", "3" here).
//!
//! Llama 3 (`llama-bpe`) and Qwen2 (`qwen2`) use one regex each,
//! `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`,
//! Qwen2's with `\p{N}` (one digit a word) where Llama 3 has `\p{N}{1,3}`.
//!
//! llama.cpp does not run the GPT-2 and Llama 3 regexes: it runs hand-written scanners
//! (`unicode_regex_split_custom_gpt2`, `…_llama3`). [`PreTokenizer::split_gpt2`] and
//! [`PreTokenizer::split_llama3`] are ports of them, which are also several times faster than a
//! regex engine here (no per-word search set-up). For Qwen2 llama.cpp runs the regex itself on
//! text whose non-ASCII characters are collapsed to their class; the Llama 3 scanner with runs of
//! one digit is that regex's behaviour (the two regexes differ only there).
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

/// `tokenizer.ggml.pre` values whose llama.cpp regex is the Llama 3 one (`\p{N}{1,3}`).
const LLAMA3: &[&str] = &[
    "llama3",
    "llama-v3",
    "llama-bpe",
    "falcon3",
    "falcon-h1",
    "pixtral",
    "midm-2.0",
    "lfm2",
];

/// `tokenizer.ggml.pre` values whose llama.cpp regex is Qwen2's (Llama 3's with `\p{N}`).
const QWEN2: &[&str] = &["qwen2", "deepseek-r1-qwen", "kormo", "megrez"];

/// Whether llama.cpp starts prompts with BOS for a byte-level BPE vocabulary of this
/// pre-tokenizer when the file has no `tokenizer.ggml.add_bos_token` (it sets `add_bos` for
/// the Llama 3 family).
pub(super) fn adds_bos_by_default(pre: &str) -> bool {
    LLAMA3.contains(&pre)
}

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

/// Which scanner cuts the words.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scheme {
    /// The GPT-2 regex; with `split_numbers`, after the `\p{N}` stage (every number character
    /// its own piece).
    Gpt2 { split_numbers: bool },
    /// The Llama 3 regex, number runs cut every `max_digits` characters (3; Qwen2: 1).
    Llama3 { max_digits: usize },
}

/// A pre-tokenizer for one `tokenizer.ggml.pre` value.
pub(super) struct PreTokenizer {
    scheme: Scheme,
    /// llama.cpp's `ignore_merges` (Llama 3): a word that is a token is taken whole.
    ignore_merges: bool,
    classes: CharClasses,
}

impl PreTokenizer {
    /// The pre-tokenizer llama.cpp uses for `pre`; unsupported names are an error naming them.
    pub(super) fn for_pre_type(pre: &str) -> Result<Self, TokenizerError> {
        let (scheme, ignore_merges) = if DIGITS_THEN_GPT2.contains(&pre) {
            (
                Scheme::Gpt2 {
                    split_numbers: true,
                },
                false,
            )
        } else if GPT2_ONLY.contains(&pre) {
            (
                Scheme::Gpt2 {
                    split_numbers: false,
                },
                false,
            )
        } else if LLAMA3.contains(&pre) {
            (Scheme::Llama3 { max_digits: 3 }, true)
        } else if QWEN2.contains(&pre) {
            (Scheme::Llama3 { max_digits: 1 }, false)
        } else {
            return Err(TokenizerError::UnsupportedPreTokenizer(pre.to_string()));
        };
        Ok(Self {
            scheme,
            ignore_merges,
            classes: CharClasses::new()?,
        })
    }

    pub(super) fn ignores_merges(&self) -> bool {
        self.ignore_merges
    }

    /// Appends the words of `text` to `words`, in order; their concatenation is `text`.
    pub(super) fn split<'t>(&self, text: &'t str, words: &mut Vec<&'t str>) {
        let split_numbers = match self.scheme {
            Scheme::Llama3 { max_digits } => return self.split_llama3(text, max_digits, words),
            Scheme::Gpt2 { split_numbers } => split_numbers,
        };
        if !split_numbers {
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

    /// Port of llama.cpp's `unicode_regex_split_custom_llama3`, with the digit-run length as a
    /// parameter.
    fn split_llama3<'t>(&self, piece: &'t str, max_digits: usize, words: &mut Vec<&'t str>) {
        let chars: Vec<(usize, char)> = piece.char_indices().collect();
        let n = chars.len();
        // Positions past the end classify as `None`, like llama.cpp's OUT_OF_RANGE.
        let class = |i: usize| chars.get(i).map(|&(_, c)| self.classes.of(c));
        let char_at = |i: usize| chars.get(i).map(|&(_, c)| c);
        let byte_at = |i: usize| chars.get(i).map_or(piece.len(), |&(offset, _)| offset);
        let is_newline = |c: Option<char>| matches!(c, Some('\r' | '\n'));
        let mut start = 0;
        let mut push = |end: usize, words: &mut Vec<&'t str>| {
            if end > start {
                words.push(&piece[byte_at(start)..byte_at(end)]);
            }
            start = end;
        };
        let mut pos = 0;
        while pos < n {
            let c = chars[pos].1;
            let here = class(pos);
            // (?i:'s|'t|'re|'ve|'m|'ll|'d)
            if c == '\'' && pos + 1 < n {
                let next = chars[pos + 1].1.to_ascii_lowercase();
                if matches!(next, 's' | 't' | 'm' | 'd') {
                    pos += 2;
                    push(pos, words);
                    continue;
                }
                let after = char_at(pos + 2).map(|c| c.to_ascii_lowercase());
                if matches!(
                    (next, after),
                    ('r', Some('e')) | ('v', Some('e')) | ('l', Some('l'))
                ) {
                    pos += 3;
                    push(pos, words);
                    continue;
                }
            }
            // [^\r\n\p{L}\p{N}]?\p{L}+
            if !is_newline(Some(c))
                && here != Some(CharClass::Number)
                && (here == Some(CharClass::Letter) || class(pos + 1) == Some(CharClass::Letter))
            {
                pos += 1;
                while class(pos) == Some(CharClass::Letter) {
                    pos += 1;
                }
                push(pos, words);
                continue;
            }
            // \p{N}{1,max_digits}
            if here == Some(CharClass::Number) {
                let mut run_start = pos;
                while class(pos) == Some(CharClass::Number) {
                    pos += 1;
                    if pos - run_start >= max_digits {
                        push(pos, words);
                        run_start = pos;
                    }
                }
                push(pos, words);
                continue;
            }
            // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
            let run_class = if c == ' ' { class(pos + 1) } else { here };
            if run_class == Some(CharClass::Other) {
                pos += usize::from(c == ' ');
                while class(pos) == Some(CharClass::Other) {
                    pos += 1;
                }
                while is_newline(char_at(pos)) {
                    pos += 1;
                }
                push(pos, words);
                continue;
            }
            let mut spaces = 0;
            let mut last_newline_end = None;
            while class(pos + spaces) == Some(CharClass::Space) {
                if is_newline(char_at(pos + spaces)) {
                    last_newline_end = Some(pos + spaces + 1);
                }
                spaces += 1;
            }
            // \s*[\r\n]+
            if let Some(end) = last_newline_end {
                pos = end;
            } else if spaces > 1 && pos + spaces < n {
                // \s+(?!\S): the last space goes to the next word.
                pos += spaces - 1;
            } else if spaces > 0 {
                // \s+
                pos += spaces;
            } else {
                pos += 1;
            }
            push(pos, words);
        }
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
    fn llama3_cuts_numbers_in_threes_and_keeps_newlines_together() {
        assert_eq!(words("llama-bpe", "1234567"), ["123", "456", "7"]);
        assert_eq!(words("qwen2", "x 123"), ["x", " ", "1", "2", "3"]);
        assert_eq!(words("llama-bpe", "Hello world"), ["Hello", " world"]);
        // A non-letter, non-newline character leads a letter run ("(hello"), but only one.
        assert_eq!(
            words("llama-bpe", "(hello) .Net"),
            ["(hello", ")", " .", "Net"]
        );
        assert_eq!(words("llama-bpe", "a \n\n b"), ["a", " \n\n", " b"]);
        assert_eq!(words("llama-bpe", "x;\n\ny"), ["x", ";\n\n", "y"]);
        assert_eq!(words("llama-bpe", "a   b  "), ["a", "  ", " b", "  "]);
        // Contractions are case-insensitive in Llama 3, not in GPT-2.
        assert_eq!(words("llama-bpe", "IT'S we'LL"), ["IT", "'S", " we", "'LL"]);
        assert_eq!(words("gpt-2", "IT'S"), ["IT", "'", "S"]);
    }

    #[test]
    fn unknown_pre_tokenizer_is_named() {
        let err = PreTokenizer::for_pre_type("tekken").err();
        assert!(err.is_some_and(|e| e.to_string().contains("tekken")));
    }

    /// The regexes the Llama 3 scanner stands for, as llama.cpp's converter writes them.
    const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    /// The words a regex finds, as llama.cpp's generic path keeps them (every match a word;
    /// these regexes leave no gaps).
    fn regex_words(regex: &fancy_regex::Regex, text: &str) -> Vec<String> {
        regex
            .find_iter(text)
            .map(|m| m.expect("regex runs").as_str().to_string())
            .collect()
    }

    use proptest::strategy::Strategy;

    proptest::proptest! {
        /// The scanner is the regex, on text mixing every class the regex distinguishes:
        /// ASCII and other letters, digits and other numbers, spaces, newlines and other
        /// whitespace, apostrophes, punctuation, combining marks, emoji.
        #[test]
        fn llama3_and_qwen2_scanners_equal_their_regexes(
            text in proptest::collection::vec(
                proptest::sample::select(vec![
                    "a", "Z", "é", "한", "s", "T", "ll", "RE", "'", "1", "٣", "½", " ", "  ", "\n",
                    "\r", "\t", "\u{a0}", "\u{3000}", ".", "?!", "(", "ि", "🦀", "_",
                ]),
                0..24,
            ).prop_map(|parts| parts.concat())
        ) {
            for (pre, regex) in [("llama-bpe", LLAMA3_REGEX), ("qwen2", QWEN2_REGEX)] {
                let regex = fancy_regex::Regex::new(regex).expect("regex compiles");
                proptest::prop_assert_eq!(words(pre, &text), regex_words(&regex, &text), "{}", pre);
            }
        }
    }
}
