//! Why admission refused a request, and how that maps to HTTP: status, OpenAI error fields,
//! `Retry-After`, `x-should-retry` and the rate-limit headers. Counting goes through
//! `crate::metrics`, which owns every metric name.

use std::time::Duration;

use http::{HeaderMap, HeaderValue};

use crate::metrics::RejectReason;
use crate::queue::QueueFull;
use crate::ratelimit::{LimitKind, RateLimitHeaders, format_reset};
use crate::validate::ValidationError;

/// openai-python ignores a Retry-After above 120 s and does not retry at all; never send one.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(120);
/// Shortest Retry-After for capacity rejections: below a second, clients would just hammer.
pub const MIN_CAPACITY_RETRY_AFTER: Duration = Duration::from_secs(1);

/// A refused request.
#[derive(Debug, Clone, PartialEq)]
pub enum Rejection {
    /// Over the tenant's requests or tokens per minute; `retry_after` is governor's exact wait.
    RateLimited {
        tenant: String,
        kind: LimitKind,
        limit: u32,
        requested: u32,
        retry_after: Duration,
        headers: RateLimitHeaders,
    },
    /// The request alone is bigger than the tenant's token bucket: it can never pass.
    InsufficientQuota {
        tenant: String,
        kind: LimitKind,
        limit: u32,
        requested: u32,
        headers: RateLimitHeaders,
    },
    /// The request alone is bigger than the tenant's queue token bound: it can never be queued,
    /// so it can never pass (every request goes through the queue).
    QueueNeverFits {
        tenant: String,
        requested: u64,
        limit: u64,
        headers: RateLimitHeaders,
    },
    /// The tenant's queue is at its request or token bound.
    QueueFull {
        tenant: String,
        reason: QueueFull,
        retry_after: Duration,
        headers: RateLimitHeaders,
    },
    /// Waited the tenant's `max_queue_wait` without capacity freeing up.
    QueueTimeout {
        tenant: String,
        waited: Duration,
        retry_after: Duration,
        headers: RateLimitHeaders,
    },
    /// KV blocks are the bottleneck and the backlog cannot drain within the tenant's max wait.
    KvSaturated {
        tenant: String,
        needed_blocks: usize,
        estimated_wait: Duration,
        retry_after: Duration,
        headers: RateLimitHeaders,
    },
    /// The tenant's concurrency cap is the bottleneck: with its requests queued ahead, this
    /// one would not get one of the tenant's slots within its max wait.
    ConcurrencySaturated {
        tenant: String,
        /// u32s (saturated): the variant stays as small as [`Rejection::KvSaturated`].
        max_concurrency: u32,
        /// The tenant's requests queued ahead of this one.
        queued_ahead: u32,
        estimated_wait: Duration,
        retry_after: Duration,
        headers: RateLimitHeaders,
    },
    /// Needs more KV blocks than admission may ever reserve (`limit` says which bound).
    NeverFits {
        /// The blocks counted against `limit`: the reservation against the watermark, the
        /// whole sequence against the pool.
        needed_blocks: usize,
        total_blocks: usize,
        /// Blocks under the high watermark: the most that can be reserved.
        limit_blocks: usize,
        limit: NeverFitsLimit,
        /// The request field holding the prompt (`messages` or `prompt`).
        param: &'static str,
    },
    /// The tenant's key was removed by a policy reload while the request was queued.
    KeyRevoked { tenant: String },
    /// A policy reload lowered the tenant's length limits below this queued request: the
    /// error validation would give it now (`context_length_exceeded`).
    OverTenantLimit {
        tenant: String,
        error: ValidationError,
    },
    /// The shared rate-limit store failed and the policy says `on_store_error = "deny"`.
    StoreUnavailable { tenant: String },
    /// The admission dispatcher is gone (shutting down).
    Unavailable,
}

/// Which bound a [`Rejection::NeverFits`] request is over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NeverFitsLimit {
    /// Its reservation is over the blocks that may be reserved (the high watermark).
    Watermark,
    /// Its whole sequence (prompt + max_tokens) is over the pool, though its reservation (in
    /// `reservation = "prompt"` mode, the prompt alone) fits: it could never finish.
    Pool,
}

impl Rejection {
    /// HTTP status: 429 for limits and capacity, 503 for queue timeout, 400 when it never fits.
    pub fn status(&self) -> u16 {
        match self {
            Rejection::RateLimited { .. }
            | Rejection::InsufficientQuota { .. }
            | Rejection::QueueNeverFits { .. }
            | Rejection::QueueFull { .. }
            | Rejection::KvSaturated { .. }
            | Rejection::ConcurrencySaturated { .. } => 429,
            Rejection::QueueTimeout { .. }
            | Rejection::StoreUnavailable { .. }
            | Rejection::Unavailable => 503,
            Rejection::NeverFits { .. } | Rejection::OverTenantLimit { .. } => 400,
            Rejection::KeyRevoked { .. } => 401,
        }
    }

    /// OpenAI `error.code`; also the `reason` label of [`REQUESTS_REJECTED_TOTAL`].
    pub fn code(&self) -> &'static str {
        match self {
            Rejection::RateLimited { .. } => "rate_limit_exceeded",
            Rejection::InsufficientQuota { .. } | Rejection::QueueNeverFits { .. } => {
                "insufficient_quota"
            }
            Rejection::QueueFull { .. } => "queue_full",
            Rejection::QueueTimeout { .. } => "queue_timeout",
            Rejection::KvSaturated { .. } => "kv_cache_saturated",
            Rejection::ConcurrencySaturated { .. } => "concurrency_saturated",
            Rejection::NeverFits { .. } => "context_length_exceeded",
            // The code validation gives the same limit.
            Rejection::OverTenantLimit { error, .. } => error.code(),
            Rejection::KeyRevoked { .. } => "invalid_api_key",
            Rejection::StoreUnavailable { .. } => "rate_limit_store_unavailable",
            Rejection::Unavailable => "service_unavailable",
        }
    }

    /// OpenAI `error.type`.
    pub fn error_type(&self) -> &'static str {
        match self {
            Rejection::RateLimited { kind, .. } => kind.as_str(),
            Rejection::InsufficientQuota { .. } | Rejection::QueueNeverFits { .. } => {
                "insufficient_quota"
            }
            Rejection::QueueFull { .. } | Rejection::ConcurrencySaturated { .. } => "requests",
            Rejection::KvSaturated { .. } => "tokens",
            Rejection::QueueTimeout { .. }
            | Rejection::StoreUnavailable { .. }
            | Rejection::Unavailable => "server_error",
            Rejection::NeverFits { .. }
            | Rejection::KeyRevoked { .. }
            | Rejection::OverTenantLimit { .. } => "invalid_request_error",
        }
    }

    /// OpenAI `error.param`.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            Rejection::NeverFits { param, .. } => Some(param),
            Rejection::OverTenantLimit {
                error:
                    ValidationError::InputTooLong { what: param, .. }
                    | ValidationError::ContextLengthExceeded { what: param, .. }
                    | ValidationError::MaxTokensTooLarge { param, .. },
                ..
            } => Some(param),
            _ => None,
        }
    }

    /// OpenAI-style message naming the limit, the value and when to retry.
    pub fn message(&self) -> String {
        let per_minute = |kind: LimitKind| match kind {
            LimitKind::Requests => "requests per min (RPM)",
            LimitKind::Tokens => "tokens per min (TPM)",
            LimitKind::Concurrency => "concurrent requests across gateway replicas",
        };
        let retry = |after: &Duration| format!("Please try again in {}.", format_reset(*after));
        match self {
            Rejection::RateLimited {
                tenant,
                kind,
                limit,
                requested,
                retry_after,
                ..
            } => format!(
                "Rate limit reached for tenant {tenant} on {}: Limit {limit}, Requested {requested}. {}",
                per_minute(*kind),
                retry(retry_after)
            ),
            Rejection::InsufficientQuota {
                tenant,
                kind,
                limit,
                requested,
                ..
            } => format!(
                "This request needs {requested} {} but tenant {tenant}'s limit is {limit} {}, so it can never be admitted. Reduce the prompt or max_tokens.",
                kind.as_str(),
                per_minute(*kind)
            ),
            Rejection::QueueNeverFits {
                tenant,
                requested,
                limit,
                ..
            } => format!(
                "This request needs {requested} tokens but tenant {tenant}'s queue holds at most {limit} tokens, so it can never be admitted. Reduce the prompt or max_tokens."
            ),
            Rejection::QueueFull {
                tenant,
                reason,
                retry_after,
                ..
            } => {
                format!(
                    "Too many requests queued for tenant {tenant}: {reason}. {}",
                    retry(retry_after)
                )
            }
            Rejection::QueueTimeout {
                tenant,
                waited,
                retry_after,
                ..
            } => format!(
                "Request from tenant {tenant} waited {} in the queue without capacity becoming free. {}",
                format_reset(*waited),
                retry(retry_after)
            ),
            Rejection::KvSaturated {
                needed_blocks,
                estimated_wait,
                retry_after,
                ..
            } => format!(
                "The KV cache is saturated: this request needs {needed_blocks} blocks and the backlog ahead of it needs about {} to drain, longer than the queue may wait. {}",
                format_reset(*estimated_wait),
                retry(retry_after)
            ),
            Rejection::ConcurrencySaturated {
                tenant,
                max_concurrency,
                queued_ahead,
                estimated_wait,
                retry_after,
                ..
            } => format!(
                "Tenant {tenant} runs at most {max_concurrency} at once (max_concurrency), and with {queued_ahead} of its requests queued ahead of this one this request would start in about {}, later than the queue may wait. {}",
                format_reset(*estimated_wait),
                retry(retry_after)
            ),
            Rejection::NeverFits {
                needed_blocks,
                total_blocks,
                limit_blocks,
                limit: NeverFitsLimit::Watermark,
                ..
            } => format!(
                "This request needs {needed_blocks} KV cache blocks (prompt + max_tokens), but at most {limit_blocks} of the cache's {total_blocks} blocks can be reserved for requests. Reduce the prompt or max_tokens."
            ),
            Rejection::NeverFits {
                needed_blocks,
                total_blocks,
                limit: NeverFitsLimit::Pool,
                ..
            } => format!(
                "This request needs {needed_blocks} KV cache blocks for its whole sequence (prompt + max_tokens), but the cache has only {total_blocks} blocks, so it could never finish. Reduce the prompt or max_tokens."
            ),
            Rejection::KeyRevoked { .. } => {
                "The API key was revoked while the request was queued.".to_string()
            }
            Rejection::OverTenantLimit { error, .. } => error.to_string(),
            Rejection::StoreUnavailable { tenant } => format!(
                "The shared rate-limit store is unavailable, and the policy refuses tenant {tenant}'s requests until it is back (on_store_error = \"deny\"). Please retry."
            ),
            Rejection::Unavailable => "The server is shutting down. Please retry.".to_string(),
        }
    }

    /// When to retry, never above 120 s; `None` when retrying cannot help.
    pub fn retry_after(&self) -> Option<Duration> {
        let after = match self {
            Rejection::RateLimited { retry_after, .. }
            | Rejection::QueueFull { retry_after, .. }
            | Rejection::QueueTimeout { retry_after, .. }
            | Rejection::KvSaturated { retry_after, .. }
            | Rejection::ConcurrencySaturated { retry_after, .. } => *retry_after,
            Rejection::Unavailable | Rejection::StoreUnavailable { .. } => MIN_CAPACITY_RETRY_AFTER,
            Rejection::InsufficientQuota { .. }
            | Rejection::QueueNeverFits { .. }
            | Rejection::NeverFits { .. }
            | Rejection::OverTenantLimit { .. }
            | Rejection::KeyRevoked { .. } => return None,
        };
        Some(after.min(MAX_RETRY_AFTER))
    }

    /// Whether the same request could succeed later (`x-should-retry`).
    pub fn should_retry(&self) -> bool {
        self.retry_after().is_some()
    }

    /// The tenant's rate-limit state at the time of the rejection; `None` for rejections
    /// decided before the rate limits were looked at (the stack's rate-limit layer then
    /// reports the tenant's live state).
    pub fn rate_headers(&self) -> Option<RateLimitHeaders> {
        match self {
            Rejection::RateLimited { headers, .. }
            | Rejection::InsufficientQuota { headers, .. }
            | Rejection::QueueNeverFits { headers, .. }
            | Rejection::QueueFull { headers, .. }
            | Rejection::QueueTimeout { headers, .. }
            | Rejection::KvSaturated { headers, .. }
            | Rejection::ConcurrencySaturated { headers, .. } => Some(headers.clone()),
            Rejection::NeverFits { .. }
            | Rejection::OverTenantLimit { .. }
            | Rejection::KeyRevoked { .. }
            | Rejection::StoreUnavailable { .. }
            | Rejection::Unavailable => None,
        }
    }

    /// Writes `retry-after` (whole seconds, rounded up), `retry-after-ms`, `x-should-retry` and
    /// the `x-ratelimit-*` headers it knows.
    pub fn apply_headers(&self, headers: &mut HeaderMap) {
        if let Some(rate) = self.rate_headers() {
            rate.apply(headers);
        }
        if let Some(after) = self.retry_after() {
            let millis = after.as_nanos().div_ceil(1_000_000);
            headers.insert(
                "retry-after",
                HeaderValue::from(millis.div_ceil(1000) as u64),
            );
            headers.insert("retry-after-ms", HeaderValue::from(millis as u64));
        }
        let should_retry = if self.should_retry() { "true" } else { "false" };
        headers.insert("x-should-retry", HeaderValue::from_static(should_retry));
    }

    /// The `reason` label of `kvgate_requests_rejected_total`.
    pub fn reason(&self) -> RejectReason {
        match self {
            Rejection::RateLimited { .. } => RejectReason::Rate,
            Rejection::InsufficientQuota { .. } | Rejection::QueueNeverFits { .. } => {
                RejectReason::Quota
            }
            Rejection::QueueFull { .. } => RejectReason::QueueFull,
            Rejection::QueueTimeout { .. } => RejectReason::QueueTimeout,
            Rejection::KvSaturated { .. } => RejectReason::KvSaturation,
            Rejection::ConcurrencySaturated { .. } => RejectReason::ConcurrencySaturation,
            Rejection::NeverFits { .. } | Rejection::OverTenantLimit { .. } => RejectReason::Length,
            Rejection::KeyRevoked { .. } => RejectReason::Auth,
            Rejection::Unavailable | Rejection::StoreUnavailable { .. } => {
                RejectReason::Unavailable
            }
        }
    }

    /// Counts this rejection in `kvgate_requests_rejected_total`.
    pub(super) fn count(&self, tenant: &str) {
        crate::metrics::record_rejection(tenant, self.reason());
    }
}

/// Clamps a capacity estimate to what a client should be told: [1 s, 120 s].
pub(super) fn clamp_retry_after(estimate: Duration) -> Duration {
    estimate.clamp(MIN_CAPACITY_RETRY_AFTER, MAX_RETRY_AFTER)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_codes_and_retry_headers_follow_the_conventions() {
        let headers = RateLimitHeaders::default();
        let limited = Rejection::RateLimited {
            tenant: "a".into(),
            kind: LimitKind::Tokens,
            limit: 1000,
            requested: 300,
            retry_after: Duration::from_millis(1574),
            headers: headers.clone(),
        };
        assert_eq!(
            (limited.status(), limited.code(), limited.error_type()),
            (429, "rate_limit_exceeded", "tokens")
        );
        assert!(
            limited.message().contains("Please try again in 1.574s."),
            "{}",
            limited.message()
        );
        let mut out = HeaderMap::new();
        limited.apply_headers(&mut out);
        assert_eq!(out["retry-after"], "2");
        assert_eq!(out["retry-after-ms"], "1574");
        assert_eq!(out["x-should-retry"], "true");

        let never = Rejection::NeverFits {
            needed_blocks: 600,
            total_blocks: 512,
            limit_blocks: 460,
            limit: NeverFitsLimit::Watermark,
            param: "messages",
        };
        assert_eq!(
            (never.status(), never.code(), never.param()),
            (400, "context_length_exceeded", Some("messages"))
        );
        let mut out = HeaderMap::new();
        never.apply_headers(&mut out);
        assert!(out.get("retry-after").is_none());
        assert_eq!(out["x-should-retry"], "false");

        let quota = Rejection::InsufficientQuota {
            tenant: "a".into(),
            kind: LimitKind::Tokens,
            limit: 10,
            requested: 11,
            headers,
        };
        assert_eq!((quota.status(), quota.should_retry()), (429, false));
    }

    #[test]
    fn every_rejection_has_a_reason_label() {
        assert_eq!(Rejection::Unavailable.reason(), RejectReason::Unavailable);
        let never = Rejection::NeverFits {
            needed_blocks: 9,
            total_blocks: 4,
            limit_blocks: 3,
            limit: NeverFitsLimit::Pool,
            param: "prompt",
        };
        assert_eq!(never.reason().as_str(), "length");
        let revoked = Rejection::KeyRevoked { tenant: "a".into() };
        assert_eq!(
            (revoked.status(), revoked.code(), revoked.reason().as_str()),
            (401, "invalid_api_key", "auth")
        );
        assert!(!revoked.should_retry());
    }

    #[test]
    fn retry_after_never_exceeds_two_minutes() {
        let timeout = Rejection::QueueTimeout {
            tenant: "a".into(),
            waited: Duration::from_secs(30),
            retry_after: Duration::from_secs(900),
            headers: RateLimitHeaders::default(),
        };
        assert_eq!(timeout.status(), 503);
        assert_eq!(timeout.retry_after(), Some(MAX_RETRY_AFTER));
        assert_eq!(
            clamp_retry_after(Duration::from_millis(3)),
            MIN_CAPACITY_RETRY_AFTER
        );
    }
}
