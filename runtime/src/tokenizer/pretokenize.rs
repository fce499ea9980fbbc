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
//!
//! Mistral's `tekken` (Mistral Nemo, Pixtral-era Tekken vocabularies) has no scanner in
//! llama.cpp either: it runs its rewrite of the Hugging Face regex with `std::regex` on the
//! collapsed text (`unicode_regex_split`):
//! `[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
//! Its "upper-case" letter is any letter but `a-z` and its "lower-case" one any letter but
//! `A-Z` (the collapsed text cannot tell `É` from `é`: every non-ASCII letter is both), so
//! `ÉCOLE` is `É` `COLE` where Hugging Face keeps one word. The Llama 3 scanner with
//! [`tekken_letters_end`] for the two letter alternatives, no contractions, one-digit numbers
//! and `/` among the newlines that may end a punctuation run (`'\n/` is one word) is that
//! regex as a backtracking engine runs it. llama.cpp
//! ships no `ggml-vocab-tekken` test vectors; the tests check the scanner against that regex
//! (fancy-regex on the collapsed text, as llama.cpp runs it).
//!
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
    "jina-v5-nano",
];

/// `tokenizer.ggml.pre` values whose llama.cpp regex is Mistral's Tekken one.
const TEKKEN: &[&str] = &["tekken"];

/// `tokenizer.ggml.pre` values whose llama.cpp regex is Qwen2's (Llama 3's with `\p{N}`).
const QWEN2: &[&str] = &["qwen2", "deepseek-r1-qwen", "kormo", "megrez"];

/// Whether llama.cpp starts prompts with BOS for a byte-level BPE vocabulary of this
/// pre-tokenizer when the file has no `tokenizer.ggml.add_bos_token` (it sets `add_bos` for
/// the Llama 3 family and Tekken).
pub(super) fn adds_bos_by_default(pre: &str) -> bool {
    LLAMA3.contains(&pre) || TEKKEN.contains(&pre)
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
    /// The Llama 3 regex, number runs cut every `max_digits` characters (3; Qwen2: 1); with
    /// `tekken`, Mistral's Tekken regex (see the module doc).
    Llama3 { max_digits: usize, tekken: bool },
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
            (
                Scheme::Llama3 {
                    max_digits: 3,
                    tekken: false,
                },
                true,
            )
        } else if QWEN2.contains(&pre) {
            (
                Scheme::Llama3 {
                    max_digits: 1,
                    tekken: false,
                },
                false,
            )
        } else if TEKKEN.contains(&pre) {
            // llama.cpp sets `ignore_merges` for Tekken as for Llama 3.
            (
                Scheme::Llama3 {
                    max_digits: 1,
                    tekken: true,
                },
                true,
            )
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
            Scheme::Llama3 { max_digits, tekken } => {
                return self.split_llama3(text, max_digits, tekken, words);
            }
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
    /// parameter; with `tekken`, Mistral's Tekken regex (no contractions, case-pattern letter
    /// runs; see the module doc).
    fn split_llama3<'t>(
        &self,
        piece: &'t str,
        max_digits: usize,
        tekken: bool,
        words: &mut Vec<&'t str>,
    ) {
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
            // (?i:'s|'t|'re|'ve|'m|'ll|'d) (Llama 3 only)
            if !tekken && c == '\'' && pos + 1 < n {
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
            // [^\r\n\p{L}\p{N}]? then letters: Llama 3's \p{L}+, or Tekken's two case-pattern
            // alternatives (a lead character only counts if letters follow it).
            let lead = !is_newline(Some(c))
                && !matches!(here, Some(CharClass::Letter | CharClass::Number));
            let first = pos + usize::from(lead);
            if class(first) == Some(CharClass::Letter) {
                pos = if tekken {
                    tekken_letters_end(&chars, first, |i| class(i) == Some(CharClass::Letter))
                } else {
                    let mut end = first;
                    while class(end) == Some(CharClass::Letter) {
                        end += 1;
                    }
                    end
                };
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
            // ` ?[^\s\p{L}\p{N}]+[\r\n]*` (Tekken: `[\r\n/]*`: after a newline, `/` again)
            let run_class = if c == ' ' { class(pos + 1) } else { here };
            if run_class == Some(CharClass::Other) {
                pos += usize::from(c == ' ');
                while class(pos) == Some(CharClass::Other) {
                    pos += 1;
                }
                while is_newline(char_at(pos)) || (tekken && char_at(pos) == Some('/')) {
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

/// Where Tekken's `U*L+|U+L*` ends for the letter at `first` (`U` = `(?=\p{L})[^a-z]`, `L` =
/// `(?=\p{L})[^A-Z]`), as a backtracking engine finds it: `U*` takes the longest run, then
/// gives characters back until `L+` can start; where none can, `U+` takes the run and `L*`
/// nothing (the character after the run is not an `L`, or `L+` would have started there).
fn tekken_letters_end(
    chars: &[(usize, char)],
    first: usize,
    is_letter: impl Fn(usize) -> bool,
) -> usize {
    let upper = |i: usize| is_letter(i) && !chars[i].1.is_ascii_lowercase();
    let lower = |i: usize| is_letter(i) && !chars[i].1.is_ascii_uppercase();
    let mut run_end = first;
    while upper(run_end) {
        run_end += 1;
    }
    match (first..=run_end).rev().find(|&i| lower(i)) {
        Some(start) => {
            let mut end = start;
            while lower(end) {
                end += 1;
            }
            end
        }
        None => run_end,
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
    fn unknown_pre_tokenizers_are_named() {
        // Pre-tokenizers llama.cpp knows (some with test vocabularies in its sdist) and kvgate
        // does not implement; "default" is what a file without `tokenizer.ggml.pre` gets.
        for pre in [
            "qwen35",
            "deepseek-llm",
            "falcon",
            "chatglm-bpe",
            "default",
            "mistral",
        ] {
            let err = PreTokenizer::for_pre_type(pre).err();
            assert!(
                err.as_ref()
                    .is_some_and(|e| e.to_string().contains(&format!("`{pre}`"))),
                "{pre}: {:?}",
                err.map(|e| e.to_string())
            );
        }
    }

    #[test]
    fn tekken_splits_letters_by_case_pattern() {
        // `U*L+` first: an upper-case run followed by lower case is one word ("HTTPServer",
        // "Case"), a lower-case run stops at the next capital.
        assert_eq!(words("tekken", "camelCaseWord"), ["camel", "Case", "Word"]);
        assert_eq!(words("tekken", "HTTPServer x"), ["HTTPServer", " x"]);
        // `U+L*` when no lower case follows.
        assert_eq!(words("tekken", "HELLO world"), ["HELLO", " world"]);
        // Non-ASCII letters are both cases (llama.cpp's collapsed text): `É` alone ends `U*L+`
        // ("ÉCOLE": É, then COLE), and starts a word that continues in lower case ("École").
        assert_eq!(words("tekken", "ÉCOLE École"), ["É", "COLE", " École"]);
        assert_eq!(words("tekken", "AéB"), ["Aé", "B"]);
        // One lead character that is not a newline, letter or number, spaces included; but
        // only right before the letters (" (" is punctuation with its space, then "x").
        assert_eq!(
            words("tekken", "a/b (x) \u{3000}y"),
            ["a", "/b", " (", "x", ")", " ", "\u{3000}y"]
        );
    }

    #[test]
    fn tekken_has_no_contractions_and_single_digit_numbers() {
        assert_eq!(words("tekken", "don't"), ["don", "'t"]);
        assert_eq!(words("tekken", "IT'S"), ["IT", "'S"]);
        assert_eq!(words("tekken", "x 2024"), ["x", " ", "2", "0", "2", "4"]);
        assert_eq!(words("tekken", "٣½"), ["٣", "½"]);
    }

    #[test]
    fn tekken_punctuation_and_whitespace_runs() {
        // ` ?[^\s\p{L}\p{N}]+[\r\n/]*`: punctuation with one leading space and trailing newlines.
        assert_eq!(words("tekken", "path//\n\nx"), ["path", "//\n\n", "x"]);
        assert_eq!(words("tekken", "a ?!\r\nb"), ["a", " ?!\r\n", "b"]);
        // `/` counts with the trailing newlines (found by the proptest below), but a newline
        // alone is whitespace and a `/` after it leads the next letters.
        assert_eq!(words("tekken", "x.\n//y"), ["x", ".\n//", "y"]);
        assert_eq!(words("tekken", "a\n/b"), ["a", "\n", "/b"]);
        // `\s*[\r\n]+` up to the last newline, `\s+(?!\S)` leaving one space, `\s+` at the end.
        assert_eq!(words("tekken", "a \n\n b"), ["a", " \n\n", " b"]);
        assert_eq!(words("tekken", "a   b  "), ["a", "  ", " b", "  "]);
        // A combining mark is not a letter (llama.cpp collapses it to its own class).
        assert_eq!(words("tekken", "कि"), ["क", "ि"]);
    }

    #[test]
    fn tekken_and_llama3_add_bos_by_default_others_do_not() {
        assert!(adds_bos_by_default("tekken") && adds_bos_by_default("llama-bpe"));
        assert!(!adds_bos_by_default("qwen2") && !adds_bos_by_default("gpt-2"));
        let tekken = PreTokenizer::for_pre_type("tekken").expect("supported");
        assert!(
            tekken.ignores_merges(),
            "llama.cpp sets ignore_merges for tekken"
        );
    }

    /// The regexes the Llama 3 scanner stands for, as llama.cpp's converter writes them.
    const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
    const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    /// llama.cpp's rewrite of Mistral's Tekken regex (src/llama-vocab.cpp, pre-type TEKKEN).
    const TEKKEN_REGEX: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";

    /// Stand-ins for llama.cpp's collapsed bytes 0xD0 (other), 0xD1 (number), 0xD2 (letter):
    /// private-use characters, which no regex class here matches on its own.
    const COLLAPSED_OTHER: char = '\u{E0D0}';
    const COLLAPSED_NUMBER: char = '\u{E0D1}';
    const COLLAPSED_LETTER: char = '\u{E0D2}';

    /// llama.cpp's `unicode_regex_split` text collapse: ASCII stays, other whitespace becomes
    /// `\v`, other characters their class's byte (punctuation, marks and symbols all match
    /// only `[^\s\p{L}\p{N}]` here, so one stand-in serves them). Classes from the regex
    /// crate's Unicode tables, independently of [`CharClasses`].
    fn collapse_text(text: &str) -> String {
        let letter = fancy_regex::Regex::new(r"^\p{L}$").expect("compiles");
        let number = fancy_regex::Regex::new(r"^\p{N}$").expect("compiles");
        text.chars()
            .map(|c| {
                let one = c.to_string();
                if c.is_ascii() {
                    c
                } else if c.is_whitespace() {
                    '\u{0B}'
                } else if letter.is_match(&one).expect("runs") {
                    COLLAPSED_LETTER
                } else if number.is_match(&one).expect("runs") {
                    COLLAPSED_NUMBER
                } else {
                    COLLAPSED_OTHER
                }
            })
            .collect()
    }

    /// llama.cpp's regex collapse: `\p{L}` / `\p{N}` become the class's stand-in plus its ASCII
    /// members, bracketed unless already inside brackets.
    fn collapse_regex(regex: &str) -> String {
        let mut out = String::new();
        let mut inside = false;
        let mut rest = regex;
        let mut prev = None;
        while let Some(c) = rest.chars().next() {
            let class = if rest.starts_with(r"\p{L}") {
                Some(format!("{COLLAPSED_LETTER}A-Za-z"))
            } else if rest.starts_with(r"\p{N}") {
                Some(format!("{COLLAPSED_NUMBER}0-9"))
            } else {
                None
            };
            if let Some(class) = class {
                out.push_str(&if inside { class } else { format!("[{class}]") });
                rest = &rest[5..];
                prev = Some('}');
                continue;
            }
            if c == '[' && prev != Some('\\') {
                inside = true;
            } else if c == ']' && inside && prev != Some('\\') {
                inside = false;
            }
            out.push(c);
            rest = &rest[c.len_utf8()..];
            prev = Some(c);
        }
        out
    }

    /// The words llama.cpp's generic path (`unicode_regex_split_stl`) cuts from `text` with
    /// `regex` run on the collapsed text: every match a word, and any unmatched gap one too.
    fn collapsed_regex_words(regex: &fancy_regex::Regex, text: &str) -> Vec<String> {
        let collapsed = collapse_text(text);
        let chars: Vec<char> = text.chars().collect();
        let to_chars = |byte: usize| collapsed[..byte].chars().count();
        let mut out = Vec::new();
        let mut last = 0;
        for m in regex.find_iter(&collapsed) {
            let m = m.expect("regex runs");
            let (start, end) = (to_chars(m.start()), to_chars(m.end()));
            if start > last {
                out.push(chars[last..start].iter().collect());
            }
            out.push(chars[start..end].iter().collect());
            last = end;
        }
        if last < chars.len() {
            out.push(chars[last..].iter().collect());
        }
        out
    }

    #[test]
    fn the_collapsed_tekken_regex_is_the_one_llama_cpp_builds() {
        let collapsed = collapse_regex(TEKKEN_REGEX);
        assert!(collapsed.starts_with(&format!(
            "[^\\r\\n{COLLAPSED_LETTER}A-Za-z{COLLAPSED_NUMBER}0-9]?((?=[{COLLAPSED_LETTER}A-Za-z])([^a-z]))*"
        )));
        assert!(collapsed.contains(&format!("|[{COLLAPSED_NUMBER}0-9]|")));
        assert!(!collapsed.contains(r"\p{"));
        // On ASCII text the rewrite is the Hugging Face regex (ASCII letters are Lu or Ll).
        let hf = fancy_regex::Regex::new(
            r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        )
        .expect("compiles");
        let ascii = "HTTPServer camelCase don't x 2024 a/b ?!\n\n  end  ";
        assert_eq!(words("tekken", ascii), regex_words(&hf, ascii));
    }

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

        /// The Tekken scanner is llama.cpp's Tekken regex as llama.cpp runs it: on the
        /// collapsed text, every class mixed in, upper- and lower-case ASCII and non-ASCII
        /// letters (É, é, titlecase ǅ, 한) next to each other.
        #[test]
        fn tekken_scanner_equals_the_collapsed_regex(
            text in proptest::collection::vec(
                proptest::sample::select(vec![
                    "a", "Z", "É", "é", "ǅ", "한", "s", "T", "HTTP", "ab", "'", "1", "٣", "½",
                    " ", "  ", "\n", "\r", "\t", "\u{a0}", "\u{3000}", ".", "?!", "/", "(", "ि",
                    "🦀", "_", "\u{0b}", "\u{1c}",
                ]),
                0..24,
            ).prop_map(|parts| parts.concat())
        ) {
            let regex = fancy_regex::Regex::new(&collapse_regex(TEKKEN_REGEX)).expect("compiles");
            proptest::prop_assert_eq!(words("tekken", &text), collapsed_regex_words(&regex, &text));
        }
    }
}
