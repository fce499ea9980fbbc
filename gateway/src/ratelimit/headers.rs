//! OpenAI's rate-limit response headers:
//! `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, with resets written like OpenAI's
//! ("20ms", "1s", "6m0s", "8.64s"). Sent on every response, successful or not, so clients can
//! pace themselves before they hit a 429.

use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue};

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

/// The rate-limit headers of one response. A tenant without a limit gets no headers for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RateLimitHeaders {
    pub requests: Option<BucketStatus>,
    pub tokens: Option<BucketStatus>,
}

impl RateLimitHeaders {
    /// Writes the `x-ratelimit-*` headers (replacing any already there).
    pub fn apply(&self, headers: &mut HeaderMap) {
        for (status, suffix) in [(self.requests, "requests"), (self.tokens, "tokens")] {
            let Some(status) = status else { continue };
            let values = [
                ("limit", status.limit.to_string()),
                ("remaining", status.remaining.to_string()),
                ("reset", format_reset(status.reset)),
            ];
            for (what, value) in values {
                let name = format!("x-ratelimit-{what}-{suffix}");
                if let (Ok(name), Ok(value)) =
                    (HeaderName::try_from(name), HeaderValue::try_from(value))
                {
                    headers.insert(name, value);
                }
            }
        }
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
    fn apply_writes_all_six_headers_and_skips_unlimited_buckets() {
        let status = BucketStatus {
            limit: 60,
            remaining: 59,
            reset: Duration::from_secs(1),
        };
        let mut headers = HeaderMap::new();
        RateLimitHeaders {
            requests: Some(status),
            tokens: Some(status),
        }
        .apply(&mut headers);
        assert_eq!(headers.len(), 6);
        assert_eq!(headers["x-ratelimit-limit-requests"], "60");
        assert_eq!(headers["x-ratelimit-remaining-tokens"], "59");
        assert_eq!(headers["x-ratelimit-reset-requests"], "1s");

        let mut headers = HeaderMap::new();
        RateLimitHeaders {
            requests: None,
            tokens: Some(status),
        }
        .apply(&mut headers);
        assert_eq!(headers.len(), 3);
        assert!(headers.get("x-ratelimit-limit-requests").is_none());
    }
}
