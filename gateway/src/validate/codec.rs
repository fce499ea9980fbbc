//! The seam between validation and the model's tokenizer: [`PromptCodec`], implemented here
//! for the runtime's [`Tokenizer`] and in tests by a fake, so validation rules need no model.

use kvgate_runtime::chat_template::ChatMessage;
use kvgate_runtime::tokenizer::Tokenizer;

/// What validation needs from the model's tokenizer.
pub trait PromptCodec: Send + Sync {
    /// Renders a conversation with the model's chat template, ending with the assistant prompt.
    fn render_chat(&self, turns: &[TemplateTurn]) -> Result<String, String>;
    /// Token ids of `text`; special-token markup (`<|im_start|>`) becomes control tokens.
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
    fn render_chat(&self, turns: &[TemplateTurn]) -> Result<String, String> {
        let messages: Vec<ChatMessage> = turns
            .iter()
            .map(|turn| ChatMessage::new(turn.role, turn.content.as_str()))
            .collect();
        self.apply_chat_template(&messages, true)
            .map_err(|error| error.to_string())
    }

    fn encode(&self, text: &str) -> Vec<u32> {
        // `true`: the rendered template's `<|im_start|>` markup must become control tokens.
        Tokenizer::encode(self, text, true)
    }
}
