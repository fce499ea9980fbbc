//! Chat templates: turning a list of chat messages into the prompt text the model was tuned on.
//!
//! GGUF files carry the Hugging Face Jinja template in `tokenizer.chat_template`. It is rendered
//! with minijinja configured like the Jinja environments that transformers and llama-cpp-python
//! use (`trim_blocks`, `lstrip_blocks`, Python string methods such as `.strip()` via
//! minijinja-contrib's pycompat, a `raise_exception` function), with `messages`,
//! `add_generation_prompt`, `bos_token` and `eos_token` in scope. Files without a template get
//! ChatML, the format SmolLM2 and most small instruct models use.

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
}

/// A compiled chat template. Cheap to share: `Send + Sync`, rendering takes `&self`.
pub struct ChatTemplate {
    env: Environment<'static>,
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
        let template = self
            .env
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
    fn template_is_send_and_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
    }
}
