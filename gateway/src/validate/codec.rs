//! The seam between validation and the model's tokenizer: [`PromptCodec`], implemented here
//! for the runtime's [`Tokenizer`] and in tests by a fake, so validation rules need no model.

use kvgate_runtime::chat_template::{ChatMessage, TemplateError};
use kvgate_runtime::tokenizer::Tokenizer;

/// What validation needs from the model's tokenizer.
pub trait PromptCodec: Send + Sync {
    /// Token ids of a conversation rendered with the model's chat template, ending with the
    /// assistant prompt. Only the template's own markup may become control tokens: message
    /// content is plain text, so a user cannot close their turn with a literal `<|im_end|>`.
    /// An error the template is at fault for ([`TemplateError::is_template_fault`]) is the
    /// operator's to fix, not the caller's.
    fn encode_chat(&self, turns: &[TemplateTurn]) -> Result<Vec<u32>, TemplateError>;
    /// Token ids of a raw `/v1/completions` prompt; special-token markup (`<|im_start|>`)
    /// becomes control tokens, since the caller writes the whole prompt. Starts with BOS when
    /// the vocabulary adds one (Llama, Mistral, Phi-3, Llama 3) and ends with EOS when it adds
    /// that (`add_eos_token`), as llama.cpp's server does.
    fn encode(&self, text: &str) -> Vec<u32>;
}

/// One message as the chat template sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TemplateTurn {
    pub role: &'static str,
    pub content: String,
}

// === impl PromptCodec for the model's tokenizer ===

impl PromptCodec for Tokenizer {
    fn encode_chat(&self, turns: &[TemplateTurn]) -> Result<Vec<u32>, TemplateError> {
        let messages: Vec<ChatMessage> = turns
            .iter()
            .map(|turn| ChatMessage::new(turn.role, turn.content.as_str()))
            .collect();
        Tokenizer::encode_chat(self, &messages, true)
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        Tokenizer::encode_with_specials(self, text, true)
    }
}
