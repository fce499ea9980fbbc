//! Request → [`ValidRequest`], once (TGI's shape): defaults, bounds, chat template, tokenization
//! and the tenant's length limits, so nothing downstream checks again.
//!
//! Cheap checks (model name, `n`, sampling bounds, message count) run before the expensive
//! ones (rendering and tokenizing), so a malformed burst costs little. Every [`ValidationError`]
//! names the offending field and, for length limits, states both the limit and the value given.
//! The tokenizer is reached through [`PromptCodec`] so these rules can be tested with a fake.

use crate::openai::{
    ChatCompletionRequest, ChatMessage as WireMessage, CompletionRequest, MessageContent,
    StreamOptions,
};
use crate::policy::Overflow;
pub use codec::{PromptCodec, TemplateTurn};
use serde_json::Value;
use truncate::fit_conversation;

/// At most this many stop sequences, as OpenAI allows.
pub const MAX_STOP_SEQUENCES: usize = 4;
/// A stop sequence longer than this is certainly a mistake (and costs the engine per token).
pub const MAX_STOP_BYTES: usize = 256;
/// `max_tokens` of a `/v1/completions` request that sets none: OpenAI's documented default for
/// the legacy completions API (chat has no fixed default; see [`finish_length_rules`]).
pub const COMPLETIONS_DEFAULT_MAX_TOKENS: u32 = 16;

/// The limits one request is validated against: the tenant's policy clipped by the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_input_tokens: u32,
    pub max_output_tokens: u32,
    pub max_total_tokens: u32,
    pub max_messages: u32,
    pub overflow: Overflow,
    /// The model's context window; no request may exceed it whatever the tenant allows.
    pub model_context: u32,
}

/// Which API a request came through; it decides the response shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

impl Endpoint {
    /// The request field that holds the prompt: what a length error names as `param`.
    pub fn prompt_param(self) -> &'static str {
        match self {
            Endpoint::Chat => "messages",
            Endpoint::Completion => "prompt",
        }
    }
}

/// What will generate the answer. The embedded engine honours fewer options than an upstream
/// engine, to which they are forwarded as the client wrote them (`upstream/proxy.rs`): only
/// for the embedded engine are they refused ([`ValidationError::UnsupportedOption`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Embedded,
    Upstream,
}

/// A request that passed every rule, with all defaults filled in.
#[derive(Debug, Clone, PartialEq)]
pub struct ValidRequest {
    pub endpoint: Endpoint,
    pub prompt_ids: Vec<u32>,
    /// Completion budget; `prompt_ids.len() + max_tokens` fits every limit.
    pub max_tokens: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    pub user: Option<String>,
    /// Messages dropped by `truncate_oldest` (0 when nothing was dropped).
    pub dropped_messages: usize,
}

impl ValidRequest {
    pub fn prompt_tokens(&self) -> u32 {
        u32::try_from(self.prompt_ids.len()).unwrap_or(u32::MAX)
    }
}

/// One variant per rule; messages name the field, the limit and the value given.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ValidationError {
    #[error("The model `{0}` does not exist or you do not have access to it.")]
    ModelNotFound(String),
    #[error("`n` must be 1 (got {0}): only one choice per request is supported")]
    UnsupportedN(i64),
    #[error("`echo` is not supported")]
    UnsupportedEcho,
    /// An option the embedded engine cannot honour, set to a value that would change the answer.
    #[error("`{param}` is not supported by the embedded engine; {accepted}")]
    UnsupportedOption {
        param: &'static str,
        /// What may be sent instead (the no-op values).
        accepted: &'static str,
    },
    #[error("`messages` must contain at least one message")]
    EmptyMessages,
    #[error("too many messages: {given} given, this tenant's policy allows at most {limit}")]
    TooManyMessages { given: usize, limit: u32 },
    #[error("content part type `{kind}` is not supported; only `text` parts are")]
    UnsupportedContentPart {
        message: usize,
        part: usize,
        kind: String,
    },
    #[error("a `text` content part must have a string `text` field")]
    MissingPartText { message: usize, part: usize },
    #[error("`prompt` must be one string (got {0} prompts); batched prompts are not supported")]
    PromptCount(usize),
    #[error("`prompt` must not be empty")]
    EmptyPrompt,
    #[error("`{param}` must be at least 1 (got {given})")]
    MaxTokensTooSmall { param: &'static str, given: i64 },
    #[error(
        "`{param}` is too large: {given}. {limit_name} allows at most {limit} completion tokens."
    )]
    MaxTokensTooLarge {
        param: &'static str,
        given: i64,
        limit: u32,
        /// What sets the limit: the tenant's policy or the model's context.
        limit_name: &'static str,
    },
    #[error("`temperature` must be between 0 and 2 (got {0})")]
    Temperature(f64),
    #[error("`top_p` must be greater than 0 and at most 1 (got {0})")]
    TopP(f64),
    #[error("`stop` may hold at most {MAX_STOP_SEQUENCES} sequences (got {0})")]
    TooManyStops(usize),
    #[error("`stop` sequences must be non-empty and at most {MAX_STOP_BYTES} bytes")]
    BadStop,
    #[error("the chat template could not render these messages: {0}")]
    Template(String),
    /// The model's chat template is broken whatever the messages (it does not compile, or it
    /// runs past its step budget): a server fault (500), logged, not the caller's mistake.
    #[error("The model's chat template failed: {0}")]
    BrokenTemplate(String),
    #[error(
        "This tenant's maximum input length is {limit} tokens. However, your prompt is \
         {prompt_tokens} tokens. Please reduce the length of the {what}."
    )]
    InputTooLong {
        prompt_tokens: u32,
        limit: u32,
        what: &'static str,
    },
    #[error(
        "This {limit_name} is {limit} tokens. However, you requested {} tokens ({prompt_tokens} \
         in the {what}, {max_tokens} in the completion). Please reduce the length of the {what} \
         or completion.", *prompt_tokens as u64 + *max_tokens as u64
    )]
    ContextLengthExceeded {
        prompt_tokens: u32,
        max_tokens: u32,
        limit: u32,
        limit_name: &'static str,
        what: &'static str,
    },
}

impl ValidationError {
    /// The request field at fault, as OpenAI's `param` (e.g. `messages[2].content[0].type`).
    pub fn param(&self) -> Option<String> {
        use ValidationError::*;
        let param = match self {
            ModelNotFound(_) => "model",
            UnsupportedN(_) => "n",
            UnsupportedEcho => "echo",
            UnsupportedOption { param, .. } => param,
            EmptyMessages | TooManyMessages { .. } => "messages",
            UnsupportedContentPart { message, part, .. } => {
                return Some(format!("messages[{message}].content[{part}].type"));
            }
            MissingPartText { message, part } => {
                return Some(format!("messages[{message}].content[{part}].text"));
            }
            PromptCount(_) | EmptyPrompt => "prompt",
            MaxTokensTooSmall { param, .. } | MaxTokensTooLarge { param, .. } => param,
            Temperature(_) => "temperature",
            TopP(_) => "top_p",
            TooManyStops(_) | BadStop => "stop",
            Template(_) => "messages",
            BrokenTemplate(_) => return None,
            InputTooLong { what, .. } | ContextLengthExceeded { what, .. } => what,
        };
        Some(param.to_owned())
    }

    /// OpenAI `error.code`.
    pub fn code(&self) -> &'static str {
        use ValidationError::*;
        match self {
            ModelNotFound(_) => "model_not_found",
            InputTooLong { .. } | ContextLengthExceeded { .. } => "context_length_exceeded",
            UnsupportedN(_)
            | UnsupportedEcho
            | UnsupportedOption { .. }
            | UnsupportedContentPart { .. }
            | PromptCount(_) => "unsupported_value",
            Template(_) => "invalid_messages",
            BrokenTemplate(_) => "chat_template_error",
            EmptyMessages | TooManyMessages { .. } | MissingPartText { .. } | EmptyPrompt => {
                "invalid_value"
            }
            MaxTokensTooSmall { .. } | MaxTokensTooLarge { .. } | Temperature(_) | TopP(_) => {
                "invalid_value"
            }
            TooManyStops(_) | BadStop => "invalid_value",
        }
    }

    /// True for the length-limit family OpenAI reports as `context_length_exceeded`.
    pub fn is_context_length(&self) -> bool {
        matches!(
            self,
            ValidationError::InputTooLong { .. } | ValidationError::ContextLengthExceeded { .. }
        )
    }
}

// === Chat ===

/// Validates a chat request for `model_name` under `limits`, to be answered by `engine`.
pub fn validate_chat(
    req: &ChatCompletionRequest,
    model_name: &str,
    limits: &Limits,
    codec: &dyn PromptCodec,
    engine: Engine,
) -> Result<ValidRequest, ValidationError> {
    check_model(&req.model, model_name)?;
    check_n(req.n)?;
    if engine == Engine::Embedded {
        check_embedded_options(&[
            (LOGPROBS, req.logprobs.as_ref()),
            (TOP_LOGPROBS, req.top_logprobs.as_ref()),
            (RESPONSE_FORMAT, req.response_format.as_ref()),
            (TOOLS, req.tools.as_ref()),
            (TOOL_CHOICE, req.tool_choice.as_ref()),
            (FUNCTIONS, req.functions.as_ref()),
            (FUNCTION_CALL, req.function_call.as_ref()),
            (FREQUENCY_PENALTY, req.frequency_penalty.as_ref()),
            (PRESENCE_PENALTY, req.presence_penalty.as_ref()),
            (LOGIT_BIAS, req.logit_bias.as_ref()),
        ])?;
    }
    if req.messages.is_empty() {
        return Err(ValidationError::EmptyMessages);
    }
    if req.messages.len() > limits.max_messages as usize {
        return Err(ValidationError::TooManyMessages {
            given: req.messages.len(),
            limit: limits.max_messages,
        });
    }
    let (max_tokens_param, max_tokens) = match (req.max_completion_tokens, req.max_tokens) {
        (Some(n), _) => ("max_completion_tokens", Some(n)),
        (None, n) => ("max_tokens", n),
    };
    let requested = check_max_tokens(max_tokens_param, max_tokens, limits)?;
    let sampling = check_sampling(req.temperature, req.top_p)?;
    let stop = check_stop(req.stop.as_ref().map(|s| s.0.as_slice()))?;
    let turns = template_turns(&req.messages)?;

    let fit = fit_conversation(&turns, requested, limits, codec)?;
    let max_tokens =
        finish_length_rules(fit.prompt_ids.len(), requested, None, limits, "messages")?;
    Ok(ValidRequest {
        endpoint: Endpoint::Chat,
        prompt_ids: fit.prompt_ids,
        max_tokens,
        temperature: sampling.0,
        top_p: sampling.1,
        seed: req.seed.map(seed_bits),
        stop,
        stream: req.stream.unwrap_or(false),
        include_usage: include_usage(req.stream_options),
        user: req.user.clone(),
        dropped_messages: fit.dropped_messages,
    })
}

/// Flattens OpenAI messages into template turns, rejecting non-text content parts.
fn template_turns(messages: &[WireMessage]) -> Result<Vec<TemplateTurn>, ValidationError> {
    let mut turns = Vec::with_capacity(messages.len());
    for (message_index, message) in messages.iter().enumerate() {
        let content = match &message.content {
            None => String::new(),
            Some(MessageContent::Text(text)) => text.clone(),
            Some(MessageContent::Parts(parts)) => {
                let mut joined = String::new();
                for (part_index, part) in parts.iter().enumerate() {
                    if part.kind != "text" {
                        return Err(ValidationError::UnsupportedContentPart {
                            message: message_index,
                            part: part_index,
                            kind: part.kind.clone(),
                        });
                    }
                    let text = part
                        .text
                        .as_deref()
                        .ok_or(ValidationError::MissingPartText {
                            message: message_index,
                            part: part_index,
                        })?;
                    joined.push_str(text);
                }
                joined
            }
        };
        turns.push(TemplateTurn {
            role: message.role.template_name(),
            content,
        });
    }
    Ok(turns)
}

// === Completions ===

/// Validates a legacy completions request for `model_name` under `limits`, to be answered by
/// `engine`.
pub fn validate_completion(
    req: &CompletionRequest,
    model_name: &str,
    limits: &Limits,
    codec: &dyn PromptCodec,
    engine: Engine,
) -> Result<ValidRequest, ValidationError> {
    check_model(&req.model, model_name)?;
    check_n(req.n)?;
    if req.echo == Some(true) {
        return Err(ValidationError::UnsupportedEcho);
    }
    if engine == Engine::Embedded {
        check_embedded_options(&[
            (COMPLETION_LOGPROBS, req.logprobs.as_ref()),
            (BEST_OF, req.best_of.as_ref()),
            (SUFFIX, req.suffix.as_ref()),
            (FREQUENCY_PENALTY, req.frequency_penalty.as_ref()),
            (PRESENCE_PENALTY, req.presence_penalty.as_ref()),
            (LOGIT_BIAS, req.logit_bias.as_ref()),
        ])?;
    }
    let prompt = match req.prompt.0.as_slice() {
        [one] => one,
        many => return Err(ValidationError::PromptCount(many.len())),
    };
    if prompt.is_empty() {
        return Err(ValidationError::EmptyPrompt);
    }
    let requested = check_max_tokens("max_tokens", req.max_tokens, limits)?;
    let sampling = check_sampling(req.temperature, req.top_p)?;
    let stop = check_stop(req.stop.as_ref().map(|s| s.0.as_slice()))?;

    let prompt_ids = codec.encode(prompt);
    let max_tokens = finish_length_rules(
        prompt_ids.len(),
        requested,
        Some(COMPLETIONS_DEFAULT_MAX_TOKENS),
        limits,
        "prompt",
    )?;
    Ok(ValidRequest {
        endpoint: Endpoint::Completion,
        prompt_ids,
        max_tokens,
        temperature: sampling.0,
        top_p: sampling.1,
        seed: req.seed.map(seed_bits),
        stop,
        stream: req.stream.unwrap_or(false),
        include_usage: include_usage(req.stream_options),
        user: req.user.clone(),
        dropped_messages: 0,
    })
}

// === Shared rules ===

fn check_model(requested: &str, served: &str) -> Result<(), ValidationError> {
    if requested == served {
        Ok(())
    } else {
        Err(ValidationError::ModelNotFound(requested.to_owned()))
    }
}

fn check_n(n: Option<i64>) -> Result<(), ValidationError> {
    match n {
        None | Some(1) => Ok(()),
        Some(other) => Err(ValidationError::UnsupportedN(other)),
    }
}

/// An option the embedded engine cannot honour: its name, the values that change nothing (the
/// ones clients send routinely, accepted), and how to say so.
struct EngineOption {
    param: &'static str,
    is_no_op: fn(&Value) -> bool,
    accepted: &'static str,
}

const LOGPROBS: EngineOption = EngineOption {
    param: "logprobs",
    is_no_op: |v| matches!(v, Value::Bool(false)),
    accepted: "omit it or set it to false",
};
/// Any value is refused: even one that would return nothing asks for logprobs.
const TOP_LOGPROBS: EngineOption = EngineOption {
    param: "top_logprobs",
    is_no_op: |_| false,
    accepted: "omit it",
};
const RESPONSE_FORMAT: EngineOption = EngineOption {
    param: "response_format",
    is_no_op: |v| {
        v.as_object()
            .and_then(|format| format.get("type"))
            .and_then(Value::as_str)
            == Some("text")
    },
    accepted: "omit it or set it to {\"type\": \"text\"}",
};
const TOOLS: EngineOption = EngineOption {
    param: "tools",
    is_no_op: |v| v.as_array().is_some_and(Vec::is_empty),
    accepted: "omit it or send an empty list",
};
/// `none` and `auto` (which, with no tools, is `none`) call no tool.
const TOOL_CHOICE: EngineOption = EngineOption {
    param: "tool_choice",
    is_no_op: |v| matches!(v.as_str(), Some("none" | "auto")),
    accepted: "omit it or set it to \"none\" or \"auto\"",
};
/// The legacy forms of `tools` and `tool_choice`, judged the same way.
const FUNCTIONS: EngineOption = EngineOption {
    param: "functions",
    ..TOOLS
};
const FUNCTION_CALL: EngineOption = EngineOption {
    param: "function_call",
    ..TOOL_CHOICE
};
const FREQUENCY_PENALTY: EngineOption = EngineOption {
    param: "frequency_penalty",
    is_no_op: is_zero,
    accepted: "omit it or set it to 0",
};
const PRESENCE_PENALTY: EngineOption = EngineOption {
    param: "presence_penalty",
    is_no_op: is_zero,
    accepted: "omit it or set it to 0",
};
const LOGIT_BIAS: EngineOption = EngineOption {
    param: "logit_bias",
    is_no_op: |v| v.as_object().is_some_and(serde_json::Map::is_empty),
    accepted: "omit it or send an empty object",
};
/// Completions' `logprobs` is a count; even 0 returns the sampled tokens' logprobs.
const COMPLETION_LOGPROBS: EngineOption = EngineOption {
    param: "logprobs",
    is_no_op: |v| matches!(v, Value::Bool(false)),
    accepted: "omit it",
};
const BEST_OF: EngineOption = EngineOption {
    param: "best_of",
    is_no_op: |v| v.as_f64() == Some(1.0),
    accepted: "omit it or set it to 1",
};
const SUFFIX: EngineOption = EngineOption {
    param: "suffix",
    is_no_op: |v| v.as_str() == Some(""),
    accepted: "omit it",
};

fn is_zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}

/// Refuses, in order, the first option given (not `null`) with a value that is not a no-op.
fn check_embedded_options(
    options: &[(EngineOption, Option<&Value>)],
) -> Result<(), ValidationError> {
    for (option, value) in options {
        if let Some(value) = value
            && !(option.is_no_op)(value)
        {
            return Err(ValidationError::UnsupportedOption {
                param: option.param,
                accepted: option.accepted,
            });
        }
    }
    Ok(())
}

/// Bounds an explicit completion budget; `None` means "use the default" (decided later, once
/// the prompt length is known).
fn check_max_tokens(
    param: &'static str,
    given: Option<i64>,
    limits: &Limits,
) -> Result<Option<u32>, ValidationError> {
    let Some(given) = given else { return Ok(None) };
    if given < 1 {
        return Err(ValidationError::MaxTokensTooSmall { param, given });
    }
    let (limit, limit_name) = if limits.model_context < limits.max_output_tokens {
        (limits.model_context, "The model's context length")
    } else {
        (limits.max_output_tokens, "This tenant's policy")
    };
    match u32::try_from(given) {
        Ok(n) if n <= limit => Ok(Some(n)),
        _ => Err(ValidationError::MaxTokensTooLarge {
            param,
            given,
            limit,
            limit_name,
        }),
    }
}

/// Temperature in [0, 2] (default 1) and top_p in (0, 1] (default 1), as OpenAI documents.
fn check_sampling(
    temperature: Option<f64>,
    top_p: Option<f64>,
) -> Result<(f32, f32), ValidationError> {
    let temperature = temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ValidationError::Temperature(temperature));
    }
    let top_p = top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ValidationError::TopP(top_p));
    }
    // The engine samples in f32: a top_p below f32's smallest positive value would round to 0,
    // which it refuses. It means "the most likely token only", which the smallest f32 keeps.
    Ok((temperature as f32, (top_p as f32).max(f32::MIN_POSITIVE)))
}

fn check_stop(stop: Option<&[String]>) -> Result<Vec<String>, ValidationError> {
    let stop = stop.unwrap_or_default();
    if stop.len() > MAX_STOP_SEQUENCES {
        return Err(ValidationError::TooManyStops(stop.len()));
    }
    if stop
        .iter()
        .any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES)
    {
        return Err(ValidationError::BadStop);
    }
    Ok(stop.to_vec())
}

/// OpenAI seeds are signed 64-bit; the sampler takes the same bits unsigned.
fn seed_bits(seed: i64) -> u64 {
    u64::from_ne_bytes(seed.to_ne_bytes())
}

fn include_usage(options: Option<StreamOptions>) -> bool {
    options.and_then(|o| o.include_usage).unwrap_or(false)
}

/// The tightest total (prompt + completion) limit and what to call it in messages.
fn total_limit(limits: &Limits) -> (u32, &'static str) {
    if limits.model_context <= limits.max_total_tokens {
        (limits.model_context, "model's maximum context length")
    } else {
        (limits.max_total_tokens, "tenant's maximum total length")
    }
}

/// Whether a prompt of `prompt_len` tokens leaves room for the completion.
fn prompt_fits(prompt_len: usize, requested: Option<u32>, limits: &Limits) -> bool {
    let (total, _) = total_limit(limits);
    let output = u64::from(requested.unwrap_or(1));
    prompt_len <= limits.max_input_tokens as usize && prompt_len as u64 + output <= u64::from(total)
}

/// Applies the length limits to the final prompt and returns the completion budget: the
/// requested one, or by default the tenant's output cap (further capped by `default_cap`, the
/// API's own default, where it has one) clipped to the room left.
fn finish_length_rules(
    prompt_len: usize,
    requested: Option<u32>,
    default_cap: Option<u32>,
    limits: &Limits,
    what: &'static str,
) -> Result<u32, ValidationError> {
    let prompt_tokens = u32::try_from(prompt_len).unwrap_or(u32::MAX);
    if prompt_tokens > limits.max_input_tokens {
        return Err(ValidationError::InputTooLong {
            prompt_tokens,
            limit: limits.max_input_tokens,
            what,
        });
    }
    let (limit, limit_name) = total_limit(limits);
    let room = limit.saturating_sub(prompt_tokens);
    let max_tokens = requested.unwrap_or_else(|| {
        let cap = default_cap.map_or(limits.max_output_tokens, |cap| {
            cap.min(limits.max_output_tokens)
        });
        cap.min(room)
    });
    if max_tokens == 0 || max_tokens > room {
        return Err(ValidationError::ContextLengthExceeded {
            prompt_tokens,
            max_tokens: max_tokens.max(1),
            limit,
            limit_name,
            what,
        });
    }
    Ok(max_tokens)
}

mod codec;
#[cfg(test)]
mod tests;
mod truncate;
