//! Per-tenant limits resolved one inheritance level at a time (built-ins → `[defaults]` →
//! `[tenants.NAME]`). Each value remembers where it was written, so a cross-field error can
//! point at the line the user must change.

use std::num::NonZeroU32;
use std::ops::Range;
use std::time::Duration;

use toml::Spanned;

use super::raw::{self, RawLimits, RawOverflow, RawPrefixCache};
use super::source::Source;
use super::{Overflow, PolicyError, PrefixCacheScope, TenantPolicy};

// Built-in limits, sized for a small model with an 8192-token context on a CPU.
const BUILTIN_MAX_INPUT_TOKENS: u64 = 2048;
const BUILTIN_MAX_OUTPUT_TOKENS: u64 = 512;
const BUILTIN_MAX_TOTAL_TOKENS: u64 = 2560;
const BUILTIN_MAX_MESSAGES: u64 = 64;
const BUILTIN_MAX_CONCURRENCY: u64 = 4;
/// Requests of one tenant being read or validated at once: as many as its queue holds by
/// default, so a burst the queue would absorb is not refused earlier, yet bounded, so one key's
/// slow uploads cannot tie up the server's connections and memory (each may buffer up to the
/// body limit).
const BUILTIN_MAX_VALIDATING: u64 = BUILTIN_QUEUE_DEPTH;
const BUILTIN_QUEUE_DEPTH: u64 = 64;
const BUILTIN_QUEUE_TOKENS: u64 = 65_536;
const BUILTIN_MAX_QUEUE_WAIT: Duration = Duration::from_secs(30);
const LONGEST_QUEUE_WAIT: Duration = Duration::from_secs(3600);

/// A resolved value and, when the file set it, where.
#[derive(Debug, Clone)]
pub(super) struct Field<T> {
    pub value: T,
    pub origin: Option<(Range<usize>, String)>,
}

impl<T> Field<T> {
    fn builtin(value: T) -> Field<T> {
        Field {
            value,
            origin: None,
        }
    }
}

/// Every per-tenant limit, resolved one inheritance level at a time.
#[derive(Debug, Clone)]
pub(super) struct Limits {
    max_input_tokens: Field<u64>,
    max_output_tokens: Field<u64>,
    max_total_tokens: Field<u64>,
    max_messages: Field<u64>,
    overflow: Field<Overflow>,
    max_concurrency: Field<u64>,
    max_validating: Field<u64>,
    requests_per_minute: Field<Option<u64>>,
    tokens_per_minute: Field<Option<u64>>,
    queue_depth: Field<u64>,
    queue_tokens: Field<u64>,
    max_queue_wait: Field<Duration>,
    weight: Field<u64>,
    prefix_cache: Field<PrefixCacheScope>,
}

impl Limits {
    pub fn builtin() -> Limits {
        Limits {
            max_input_tokens: Field::builtin(BUILTIN_MAX_INPUT_TOKENS),
            max_output_tokens: Field::builtin(BUILTIN_MAX_OUTPUT_TOKENS),
            max_total_tokens: Field::builtin(BUILTIN_MAX_TOTAL_TOKENS),
            max_messages: Field::builtin(BUILTIN_MAX_MESSAGES),
            overflow: Field::builtin(Overflow::Reject),
            max_concurrency: Field::builtin(BUILTIN_MAX_CONCURRENCY),
            max_validating: Field::builtin(BUILTIN_MAX_VALIDATING),
            requests_per_minute: Field::builtin(None),
            tokens_per_minute: Field::builtin(None),
            queue_depth: Field::builtin(BUILTIN_QUEUE_DEPTH),
            queue_tokens: Field::builtin(BUILTIN_QUEUE_TOKENS),
            max_queue_wait: Field::builtin(BUILTIN_MAX_QUEUE_WAIT),
            weight: Field::builtin(1),
            prefix_cache: Field::builtin(PrefixCacheScope::Tenant),
        }
    }

    /// `self` overridden by what `table` sets.
    pub fn inherit(
        &self,
        source: &Source,
        table: &str,
        own: &RawLimits,
    ) -> Result<Limits, PolicyError> {
        let int = |raw: &Option<Spanned<i64>>, parent: &Field<u64>, name: &str, min: i64| {
            int_field(source, table, name, raw, min, u64::MAX)
                .map(|f| f.unwrap_or_else(|| parent.clone()))
        };
        let rate = |raw: &Option<Spanned<i64>>, parent: &Field<Option<u64>>, name: &str| {
            let own = int_field(source, table, name, raw, 1, u64::from(u32::MAX))?;
            Ok::<_, PolicyError>(match own {
                Some(f) => Field {
                    value: Some(f.value),
                    origin: f.origin,
                },
                None => parent.clone(),
            })
        };
        let overflow = match &own.overflow {
            Some(v) => Field {
                value: match v.get_ref() {
                    RawOverflow::Reject => Overflow::Reject,
                    RawOverflow::TruncateOldest => Overflow::TruncateOldest,
                },
                origin: Some((v.span(), format!("{table}.overflow"))),
            },
            None => self.overflow.clone(),
        };
        let prefix_cache = match &own.prefix_cache {
            Some(v) => Field {
                value: match v.get_ref() {
                    RawPrefixCache::Tenant => PrefixCacheScope::Tenant,
                    RawPrefixCache::Shared => PrefixCacheScope::Shared,
                    RawPrefixCache::Off => PrefixCacheScope::Off,
                },
                origin: Some((v.span(), format!("{table}.prefix_cache"))),
            },
            None => self.prefix_cache.clone(),
        };
        let max_queue_wait = match &own.max_queue_wait {
            Some(text) => {
                let field = format!("{table}.max_queue_wait");
                let wait = raw::parse_duration(text.get_ref())
                    .map_err(|m| source.error(text.span(), &field, m))?;
                if wait.is_zero() || wait > LONGEST_QUEUE_WAIT {
                    return Err(source.error(
                        text.span(),
                        &field,
                        "must be more than 0 and at most 1h",
                    ));
                }
                Field {
                    value: wait,
                    origin: Some((text.span(), field)),
                }
            }
            None => self.max_queue_wait.clone(),
        };
        Ok(Limits {
            max_input_tokens: int(
                &own.max_input_tokens,
                &self.max_input_tokens,
                "max_input_tokens",
                1,
            )?,
            max_output_tokens: int(
                &own.max_output_tokens,
                &self.max_output_tokens,
                "max_output_tokens",
                1,
            )?,
            max_total_tokens: int(
                &own.max_total_tokens,
                &self.max_total_tokens,
                "max_total_tokens",
                1,
            )?,
            max_messages: int(&own.max_messages, &self.max_messages, "max_messages", 1)?,
            overflow,
            max_concurrency: int(
                &own.max_concurrency,
                &self.max_concurrency,
                "max_concurrency",
                1,
            )?,
            max_validating: int(
                &own.max_validating,
                &self.max_validating,
                "max_validating",
                1,
            )?,
            requests_per_minute: rate(
                &own.requests_per_minute,
                &self.requests_per_minute,
                "requests_per_minute",
            )?,
            tokens_per_minute: rate(
                &own.tokens_per_minute,
                &self.tokens_per_minute,
                "tokens_per_minute",
            )?,
            queue_depth: int(&own.queue_depth, &self.queue_depth, "queue_depth", 0)?,
            queue_tokens: int(&own.queue_tokens, &self.queue_tokens, "queue_tokens", 0)?,
            max_queue_wait,
            weight: int(&own.weight, &self.weight, "weight", 1)?,
            prefix_cache,
        })
    }

    /// Cross-field checks, then the typed tenant.
    pub fn into_tenant(
        self,
        source: &Source,
        table: &str,
        name: &str,
    ) -> Result<TenantPolicy, PolicyError> {
        for (part, part_name) in [
            (&self.max_input_tokens, "max_input_tokens"),
            (&self.max_output_tokens, "max_output_tokens"),
        ] {
            if part.value > self.max_total_tokens.value {
                let message = format!(
                    "{part_name} ({}) exceeds max_total_tokens ({}) for tenant `{name}`",
                    part.value, self.max_total_tokens.value
                );
                let (span, field) = blame(table, part, &self.max_total_tokens);
                return Err(source.error(span, &field, message));
            }
        }
        let to_usize = |f: Field<u64>| usize::try_from(f.value).unwrap_or(usize::MAX);
        let to_rate = |f: Field<Option<u64>>| to_rate(f.value);
        Ok(TenantPolicy {
            name: name.to_string(),
            max_input_tokens: to_usize(self.max_input_tokens),
            max_output_tokens: to_usize(self.max_output_tokens),
            max_total_tokens: to_usize(self.max_total_tokens),
            max_messages: to_usize(self.max_messages),
            overflow: self.overflow.value,
            max_concurrency: to_usize(self.max_concurrency),
            max_validating: to_usize(self.max_validating),
            requests_per_minute: to_rate(self.requests_per_minute),
            tokens_per_minute: to_rate(self.tokens_per_minute),
            queue_depth: to_usize(self.queue_depth),
            queue_tokens: to_usize(self.queue_tokens),
            max_queue_wait: self.max_queue_wait.value,
            weight: u32::try_from(self.weight.value)
                .ok()
                .and_then(NonZeroU32::new)
                .unwrap_or(NonZeroU32::MIN),
            prefix_cache: self.prefix_cache.value,
        })
    }
}

impl Limits {
    /// The request and token rates these limits set (`None`: unlimited).
    pub fn rates(&self) -> (Option<NonZeroU32>, Option<NonZeroU32>) {
        (
            to_rate(self.requests_per_minute.value),
            to_rate(self.tokens_per_minute.value),
        )
    }
}

fn to_rate(value: Option<u64>) -> Option<NonZeroU32> {
    value
        .and_then(|v| u32::try_from(v).ok())
        .and_then(NonZeroU32::new)
}

/// Which of two conflicting fields to point at: the one set in `table` if any, else whichever
/// was written at all (built-ins are consistent, so one of them was).
fn blame<A, B>(table: &str, a: &Field<A>, b: &Field<B>) -> (Range<usize>, String) {
    let in_table = |f: &Option<(Range<usize>, String)>| {
        f.as_ref().is_some_and(|(_, name)| name.starts_with(table))
    };
    let pick = if in_table(&a.origin) || (!in_table(&b.origin) && a.origin.is_some()) {
        &a.origin
    } else {
        &b.origin
    };
    pick.clone().unwrap_or((0..0, table.to_string()))
}

/// An integer setting in `[min, max]`; `None` when not written.
pub(super) fn int_field(
    source: &Source,
    table: &str,
    name: &str,
    raw: &Option<Spanned<i64>>,
    min: i64,
    max: u64,
) -> Result<Option<Field<u64>>, PolicyError> {
    let Some(raw) = raw else { return Ok(None) };
    let field = format!("{table}.{name}");
    let value = *raw.get_ref();
    match u64::try_from(value) {
        Ok(v) if value >= min && v <= max => Ok(Some(Field {
            value: v,
            origin: Some((raw.span(), field)),
        })),
        _ if value < min => Err(source.error(
            raw.span(),
            &field,
            format!("must be at least {min}, got {value}"),
        )),
        _ => Err(source.error(
            raw.span(),
            &field,
            format!("must be at most {max}, got {value}"),
        )),
    }
}
