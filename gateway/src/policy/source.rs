//! The policy file's text, for turning byte spans (from `toml::Spanned` and toml's own errors)
//! into `file:line:column: field: message` errors.

use std::ops::Range;
use std::path::Path;

use super::PolicyError;

/// The file being checked, for turning byte spans into `file:line:column` errors.
pub(crate) struct Source<'a> {
    pub path: &'a Path,
    pub text: &'a str,
}

impl Source<'_> {
    pub fn error(
        &self,
        span: Range<usize>,
        field: &str,
        message: impl Into<String>,
    ) -> PolicyError {
        let (line, column) = line_column(self.text, span.start);
        PolicyError::Invalid {
            path: self.path.to_path_buf(),
            line,
            column,
            field: field.to_string(),
            message: message.into(),
        }
    }

    /// Syntax, type and unknown-field errors: toml gives a span but not the key path, so the
    /// field is read back from the source around the span.
    pub fn toml_error(&self, err: &toml::de::Error) -> PolicyError {
        let span = err.span().unwrap_or(0..0);
        let field = field_at(self.text, span.start);
        self.error(span, &field, err.message().trim())
    }
}

/// 1-based line and column (in characters) of a byte offset.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let offset = offset.min(text.len());
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[line_start..].chars().count() + 1;
    (line, column)
}

/// Best-effort dotted key path (`tenants.alpha.weight`) of the key written at or before `offset`.
fn field_at(text: &str, offset: usize) -> String {
    let before = text.get(..offset.min(text.len())).unwrap_or(text);
    let line_end = text[before.len()..]
        .find('\n')
        .map_or(text.len(), |i| before.len() + i);
    let lines: Vec<&str> = text[..line_end].lines().collect();
    let strip_comment = |line: &str| line.split('#').next().unwrap_or("").trim().to_string();
    let mut key = None;
    for line in lines.iter().rev().map(|l| strip_comment(l)) {
        if let Some(header) = line.strip_prefix('[') {
            let header = header.trim_start_matches('[').trim_end_matches(']').trim();
            return match key {
                Some(key) => format!("{header}.{key}"),
                None => header.to_string(),
            };
        }
        if key.is_none()
            && let Some((name, _)) = line.split_once('=')
        {
            key = Some(name.trim().trim_matches('"').to_string());
        }
    }
    key.unwrap_or_else(|| "(document)".to_string())
}
