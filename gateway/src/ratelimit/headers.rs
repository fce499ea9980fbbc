//! OpenAI's rate-limit response headers:
//! `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, with resets written like OpenAI's
//! ("20ms", "1s", "6m0s", "8.64s"). Sent on every response, successful or not, so clients can
//! pace themselves before they hit a 429: the stack's outermost layers
//! (`stack::rate_limit_headers`) add them to any response that does not carry them yet.
//!
//! All six are always written, so a client or proxy that parses them never finds one missing.
//! A bucket the tenant does not have (no `requests_per_minute` or `tokens_per_minute`) is
//! reported as [`UNLIMITED`] with nothing spent and a reset of "0ms": the truthful answer for a
//! bucket that can never run dry, in a form every client's integer parser accepts.

use std::num::NonZeroU32;
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};

/// Limit and remaining of a bucket without a limit: the largest value a bucket can report.
pub const UNLIMITED: u32 = u32::MAX;

/// The six header names, in the order [`RateLimitHeaders::apply`] writes them.
/// Names made from static text once, not parsed again per response (these run on every answer).
pub const HEADER_NAMES: [HeaderName; 6] = [
    HeaderName::from_static("x-ratelimit-limit-requests"),
    HeaderName::from_static("x-ratelimit-remaining-requests"),
    HeaderName::from_static("x-ratelimit-reset-requests"),
    HeaderName::from_static("x-ratelimit-limit-tokens"),
    HeaderName::from_static("x-ratelimit-remaining-tokens"),
    HeaderName::from_static("x-ratelimit-reset-tokens"),
];

/// One bucket's state as reported to the client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketStatus {
    /// Requests or tokens per minute.
    pub limit: u32,
    /// What could be spent right now.
    pub remaining: u32,
    /// Time until the bucket is full again.
    pub reset: Duration,
}

impl BucketStatus {
    /// A bucket of `limit` per minute with nothing spent.
    pub fn full(limit: NonZeroU32) -> BucketStatus {
        BucketStatus {
            limit: limit.get(),
            remaining: limit.get(),
            reset: Duration::ZERO,
        }
    }

    /// How a missing limit is reported.
    pub const UNLIMITED: BucketStatus = BucketStatus {
        limit: UNLIMITED,
        remaining: UNLIMITED,
        reset: Duration::ZERO,
    };
}

/// The rate-limit headers of one response; `None` is a bucket the tenant does not have.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RateLimitHeaders {
    pub requests: Option<BucketStatus>,
    pub tokens: Option<BucketStatus>,
}

impl RateLimitHeaders {
    /// Buckets of these per-minute limits with nothing spent.
    pub fn full(
        requests_per_minute: Option<NonZeroU32>,
        tokens_per_minute: Option<NonZeroU32>,
    ) -> RateLimitHeaders {
        RateLimitHeaders {
            requests: requests_per_minute.map(BucketStatus::full),
            tokens: tokens_per_minute.map(BucketStatus::full),
        }
    }

    /// Writes all six `x-ratelimit-*` headers (replacing any already there); a missing bucket
    /// as [`BucketStatus::UNLIMITED`].
    pub fn apply(&self, headers: &mut HeaderMap) {
        // HEADER_NAMES in order: limit, remaining, reset of requests, then of tokens.
        let mut names = HEADER_NAMES.into_iter();
        for status in [self.requests, self.tokens] {
            let status = status.unwrap_or(BucketStatus::UNLIMITED);
            let values = [
                Ok(HeaderValue::from(status.limit)),
                Ok(HeaderValue::from(status.remaining)),
                HeaderValue::try_from(format_reset(status.reset)),
            ];
            for value in values {
                if let (Some(name), Ok(value)) = (names.next(), value) {
                    headers.insert(name, value);
                }
            }
        }
    }

    /// Whether `headers` already carry all six.
    pub fn present_in(headers: &HeaderMap) -> bool {
        HEADER_NAMES.iter().all(|name| headers.contains_key(name))
    }
}

/// Formats a duration the way OpenAI's reset headers do (Go's `Duration.String`, to the
/// millisecond, rounded up so a client never retries early): "20ms", "1s", "8.64s", "6m0s".
pub fn format_reset(duration: Duration) -> String {
    let total_ms = duration.as_nanos().div_ceil(1_000_000);
    if total_ms < 1000 {
        return format!("{total_ms}ms");
    }
    let hours = total_ms / 3_600_000;
    let minutes = total_ms / 60_000 % 60;
    let seconds_ms = total_ms % 60_000;
    let mut seconds = (seconds_ms / 1000).to_string();
    if !seconds_ms.is_multiple_of(1000) {
        let fraction = format!("{:03}", seconds_ms % 1000);
        seconds = format!("{seconds}.{}", fraction.trim_end_matches('0'));
    }
    match (hours, minutes) {
        (0, 0) => format!("{seconds}s"),
        (0, _) => format!("{minutes}m{seconds}s"),
        _ => format!("{hours}h{minutes}m{seconds}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resets_are_formatted_like_openai() {
        assert_eq!(format_reset(Duration::from_millis(20)), "20ms");
        assert_eq!(format_reset(Duration::from_micros(1)), "1ms");
        assert_eq!(format_reset(Duration::ZERO), "0ms");
        assert_eq!(format_reset(Duration::from_secs(1)), "1s");
        assert_eq!(format_reset(Duration::from_millis(8640)), "8.64s");
        assert_eq!(format_reset(Duration::from_secs(360)), "6m0s");
        assert_eq!(format_reset(Duration::from_millis(90_500)), "1m30.5s");
        assert_eq!(format_reset(Duration::from_secs(3661)), "1h1m1s");
    }

    #[test]
    fn apply_writes_all_six_headers_and_reports_missing_buckets_as_unlimited() {
        let status = BucketStatus {
            limit: 60,
            remaining: 59,
            reset: Duration::from_secs(1),
        };
        let mut headers = HeaderMap::new();
        assert!(!RateLimitHeaders::present_in(&headers));
        RateLimitHeaders {
            requests: Some(status),
            tokens: Some(status),
        }
        .apply(&mut headers);
        assert_eq!(headers.len(), 6);
        assert!(RateLimitHeaders::present_in(&headers));
        assert_eq!(headers["x-ratelimit-limit-requests"], "60");
        assert_eq!(headers["x-ratelimit-remaining-tokens"], "59");
        assert_eq!(headers["x-ratelimit-reset-requests"], "1s");

        let mut headers = HeaderMap::new();
        RateLimitHeaders {
            requests: None,
            tokens: Some(status),
        }
        .apply(&mut headers);
        assert_eq!(headers.len(), 6);
        assert_eq!(headers["x-ratelimit-limit-requests"], "4294967295");
        assert_eq!(headers["x-ratelimit-remaining-requests"], "4294967295");
        assert_eq!(headers["x-ratelimit-reset-requests"], "0ms");
        assert_eq!(headers["x-ratelimit-limit-tokens"], "60");
    }

    #[test]
    fn full_buckets_have_nothing_spent() {
        let mut headers = HeaderMap::new();
        RateLimitHeaders::full(NonZeroU32::new(600), None).apply(&mut headers);
        assert_eq!(headers["x-ratelimit-limit-requests"], "600");
        assert_eq!(headers["x-ratelimit-remaining-requests"], "600");
        assert_eq!(headers["x-ratelimit-reset-requests"], "0ms");
        assert_eq!(headers["x-ratelimit-remaining-tokens"], "4294967295");
    }
}
