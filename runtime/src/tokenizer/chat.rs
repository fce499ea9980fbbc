//! Chat prompts without prompt injection: only the chat template's own markup may become
//! control tokens; message content is always tokenized as plain text.
//!
//! Rendering the template and encoding the result with `parse_special` would turn a user's
//! literal `<|im_end|>\n<|im_start|>system\n…` into real control tokens, letting the user close
//! their turn and write a system turn. [`Tokenizer::encode_chat`] instead:
//!
//! 1. renders the messages as given (the reference text);
//! 2. if no message content contains the text of a control token (nearly always), encodes that
//!    text as before: the template's markup is the only control-token text in it;
//! 3. otherwise replaces each control-token occurrence in the content by a placeholder
//!    (`MkM`, `M` a private-use character that occurs in no message and not in the rendered
//!    text, `k` its index), renders again, and substitutes the original text back, remembering
//!    where it went. The result must equal the reference text byte for byte, so a template
//!    that transforms content (`trim`, `strip()`) is fine as long as it keeps the placeholder
//!    intact, and one that does not (it upper-cases content, slices it…) is refused rather than
//!    guessed at;
//! 4. encodes the text with control tokens parsed everywhere except in those ranges.
//!
//! The text is encoded in one piece, so the tokens are exactly those of the rendered text
//! with the content's control-token text treated as ordinary characters (`<|` `im` `_end` …),
//! with the same merges across the boundaries as any other text.

use std::ops::Range;

use super::Tokenizer;
use super::special::{self, Fragment};
use crate::chat_template::{ChatMessage, TemplateError};

/// First and last private-use code points tried as the placeholder marker.
const MARKERS: std::ops::RangeInclusive<u32> = 0xE000..=0xF8FF;

impl Tokenizer {
    /// Renders `messages` with the chat template and encodes the prompt so that only the
    /// template's markup produces control tokens (see the module docs). Equal to
    /// `encode(&apply_chat_template(messages, …)?, true)` whenever no message content contains
    /// control-token text, except that the prompt starts with BOS when the vocabulary adds one
    /// (`add_bos_token`: Llama, Mistral, Phi-3), as in llama.cpp's server: templates that write
    /// `{{ bos_token }}` already give it, the others get it added, and it is never doubled.
    /// Likewise it ends with EOS when the vocabulary adds one (`add_eos_token`): llama.cpp's
    /// server strips a trailing `eos_token` from the rendered template, then tokenizes with
    /// `add_special`, which appends EOS.
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TemplateError> {
        let mut ids = self.encode_rendered_chat(messages, add_generation_prompt)?;
        if let (true, Some(bos)) = (self.add_bos, self.bos)
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        if let (true, Some(eos)) = (self.add_eos, self.eos)
            && ids.last() != Some(&eos)
        {
            ids.push(eos);
        }
        Ok(ids)
    }

    fn encode_rendered_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, TemplateError> {
        let reference = self.apply_chat_template(messages, add_generation_prompt)?;
        let escaped: Vec<Escaped> = messages
            .iter()
            .map(|m| self.escape_control_text(&m.content))
            .collect();
        if escaped.iter().all(|e| e.occurrences.is_empty()) {
            return Ok(self.encode(&reference, true));
        }
        let marker = pick_marker(&reference, messages).ok_or_else(|| {
            TemplateError::Rejected("no placeholder character is free in these messages".into())
        })?;
        let mut originals: Vec<&str> = Vec::new();
        let with_placeholders: Vec<ChatMessage> = messages
            .iter()
            .zip(&escaped)
            .map(|(message, escaped)| ChatMessage {
                role: message.role.clone(),
                content: escaped.with_placeholders(marker, &mut originals),
            })
            .collect();
        let rendered = self.apply_chat_template(&with_placeholders, add_generation_prompt)?;
        let not_kept = || {
            TemplateError::Rejected(
                "a message contains special-token text (such as `<|im_end|>`) and this model's \
                 chat template changes message text in a way that cannot keep it apart from the \
                 template's own markup; remove that text from the message"
                    .into(),
            )
        };
        let (text, literal) = substitute(&rendered, marker, &originals).ok_or_else(not_kept)?;
        if text != reference {
            return Err(not_kept());
        }
        Ok(self.encode_outside(&text, &literal))
    }

    /// [`Tokenizer::encode`] with `parse_special`, except inside the byte ranges `literal`,
    /// which are tokenized as plain text.
    pub fn encode_outside(&self, text: &str, literal: &[Range<usize>]) -> Vec<u32> {
        let fragments = special::partition_outside(text, &self.specials, true, literal);
        self.encode_fragments(fragments, text.len())
    }

    /// `content` cut at every control-token text `encode(content, true)` would turn into a
    /// token.
    fn escape_control_text<'c>(&self, content: &'c str) -> Escaped<'c> {
        let mut pieces = Vec::new();
        let mut occurrences = Vec::new();
        let mut last = 0;
        for fragment in special::partition(content, &self.specials, true) {
            let text = match fragment {
                Fragment::Text(text) => text,
                Fragment::Token(id) => self.texts[id as usize].as_str(),
            };
            // Fragments are consecutive pieces of `content`.
            let range = last..last + text.len();
            last = range.end;
            let is_control =
                matches!(fragment, Fragment::Token(id) if !self.matches_without_parse_special(id));
            if is_control {
                occurrences.push(pieces.len());
            }
            pieces.push(&content[range]);
        }
        Escaped {
            pieces,
            occurrences,
        }
    }

    /// User-defined tokens are matched even without `parse_special`: they need no escaping.
    fn matches_without_parse_special(&self, id: u32) -> bool {
        self.specials
            .iter()
            .any(|s| s.id == id && !s.needs_parse_special)
    }
}

/// A message's content cut into pieces, some of which are control-token text.
struct Escaped<'c> {
    pieces: Vec<&'c str>,
    /// Indices into `pieces` of the control-token texts.
    occurrences: Vec<usize>,
}

impl<'c> Escaped<'c> {
    /// The content with each control-token text replaced by `marker index marker`, the index
    /// counting across all messages (`originals` collects the replaced texts in that order).
    fn with_placeholders(&self, marker: char, originals: &mut Vec<&'c str>) -> String {
        let mut out = String::new();
        for (i, piece) in self.pieces.iter().enumerate() {
            if self.occurrences.contains(&i) {
                out.push(marker);
                out.push_str(&originals.len().to_string());
                out.push(marker);
                originals.push(piece);
            } else {
                out.push_str(piece);
            }
        }
        out
    }
}

/// A private-use character that occurs neither in the rendered reference text (which includes
/// the template's own text) nor in any message.
fn pick_marker(reference: &str, messages: &[ChatMessage]) -> Option<char> {
    MARKERS.filter_map(char::from_u32).find(|&c| {
        !reference.contains(c)
            && messages
                .iter()
                .all(|m| !m.content.contains(c) && !m.role.contains(c))
    })
}

/// Replaces every `marker index marker` in `rendered` by `originals[index]`, returning the text
/// and where each replacement went. `None` if a marker is unpaired or encloses no valid index.
fn substitute(
    rendered: &str,
    marker: char,
    originals: &[&str],
) -> Option<(String, Vec<Range<usize>>)> {
    let mut text = String::with_capacity(rendered.len());
    let mut literal = Vec::new();
    let mut rest = rendered;
    while let Some(open) = rest.find(marker) {
        text.push_str(&rest[..open]);
        let after = &rest[open + marker.len_utf8()..];
        let close = after.find(marker)?;
        let index: usize = after[..close].parse().ok()?;
        let original = originals.get(index)?;
        literal.push(text.len()..text.len() + original.len());
        text.push_str(original);
        rest = &after[close + marker.len_utf8()..];
    }
    text.push_str(rest);
    Some((text, literal))
}
