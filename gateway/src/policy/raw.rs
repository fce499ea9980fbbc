//! Phase one of policy loading: the policy file exactly as written, with source spans.
//!
//! Nothing here applies defaults or checks meaning; it only records what the user typed and
//! where (`toml::Spanned`), so that phase two (`policy.rs`) can name the file, line, column and
//! field of every semantic error. `deny_unknown_fields` turns typos into errors instead of
//! silently ignored settings.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Deserialize;
use toml::Spanned;

/// The whole file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawPolicy {
    pub anonymous_tenant: Option<Spanned<String>>,
    pub unknown_keys: Option<Spanned<RawUnknownKeys>>,
    #[serde(default)]
    pub admin_key_sha256: Vec<Spanned<String>>,
    #[serde(default)]
    pub defaults: RawLimits,
    #[serde(default)]
    pub tenants: BTreeMap<Spanned<String>, RawLimits>,
    #[serde(default)]
    pub kv: RawKv,
    #[serde(default)]
    pub lanes: RawLanes,
    pub shared: Option<Spanned<RawShared>>,
}

/// `[shared]`: tenant limits kept in Redis, shared by every gateway replica that names it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawShared {
    pub redis: Spanned<String>,
    pub timeout: Option<Spanned<String>>,
    pub on_store_error: Option<Spanned<RawOnStoreError>>,
    pub replicas: Option<Spanned<i64>>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawOnStoreError {
    Local,
    Allow,
    Deny,
}

/// `unknown_keys`: what a bearer key that matches no tenant gets.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawUnknownKeys {
    Anonymous,
    Reject,
}

/// `[defaults]` and each `[tenants.NAME]`: every limit is optional so a tenant inherits what it
/// does not set. `key_sha256` is only meaningful for tenants; phase two rejects it in defaults.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
    pub key_sha256: Option<Spanned<Vec<Spanned<String>>>>,
    pub max_input_tokens: Option<Spanned<i64>>,
    pub max_output_tokens: Option<Spanned<i64>>,
    pub max_total_tokens: Option<Spanned<i64>>,
    pub max_messages: Option<Spanned<i64>>,
    pub overflow: Option<Spanned<RawOverflow>>,
    pub max_concurrency: Option<Spanned<i64>>,
    pub max_validating: Option<Spanned<i64>>,
    pub requests_per_minute: Option<Spanned<i64>>,
    pub tokens_per_minute: Option<Spanned<i64>>,
    pub queue_depth: Option<Spanned<i64>>,
    pub queue_tokens: Option<Spanned<i64>>,
    pub max_queue_wait: Option<Spanned<String>>,
    pub weight: Option<Spanned<i64>>,
    pub prefix_cache: Option<Spanned<RawPrefixCache>>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawPrefixCache {
    Tenant,
    Shared,
    Off,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawOverflow {
    Reject,
    TruncateOldest,
}

/// `[kv]`: how admission reserves KV blocks.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawKv {
    pub high_watermark: Option<Spanned<f64>>,
    pub reservation: Option<Spanned<RawReservation>>,
    pub prompt_headroom_blocks: Option<Spanned<i64>>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(super) enum RawReservation {
    Full,
    Prompt,
}

/// `[lanes]`: the long-prompt lane.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLanes {
    pub long_prompt_tokens: Option<Spanned<i64>>,
    pub long_max_concurrency: Option<Spanned<i64>>,
}

/// Parses durations such as `"30s"`, `"500ms"`, `"2m"` or `"1m30s"` (units h, m, s, ms).
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("`{text}` is not a duration; write e.g. \"30s\", \"500ms\" or \"1m30s\"");
    let mut rest = text.trim();
    if rest.is_empty() {
        return Err(bad());
    }
    let mut total = Duration::ZERO;
    while !rest.is_empty() {
        let digits_end = rest.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
        if digits_end == 0 {
            return Err(bad());
        }
        let amount: u64 = rest[..digits_end].parse().map_err(|_| bad())?;
        rest = &rest[digits_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let part = match &rest[..unit_end] {
            "ms" => Duration::from_millis(amount),
            "s" => Duration::from_secs(amount),
            "m" => Duration::from_secs(amount.saturating_mul(60)),
            "h" => Duration::from_secs(amount.saturating_mul(3600)),
            _ => return Err(bad()),
        };
        total = total.saturating_add(part);
        rest = &rest[unit_end..];
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_and_compounds() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_secs(3600)));
    }

    #[test]
    fn durations_without_units_or_with_unknown_units_are_rejected() {
        for text in ["", "30", "s", "5 sec", "1.5s", "-3s", "3d"] {
            assert!(parse_duration(text).is_err(), "{text:?} should not parse");
        }
    }
}
