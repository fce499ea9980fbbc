//! Chat templates: turning a list of chat messages into the prompt text the model was tuned on.
//!
//! GGUF files carry the Hugging Face Jinja template in `tokenizer.chat_template`. It is rendered
//! with minijinja configured like the Jinja environments that transformers and llama-cpp-python
//! use (`trim_blocks`, `lstrip_blocks`, Python string methods such as `.strip()` via
//! minijinja-contrib's pycompat, a `raise_exception` function), with `messages`,
//! `add_generation_prompt`, `bos_token` and `eos_token` in scope. Files without a template get
//! ChatML, the format SmolLM2 and most small instruct models use.

use std::sync::OnceLock;

use minijinja::{Environment, ErrorKind, Value, context};

/// ChatML, used when the GGUF file has no `tokenizer.chat_template`.
pub const FALLBACK_CHATML: &str = "{% for message in messages %}\
{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}\
{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const TEMPLATE_NAME: &str = "chat";

/// One chat message as the OpenAI API and the templates see it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Why a template could not be compiled or rendered. The gateway answers these with 400: they
/// come from the request (a message shape the template rejects) or from the model file.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("chat template does not compile: {0}")]
    Syntax(String),
    /// The template itself refused the messages (`raise_exception`), e.g. roles out of order.
    #[error("chat template rejected the messages: {0}")]
    Rejected(String),
    #[error("chat template failed to render: {0}")]
    Render(String),
    /// The template ran past its step budget ([`fuel_for`]): a template that loops without end
    /// (or nearly so) on these messages. The template is at fault, not the request.
    #[error(
        "chat template ran past its budget of {budget} steps on {messages} messages (does it \
         loop without end?); fix the model file's tokenizer.chat_template"
    )]
    OutOfFuel { budget: u64, messages: usize },
}

impl TemplateError {
    /// True when the template itself is broken (it does not compile, or it does not finish),
    /// whatever the messages: the operator's fault, not the caller's.
    pub fn is_template_fault(&self) -> bool {
        matches!(
            self,
            TemplateError::Syntax(_) | TemplateError::OutOfFuel { .. }
        )
    }
}

/// Fuel (minijinja's count of executed instructions) every render may use, whatever its size.
/// Real templates need far less: the 65 llama.cpp ships (models/templates/*.jinja) and
/// SmolLM2's use at most 550 steps on 2 messages and ~90 per message after that, except
/// Gemma 4's, which is quadratic (~3.6 × messages²: 24,500 steps at 64 messages, 3.7 million
/// at 1,000). At roughly 25 million steps a second (measured), this is ~10 ms of CPU.
const FUEL_BASE: u64 = 250_000;
/// Fuel per squared message count (rounded up to a tier, see [`fuel_for`]): 18 times what
/// Gemma 4's template needs, thousands of times what the linear templates need.
const FUEL_PER_MESSAGE_SQUARED: u64 = 64;
/// No render gets more than this (~40 s of CPU), however long the conversation: the most a
/// template that never ends can cost one request. Gemma 4's template fits ~16,000 messages.
const FUEL_MAX: u64 = 1_000_000_000;
/// Fuel tiers: conversations of up to 2^(4 + i) messages get tier i's budget.
const FUEL_TIERS: usize = 16;

/// The fuel a conversation of `messages` messages may use: its tier (messages rounded up to a
/// power of two, at least 16) and that tier's budget. The budget grows with the conversation
/// so that a long one renders with any real template, while a short one, which is validated
/// on the async workers (see the gateway's intake), stops a runaway template within
/// milliseconds.
fn fuel_for(messages: usize) -> (usize, u64) {
    let tier = match messages.max(16).checked_next_power_of_two() {
        Some(rounded) => (rounded.trailing_zeros() as usize - 4).min(FUEL_TIERS - 1),
        None => FUEL_TIERS - 1,
    };
    let n = 1u64 << (tier + 4);
    let budget = FUEL_BASE.saturating_add(FUEL_PER_MESSAGE_SQUARED.saturating_mul(n * n));
    (tier, budget.min(FUEL_MAX))
}

/// A compiled chat template. Cheap to share: `Send + Sync`, rendering takes `&self`.
pub struct ChatTemplate {
    /// The compiled template, without fuel; renders use a copy from `fueled`.
    env: Environment<'static>,
    /// `env` with tier i's fuel (see [`fuel_for`]), made on first use: minijinja takes the
    /// budget from the environment, and a clone shares the compiled template.
    fueled: [OnceLock<Environment<'static>>; FUEL_TIERS],
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token`/`eos_token` are the texts templates may reference.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        // transformers and llama-cpp-python render with trim_blocks and lstrip_blocks.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TemplateError::Syntax(describe(&e)))?;
        Ok(Self {
            env,
            fueled: std::array::from_fn(|_| OnceLock::new()),
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// Renders the prompt for `messages`; with `add_generation_prompt` it ends where the
    /// assistant's reply starts.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TemplateError> {
        let (tier, budget) = fuel_for(messages.len());
        let env = self.fueled[tier].get_or_init(|| {
            let mut env = self.env.clone();
            env.set_fuel(Some(budget));
            env
        });
        let template = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TemplateError::Syntax(describe(&e)))?;
        template
            .render(context! {
                messages => Value::from_serialize(messages),
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| match e.kind() {
                ErrorKind::InvalidOperation
                    if e.detail().is_some_and(|d| d.starts_with(RAISED)) =>
                {
                    let detail = e.detail().unwrap_or_default();
                    TemplateError::Rejected(one_line(detail.trim_start_matches(RAISED)))
                }
                ErrorKind::OutOfFuel => TemplateError::OutOfFuel {
                    budget,
                    messages: messages.len(),
                },
                _ => TemplateError::Render(describe(&e)),
            })
    }
}

/// Marks errors raised by the template itself, to tell them from rendering bugs.
const RAISED: &str = "raise_exception: ";

fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED}{message}"),
    ))
}

/// The error with its detail and location, without minijinja's multi-line debug dump.
fn describe(e: &minijinja::Error) -> String {
    match e.line() {
        Some(line) => format!("{} (line {line})", one_line(&e.to_string())),
        None => one_line(&e.to_string()),
    }
}

/// `text` with its line breaks (and the spaces around them) replaced by single spaces: the
/// template's own text (`raise_exception('a\nb')`) ends up in a one-line CLI error or log line.
fn one_line(text: &str) -> String {
    text.lines()
        .map(str::trim)
        .filter(|line| !line.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(r, c)| ChatMessage::new(*r, *c))
            .collect()
    }

    #[test]
    fn fallback_chatml_renders_turns_and_generation_prompt() {
        let t = ChatTemplate::new(FALLBACK_CHATML, "", "").expect("compiles");
        let out = t
            .render(&msgs(&[("system", "S"), ("user", "Hi")]), true)
            .expect("renders");
        assert_eq!(
            out,
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let no_prompt = t.render(&msgs(&[("user", "Hi")]), false).expect("renders");
        assert_eq!(no_prompt, "<|im_start|>user\nHi<|im_end|>\n");
    }

    #[test]
    fn python_string_methods_and_special_token_variables_work() {
        let src = "{{ bos_token }}{% for m in messages %}{{ m.content.strip().upper() }}|{% endfor %}{{ eos_token }}";
        let t = ChatTemplate::new(src, "<s>", "</s>").expect("compiles");
        let out = t
            .render(&msgs(&[("user", "  hi \n")]), false)
            .expect("renders");
        assert_eq!(out, "<s>HI|</s>");
    }

    #[test]
    fn trim_and_lstrip_blocks_match_transformers() {
        let src = "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        assert_eq!(
            t.render(&msgs(&[("user", "a")]), false).expect("renders"),
            "[a]\n"
        );
    }

    #[test]
    fn raise_exception_is_a_rejection_with_the_templates_message() {
        let src = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        let err = t
            .render(&msgs(&[("assistant", "x")]), false)
            .expect_err("rejected");
        assert_eq!(err, TemplateError::Rejected("first must be user".into()));
        // Its line breaks would split a one-line error.
        let t = ChatTemplate::new("{{ raise_exception('first\n  must\r\nbe user') }}", "", "")
            .expect("compiles");
        let err = t
            .render(&msgs(&[("user", "x")]), false)
            .expect_err("rejected");
        assert_eq!(err, TemplateError::Rejected("first must be user".into()));
    }

    #[test]
    fn syntax_errors_are_reported_at_compile_time() {
        let err = ChatTemplate::new("{% for m in messages %}", "", "").expect_err("unclosed for");
        assert!(matches!(err, TemplateError::Syntax(_)), "{err:?}");
    }

    #[test]
    fn a_template_that_never_ends_runs_out_of_fuel_within_milliseconds() {
        // 10^10 loop steps: without fuel this render takes hours.
        let src =
            "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}ok";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        let started = std::time::Instant::now();
        let err = t
            .render(&msgs(&[("user", "hi")]), true)
            .expect_err("stopped");
        let spent = started.elapsed();
        assert_eq!(
            err,
            TemplateError::OutOfFuel {
                budget: fuel_for(1).1,
                messages: 1
            }
        );
        assert!(err.is_template_fault());
        assert!(err.to_string().contains("tokenizer.chat_template"), "{err}");
        // Debug builds are slower; the budget is ~10 ms in release.
        assert!(spent < std::time::Duration::from_secs(2), "{spent:?}");
        // The same template keeps failing the same way, and a good render is unaffected.
        assert!(matches!(
            t.render(&msgs(&[("user", "hi")]), true),
            Err(TemplateError::OutOfFuel { .. })
        ));
    }

    #[test]
    fn a_quadratic_template_renders_long_conversations() {
        // Gemma 4's template looks back over the conversation for every message (~3.6 steps per
        // pair of messages); this one does ~3 per pair.
        let src =
            "{% for a in messages %}{% for b in messages %}{% endfor %}{{ a.content }}{% endfor %}";
        let t = ChatTemplate::new(src, "", "").expect("compiles");
        for n in [1usize, 64, 1000, 2000] {
            let messages = vec![ChatMessage::new("user", "x"); n];
            let out = t.render(&messages, false).expect("within budget");
            assert_eq!(out.len(), n);
        }
    }

    #[test]
    fn fuel_grows_with_the_conversation_by_tiers_up_to_a_cap() {
        assert_eq!(fuel_for(0), (0, FUEL_BASE + 64 * 16 * 16));
        assert_eq!(fuel_for(16), fuel_for(1));
        assert_eq!(fuel_for(17), (1, FUEL_BASE + 64 * 32 * 32));
        assert_eq!(fuel_for(1000), (6, FUEL_BASE + 64 * 1024 * 1024));
        let mut last = 0;
        for n in [1, 100, 10_000, 1 << 20, usize::MAX] {
            let (tier, budget) = fuel_for(n);
            assert!(tier < FUEL_TIERS && budget >= last && budget <= FUEL_MAX);
            last = budget;
        }
        assert_eq!(fuel_for(usize::MAX).1, FUEL_MAX);
    }

    #[test]
    fn template_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
    }
}
