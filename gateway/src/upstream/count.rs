//! Prompt token counts for an upstream whose tokenizer kvgate does not have: tiktoken's encoding
//! for the upstream's model id when tiktoken knows the name (`gpt-4o` → o200k_base), else
//! cl100k_base. For a non-OpenAI model (Llama, Qwen, SmolLM...) this is an **estimate**: the
//! upstream's own tokenizer may count more or fewer tokens for the same text (a smaller
//! vocabulary usually counts more). It is what the tenant's length limits and the capacity
//! reservation use; the upstream still enforces its own context window, and its answer's
//! `usage` has its real counts.
//!
//! Chat prompts follow OpenAI's counting convention (the tiktoken cookbook's
//! `num_tokens_from_messages`): each message costs its role and content tokens plus
//! [`TOKENS_PER_MESSAGE`] for the framing the chat format wraps around it, and the whole prompt
//! [`REPLY_PRIMING`] more for the start of the assistant's reply.
//!
//! For `cl100k_base` (every upstream whose model tiktoken does not know) the words are cut by
//! the runtime's hand-written scanner of the same regex ([`Cl100kWords`], the one Llama 3
//! vocabularies use) instead of tiktoken's regex engine, then merged by tiktoken's own
//! `byte_pair_split` on the encoding's ranks: the same ids (a test compares the two on random
//! text), without the regex engine's work per call: 4 to 9 times faster on short and long
//! prompts alike (`benches/count.rs`, BENCHMARKS.md "Counting an upstream's prompt").

use std::sync::OnceLock;

use kvgate_runtime::chat_template::TemplateError;
use kvgate_runtime::tokenizer::Cl100kWords;
use rustc_hash::FxHashMap;
use tiktoken_rs::CoreBPE;
use tiktoken_rs::tokenizer::{Tokenizer, get_tokenizer};

use crate::validate::{PromptCodec, TemplateTurn};

/// Framing tokens counted per chat message (`<|start|>{role}\n{content}<|end|>\n`).
pub const TOKENS_PER_MESSAGE: usize = 3;
/// Tokens counted once per chat prompt for the primed reply (`<|start|>assistant<|message|>`).
pub const REPLY_PRIMING: usize = 3;
/// Stands in for a framing token in [`PromptCodec::encode_chat`]'s output. The upstream's real
/// ids are unknown; only the count of what this codec returns is used, and it never leaves the
/// gateway (the client's JSON is what is forwarded).
pub const FRAMING_TOKEN: u32 = u32::MAX;

/// A tiktoken encoding used to count an upstream's prompts. Cheap to share (`Arc`).
pub struct TiktokenCounter {
    bpe: &'static CoreBPE,
    encoding: &'static str,
    /// The scanner and rank table of `cl100k_base`, when that is the encoding (and they built).
    cl100k: Option<&'static Cl100kTables>,
}

/// `cl100k_base` without tiktoken's regex: the word scanner, and the ranks by token bytes.
struct Cl100kTables {
    words: Cl100kWords,
    ranks: FxHashMap<Vec<u8>, u32>,
}

/// Ordinary (non-special) ranks of `cl100k_base`: 0 to 100,255.
const CL100K_ORDINARY_RANKS: u32 = 100_256;

impl Cl100kTables {
    /// Built once per process (~100k entries, some tens of milliseconds), from tiktoken's own
    /// table: each rank's bytes as it decodes them.
    fn shared() -> Option<&'static Cl100kTables> {
        static TABLES: OnceLock<Option<Cl100kTables>> = OnceLock::new();
        TABLES
            .get_or_init(|| {
                let bpe = tiktoken_rs::cl100k_base_singleton();
                let words = Cl100kWords::new().ok()?;
                let mut ranks = FxHashMap::default();
                ranks.reserve(CL100K_ORDINARY_RANKS as usize);
                for rank in 0..CL100K_ORDINARY_RANKS {
                    if let Ok(bytes) = bpe.decode_bytes(&[rank]) {
                        ranks.insert(bytes, rank);
                    }
                }
                Some(Cl100kTables { words, ranks })
            })
            .as_ref()
    }

    /// Appends the ids of `text` (special-token markup is text) to `ids`.
    fn encode_into(&self, text: &str, ids: &mut Vec<u32>) {
        let mut words = Vec::new();
        self.words.split(text, &mut words);
        for word in words {
            let bytes = word.as_bytes();
            if let Some(&rank) = self.ranks.get(bytes) {
                ids.push(rank);
            } else if bytes.len() > 1 {
                // tiktoken's merge; every part it leaves is a token (every byte is one).
                let parts = tiktoken_rs::byte_pair_split(bytes, &self.ranks);
                ids.extend(parts.iter().filter_map(|part| self.ranks.get(*part)));
            }
        }
    }
}

impl std::fmt::Debug for TiktokenCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TiktokenCounter")
            .field("encoding", &self.encoding)
            .finish()
    }
}

impl TiktokenCounter {
    /// The encoding tiktoken uses for `model`, or cl100k_base when it does not know the name.
    /// Building an encoding's `CoreBPE` takes a while (about a second for o200k_base): call
    /// this at startup. tiktoken-rs keeps one per encoding for the process, so upstreams that
    /// share an encoding share it.
    pub fn for_model(model: &str) -> TiktokenCounter {
        let tokenizer = get_tokenizer(model).unwrap_or(Tokenizer::Cl100kBase);
        let (bpe, tokenizer) = match tiktoken_rs::bpe_for_tokenizer(tokenizer) {
            Ok(bpe) => (bpe, tokenizer),
            Err(_) => (tiktoken_rs::cl100k_base_singleton(), Tokenizer::Cl100kBase),
        };
        let cl100k = match tokenizer {
            Tokenizer::Cl100kBase => Cl100kTables::shared(),
            _ => None,
        };
        TiktokenCounter {
            bpe,
            encoding: encoding_name(tokenizer),
            cl100k,
        }
    }

    /// The ids of plain text (special-token markup is text), appended to `ids`.
    fn encode_into(&self, text: &str, ids: &mut Vec<u32>) {
        match self.cl100k {
            Some(tables) => tables.encode_into(text, ids),
            None => ids.extend(self.bpe.encode_ordinary(text)),
        }
    }

    /// The encoding's name, e.g. `cl100k_base`.
    pub fn encoding(&self) -> &'static str {
        self.encoding
    }

    /// Tokens of plain text (special-token markup counts as text).
    pub fn count_text(&self, text: &str) -> usize {
        self.encode(text).len()
    }

    /// Tokens of a chat prompt by OpenAI's convention: per message, [`TOKENS_PER_MESSAGE`] +
    /// role + content; plus [`REPLY_PRIMING`].
    pub fn count_chat(&self, turns: &[TemplateTurn]) -> usize {
        turns
            .iter()
            .map(|turn| {
                TOKENS_PER_MESSAGE + self.count_text(turn.role) + self.count_text(&turn.content)
            })
            .sum::<usize>()
            + REPLY_PRIMING
    }
}

impl PromptCodec for TiktokenCounter {
    /// [`TiktokenCounter::count_chat`] tokens: the role and content ids in this encoding, with
    /// [`FRAMING_TOKEN`] for the framing and the reply priming.
    fn encode_chat(&self, turns: &[TemplateTurn]) -> Result<Vec<u32>, TemplateError> {
        let mut ids = Vec::new();
        for turn in turns {
            ids.extend(std::iter::repeat_n(FRAMING_TOKEN, TOKENS_PER_MESSAGE));
            self.encode_into(turn.role, &mut ids);
            self.encode_into(&turn.content, &mut ids);
        }
        ids.extend(std::iter::repeat_n(FRAMING_TOKEN, REPLY_PRIMING));
        Ok(ids)
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        self.encode_into(text, &mut ids);
        ids
    }
}

fn encoding_name(tokenizer: Tokenizer) -> &'static str {
    match tokenizer {
        Tokenizer::O200kHarmony => "o200k_harmony",
        Tokenizer::O200kBase => "o200k_base",
        Tokenizer::Cl100kBase => "cl100k_base",
        Tokenizer::P50kBase => "p50k_base",
        Tokenizer::P50kEdit => "p50k_edit",
        Tokenizer::R50kBase | Tokenizer::Gpt2 => "r50k_base",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(role: &'static str, content: &str) -> TemplateTurn {
        TemplateTurn {
            role,
            content: content.to_owned(),
        }
    }

    #[test]
    fn known_models_get_their_encoding_and_others_cl100k() {
        assert_eq!(
            TiktokenCounter::for_model("gpt-4o").encoding(),
            "o200k_base"
        );
        assert_eq!(
            TiktokenCounter::for_model("gpt-4").encoding(),
            "cl100k_base"
        );
        for unknown in ["llama", "meta-llama/Llama-3.1-8B-Instruct", ""] {
            assert_eq!(
                TiktokenCounter::for_model(unknown).encoding(),
                "cl100k_base",
                "{unknown:?}"
            );
        }
    }

    #[test]
    fn text_counts_match_cl100k() {
        let counter = TiktokenCounter::for_model("gpt-4");
        // Reference counts from OpenAI's tiktoken (cl100k_base).
        assert_eq!(counter.count_text("hello world"), 2);
        assert_eq!(counter.count_text(""), 0);
        assert_eq!(counter.encode("hello world"), vec![15339, 1917]);
        // Special-token markup in content is text, not a control token.
        assert!(counter.count_text("<|endoftext|>") > 1);
    }

    #[rustfmt::skip]
    const TRICKY_PIECES: &[&str] = &[
        "a", "Z", "hello", " world", "'s", "'T", "'re", "'LL", "'d", "'ve", "'m", "'x", "'",
        "1", "12", "1234567", " 42", "٣", "½", "Ⅻ", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n",
        " \n ", "\u{a0}", "\u{3000}", "!", "?!", " ...", "--", "\"", "/", "<|endoftext|>", "é",
        "É", "ß", "日本語", "한국어", "Ελλάδα", "кирилл", "\u{301}", "e\u{301}", "🙂", "👍🏽",
        "x\u{200d}y", "\u{feff}", "\u{85}", "_", "__init__", "$", "ü1", "A1b2",
    ];

    /// Text made of the pieces the cl100k regex treats differently: letters of several
    /// scripts and cases, digits and other numbers, contractions, spaces, tabs, newlines,
    /// punctuation runs, marks, emoji, and markup.
    fn tricky_text() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let pieces = prop::sample::select(TRICKY_PIECES.to_vec());
        prop::collection::vec(pieces, 0..24).prop_map(|parts| parts.concat())
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(2000))]
        /// The scanner and rank table give tiktoken's own ids for cl100k_base.
        #[test]
        fn cl100k_without_the_regex_encodes_as_tiktoken(text in tricky_text()) {
            let counter = TiktokenCounter::for_model("gpt-4");
            proptest::prop_assert!(counter.cl100k.is_some());
            let tiktoken = tiktoken_rs::cl100k_base_singleton().encode_ordinary(&text);
            proptest::prop_assert_eq!(counter.encode(&text), tiktoken);
        }

        /// The same on any text at all (every Unicode scalar value can come up).
        #[test]
        fn cl100k_without_the_regex_encodes_any_text_as_tiktoken(text in "(?s).{0,48}") {
            let counter = TiktokenCounter::for_model("gpt-4");
            let tiktoken = tiktoken_rs::cl100k_base_singleton().encode_ordinary(&text);
            proptest::prop_assert_eq!(counter.encode(&text), tiktoken);
        }
    }

    #[test]
    fn only_cl100k_takes_the_scanner() {
        assert!(TiktokenCounter::for_model("llama").cl100k.is_some());
        let o200k = TiktokenCounter::for_model("gpt-4o");
        assert!(o200k.cl100k.is_none());
        let text = "Hello, world! 12345 don't";
        assert_eq!(
            o200k.encode(text),
            tiktoken_rs::o200k_base_singleton().encode_ordinary(text)
        );
    }

    #[test]
    fn chat_counts_follow_openais_per_message_convention() {
        let counter = TiktokenCounter::for_model("gpt-4");
        let turns = [
            turn("system", "You are a helpful assistant."),
            turn("user", "hello world"),
        ];
        // (3 framing + 1 role + 6 content) + (3 + 1 + 2) + 3 for the reply priming.
        assert_eq!(counter.count_text("You are a helpful assistant."), 6);
        assert_eq!(counter.count_chat(&turns), 10 + 6 + 3);
        // The codec returns exactly that many ids, framing included.
        let ids = counter.encode_chat(&turns).unwrap();
        assert_eq!(ids.len(), counter.count_chat(&turns));
        assert_eq!(
            ids.iter().filter(|id| **id == FRAMING_TOKEN).count(),
            2 * TOKENS_PER_MESSAGE + REPLY_PRIMING
        );
        assert_eq!(counter.count_chat(&[]), REPLY_PRIMING);
    }
}
