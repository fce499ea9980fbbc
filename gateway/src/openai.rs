//! OpenAI wire types for `/v1/chat/completions`, `/v1/completions` and `/v1/models`.
//!
//! Only shapes live here, no rules: every bound and default is applied once in `validate.rs`.
//! Request fields that carry numbers are deserialized wide (`i64`, `f64`) on purpose, so that a
//! negative `max_tokens` reaches validation and gets a message naming the field instead of a
//! generic type error. Unknown request fields are ignored. The options the embedded engine
//! cannot honour (logprobs, penalties, tools, JSON mode, ...) are kept as raw JSON values,
//! never typed, so a value of any shape still parses (and is forwarded as written to an
//! upstream engine); `validate.rs` refuses the ones that would change an embedded answer.
//! Response types mirror OpenAI's output field for field, including the `null`s clients expect
//! to see (`logprobs`, `finish_reason`).

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

// === Requests ===

/// Body of `POST /v1/chat/completions`.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    /// Deprecated by OpenAI in favour of `max_completion_tokens`; both are accepted.
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<StopSequences>,
    #[serde(default)]
    pub user: Option<String>,
    /// Number of choices; only 1 is supported.
    #[serde(default)]
    pub n: Option<i64>,
    /// Options only an upstream engine may honour are kept as the raw JSON the client wrote
    /// (`null` reads as absent), so a value of any shape parses and is forwarded unchanged;
    /// validation refuses, for the embedded engine, the values that would change its answer.
    #[serde(default)]
    pub logprobs: Option<serde_json::Value>,
    #[serde(default)]
    pub top_logprobs: Option<serde_json::Value>,
    #[serde(default)]
    pub response_format: Option<serde_json::Value>,
    #[serde(default)]
    pub tools: Option<serde_json::Value>,
    #[serde(default)]
    pub tool_choice: Option<serde_json::Value>,
    /// The legacy (pre-`tools`) function-calling pair, still sent by older clients.
    #[serde(default)]
    pub functions: Option<serde_json::Value>,
    #[serde(default)]
    pub function_call: Option<serde_json::Value>,
    #[serde(default)]
    pub frequency_penalty: Option<serde_json::Value>,
    #[serde(default)]
    pub presence_penalty: Option<serde_json::Value>,
    #[serde(default)]
    pub logit_bias: Option<serde_json::Value>,
}

/// Body of `POST /v1/completions` (the legacy text completion API).
#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: PromptInput,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub max_tokens: Option<i64>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<StopSequences>,
    #[serde(default)]
    pub user: Option<String>,
    #[serde(default)]
    pub n: Option<i64>,
    /// Echoing the prompt back is not supported; `true` is rejected by validation.
    #[serde(default)]
    pub echo: Option<bool>,
    /// As for chat: raw JSON, judged by validation for the embedded engine only.
    /// `logprobs` here is the number of top logprobs per token.
    #[serde(default)]
    pub logprobs: Option<serde_json::Value>,
    #[serde(default)]
    pub best_of: Option<serde_json::Value>,
    #[serde(default)]
    pub suffix: Option<serde_json::Value>,
    #[serde(default)]
    pub frequency_penalty: Option<serde_json::Value>,
    #[serde(default)]
    pub presence_penalty: Option<serde_json::Value>,
    #[serde(default)]
    pub logit_bias: Option<serde_json::Value>,
}

/// `stream_options` of a streaming request.
#[derive(Debug, Clone, Copy, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Who wrote a chat message. `developer` is OpenAI's newer name for `system`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    Developer,
    User,
    Assistant,
}

impl Role {
    /// The role name the model's chat template understands.
    pub fn template_name(self) -> &'static str {
        match self {
            Role::System | Role::Developer => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

/// One message of a chat conversation.
#[derive(Debug, Clone, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    /// `null` is allowed (OpenAI allows it for assistant turns) and reads as empty text.
    #[serde(default)]
    pub content: Option<MessageContent>,
    #[serde(default)]
    pub name: Option<String>,
}

/// Message content: a plain string or an array of typed parts.
#[derive(Debug, Clone, PartialEq)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One element of an array-form message content. Only `type: "text"` is supported; other part
/// types (images, audio) are kept so validation can name them in its error.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

/// `stop`: one string or an array of strings.
#[derive(Debug, Clone, PartialEq)]
pub struct StopSequences(pub Vec<String>);

/// `prompt` of the legacy completions API: one string or an array of strings.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptInput(pub Vec<String>);

// === Responses ===

/// Why generation ended, as OpenAI spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
}

/// Token accounting of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    /// How the prompt tokens were processed; kvgate always sends it with `cached_tokens`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

/// OpenAI's `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache instead of being computed.
    pub cached_tokens: u32,
}

impl Usage {
    pub fn new(prompt_tokens: u32, completion_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: None,
        }
    }

    /// Adds `prompt_tokens_details.cached_tokens`.
    pub fn with_cached_tokens(mut self, cached_tokens: u32) -> Self {
        self.prompt_tokens_details = Some(PromptTokensDetails { cached_tokens });
        self
    }
}

/// Non-streaming answer of `/v1/chat/completions`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatCompletion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<String>,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    /// Always `null`: log-probabilities are not offered.
    pub logprobs: Option<serde_json::Value>,
    pub finish_reason: FinishReason,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AssistantMessage {
    pub role: String,
    pub content: String,
}

/// One SSE chunk of a streaming chat completion.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<String>,
    pub choices: Vec<ChunkChoice>,
    /// Absent unless `stream_options.include_usage`; then `null` on every chunk but the last.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChunkChoice {
    pub index: u32,
    pub delta: Delta,
    pub logprobs: Option<serde_json::Value>,
    pub finish_reason: Option<FinishReason>,
}

/// What a chunk adds to the assistant message. The first chunk carries the role.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Delta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// Answer (or, with `stream`, one SSE chunk) of `/v1/completions`: both share one shape.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TextCompletion {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_fingerprint: Option<String>,
    pub choices: Vec<TextChoice>,
    /// Always present on a full answer; on chunks it follows the chat chunk's rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Option<Usage>>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TextChoice {
    pub text: String,
    pub index: u32,
    pub logprobs: Option<serde_json::Value>,
    pub finish_reason: Option<FinishReason>,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ModelCard {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
}

/// Every error body: `{"error":{"message","type","param","code"}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

/// `param` and `code` are always present, `null` when they do not apply.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub error_type: String,
    pub param: Option<String>,
    pub code: Option<String>,
}

// === impl Deserialize for the string-or-array fields ===

/// Visits either one string or an array of `T`, so errors can say what was expected instead of
/// serde's "did not match any variant of untagged enum".
struct OneOrMany<T> {
    expecting: &'static str,
    item: PhantomData<T>,
}

impl<T> OneOrMany<T> {
    fn new(expecting: &'static str) -> Self {
        OneOrMany {
            expecting,
            item: PhantomData,
        }
    }
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for OneOrMany<T> {
    /// `Ok` for a single string, `Err` for an array.
    type Value = Result<String, Vec<T>>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(self.expecting)
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Ok(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(Ok(v))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        // The hint comes from the client; cap it so a lying length cannot reserve memory.
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Err(items))
    }
}

impl<'de> Deserialize<'de> for MessageContent {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let visitor = OneOrMany::<ContentPart>::new("a string or an array of content parts");
        Ok(match d.deserialize_any(visitor)? {
            Ok(text) => MessageContent::Text(text),
            Err(parts) => MessageContent::Parts(parts),
        })
    }
}

/// Reads a string or an array of strings into one list.
fn one_or_many_strings<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    let visitor = OneOrMany::<String>::new("a string or an array of strings");
    Ok(match d.deserialize_any(visitor)? {
        Ok(one) => vec![one],
        Err(many) => many,
    })
}

impl<'de> Deserialize<'de> for StopSequences {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        one_or_many_strings(d).map(StopSequences)
    }
}

impl<'de> Deserialize<'de> for PromptInput {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        one_or_many_strings(d).map(PromptInput)
    }
}

#[cfg(test)]
mod tests;
