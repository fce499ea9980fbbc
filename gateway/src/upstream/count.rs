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

use kvgate_runtime::chat_template::TemplateError;
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
        let bpe = tiktoken_rs::bpe_for_tokenizer(tokenizer)
            .unwrap_or_else(|_| tiktoken_rs::cl100k_base_singleton());
        TiktokenCounter {
            bpe,
            encoding: encoding_name(tokenizer),
        }
    }

    /// The encoding's name, e.g. `cl100k_base`.
    pub fn encoding(&self) -> &'static str {
        self.encoding
    }

    /// Tokens of plain text (special-token markup counts as text).
    pub fn count_text(&self, text: &str) -> usize {
        self.bpe.count_ordinary(text)
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
            ids.extend(self.bpe.encode_ordinary(turn.role));
            ids.extend(self.bpe.encode_ordinary(&turn.content));
        }
        ids.extend(std::iter::repeat_n(FRAMING_TOKEN, REPLY_PRIMING));
        Ok(ids)
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
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
