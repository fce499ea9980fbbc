//! The single rescue: every failure the gateway can answer with becomes a [`GatewayError`], and
//! only this file decides its HTTP status, its OpenAI error body
//! `{"error":{"message","type","param","code"}}`, its retry headers, and its SSE form for
//! failures after a stream has started.
//!
//! Inner code never builds error responses itself (linkerd's rescue pattern): handlers, the
//! JSON extractor and the middleware return `GatewayError`, so a client mistake can never leak
//! out as a plain-text body or a 5xx.
//!
//! Server-side failures carry a *detail* (a panic message, an engine error, a transport error
//! naming an upstream's address) that is logged with the request's id and never sent: the
//! client's message says what failed, not how (see [`GatewayError::detail`]).

use std::time::Duration;

use axum::Json;
use axum::response::sse::Event;
use axum::response::{IntoResponse, Response};
use http::{HeaderMap, HeaderValue, StatusCode};

use crate::admission::Rejection;
use crate::auth::AuthError;
use crate::intake::IntakeFull;
use crate::openai::{ErrorBody, ErrorDetail};
use crate::validate::ValidationError;

/// Retry-After for transient server-side refusals (load shedding, draining, engine restart).
pub const TRANSIENT_RETRY_AFTER: Duration = Duration::from_secs(1);

/// Everything the gateway answers with an error.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error(transparent)]
    Invalid(#[from] ValidationError),
    #[error(transparent)]
    Auth(#[from] AuthError),
    #[error("{}", .0.message())]
    Rejected(Rejection),
    /// The body is not JSON, not UTF-8, or has a field of the wrong type.
    #[error("{message}")]
    BadBody {
        message: String,
        param: Option<String>,
    },
    /// The body is compressed or otherwise encoded (`Content-Encoding` other than `identity`):
    /// kvgate does not decode request bodies, so it refuses them before reading a byte.
    #[error(
        "Content-Encoding `{encoding}` is not supported: kvgate reads request bodies only \
         uncompressed (identity). Send the body without Content-Encoding."
    )]
    UnsupportedEncoding { encoding: String },
    #[error("The request body is larger than the {limit_bytes}-byte limit.")]
    PayloadTooLarge { limit_bytes: usize },
    /// The request's header fields (names, values and separators) are over the limit.
    #[error(
        "The request's header fields take {bytes} bytes, more than the {limit_bytes}-byte limit."
    )]
    HeadersTooLarge { bytes: usize, limit_bytes: usize },
    #[error("The request URI is {length} bytes long, more than the {limit_bytes}-byte limit.")]
    UriTooLong { length: usize, limit_bytes: usize },
    #[error("The client sent no request body data for {}s.", .idle.as_secs_f64())]
    BodyTimeout { idle: Duration },
    #[error("Invalid URL ({method} {path})")]
    NotFound { method: String, path: String },
    #[error("Method {method} is not allowed for {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("The request did not complete within {}s.", .after.as_secs_f64())]
    RequestTimeout { after: Duration },
    #[error("The server is at its limit of requests in flight. Please retry.")]
    Overloaded,
    /// The tenant already has its `max_validating` requests being read or validated.
    #[error(
        "Tenant {} already has {} requests being uploaded or validated, its limit (max_validating). Please retry.",
        .0.tenant,
        .0.limit
    )]
    IntakeFull(IntakeFull),
    #[error("The server is shutting down. Please retry.")]
    ShuttingDown,
    #[error("The server is not ready: {0}")]
    NotReady(String),
    /// The engine refused the sequence (stopped, restarting).
    #[error("The inference engine is unavailable: {0}")]
    EngineUnavailable(String),
    /// Generation failed after it was accepted; the engine's message is the logged detail.
    #[error("Generation failed on the server.")]
    Generation(String),
    /// An upstream engine could not be reached, or sent no response headers in time. `reason`
    /// is what the client is told ("no response within 2s", "it could not be reached");
    /// `detail` (the transport error, which names internal addresses) is logged only.
    #[error("The upstream serving `{upstream}` is unavailable: {reason}")]
    UpstreamUnavailable {
        upstream: String,
        reason: String,
        detail: String,
    },
    /// An upstream engine answered with a server error (5xx); its status is kept, its body
    /// (the upstream's internals) is logged, not sent (see `upstream::relay`).
    #[error("The upstream serving `{upstream}` failed (HTTP {}).", .status.as_u16())]
    UpstreamError {
        upstream: String,
        status: StatusCode,
    },
    /// A bug: a panic caught by the rescue layer, or an invariant that did not hold. The
    /// string is the logged detail.
    #[error("The server had an internal error.")]
    Internal(String),
}

impl From<Rejection> for GatewayError {
    fn from(rejection: Rejection) -> Self {
        GatewayError::Rejected(rejection)
    }
}

// === impl GatewayError ===

impl GatewayError {
    pub fn status(&self) -> StatusCode {
        use GatewayError::*;
        let code = match self {
            Invalid(ValidationError::ModelNotFound(_)) => 404,
            // The operator's template is at fault, not the request.
            Invalid(ValidationError::BrokenTemplate(_)) => 500,
            Invalid(_) | BadBody { .. } => 400,
            Auth(error) => error.status(),
            Rejected(rejection) => rejection.status(),
            PayloadTooLarge { .. } => 413,
            HeadersTooLarge { .. } => 431,
            UriTooLong { .. } => 414,
            UnsupportedEncoding { .. } => 415,
            BodyTimeout { .. } => 408,
            NotFound { .. } => 404,
            MethodNotAllowed { .. } => 405,
            IntakeFull(_) => 429,
            RequestTimeout { .. } => 504,
            UpstreamUnavailable { .. } => 502,
            UpstreamError { status, .. } if status.is_server_error() => status.as_u16(),
            UpstreamError { .. } => 502,
            Overloaded | ShuttingDown | NotReady(_) | EngineUnavailable(_) => 503,
            Generation(_) | Internal(_) => 500,
        };
        StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }

    /// OpenAI `error.type`: `invalid_request_error` for client mistakes, `server_error` for ours.
    pub fn error_type(&self) -> &'static str {
        use GatewayError::*;
        match self {
            Auth(error) => error.error_type(),
            Rejected(rejection) => rejection.error_type(),
            Invalid(ValidationError::BrokenTemplate(_)) => "server_error",
            Invalid(_)
            | BadBody { .. }
            | PayloadTooLarge { .. }
            | HeadersTooLarge { .. }
            | UriTooLong { .. }
            | BodyTimeout { .. }
            | UnsupportedEncoding { .. } => "invalid_request_error",
            NotFound { .. } | MethodNotAllowed { .. } => "invalid_request_error",
            IntakeFull(_) => "requests",
            RequestTimeout { .. } | Overloaded | ShuttingDown | NotReady(_) => "server_error",
            EngineUnavailable(_) | Generation(_) | Internal(_) => "server_error",
            UpstreamUnavailable { .. } | UpstreamError { .. } => "server_error",
        }
    }

    /// OpenAI `error.code`: a stable identifier clients can branch on.
    pub fn code(&self) -> Option<&'static str> {
        use GatewayError::*;
        Some(match self {
            Invalid(error) => error.code(),
            Auth(error) => error.code(),
            Rejected(rejection) => rejection.code(),
            BadBody { .. } => "invalid_json",
            PayloadTooLarge { .. } => "request_too_large",
            HeadersTooLarge { .. } => "request_header_fields_too_large",
            UriTooLong { .. } => "uri_too_long",
            UnsupportedEncoding { .. } => "unsupported_content_encoding",
            BodyTimeout { .. } => "request_timeout",
            NotFound { .. } => "unknown_url",
            MethodNotAllowed { .. } => "method_not_allowed",
            RequestTimeout { .. } => "timeout",
            Overloaded => "overloaded",
            IntakeFull(_) => "intake_full",
            ShuttingDown => "shutting_down",
            NotReady(_) => "not_ready",
            EngineUnavailable(_) => "engine_unavailable",
            Generation(_) => "generation_failed",
            UpstreamUnavailable { .. } => "upstream_unavailable",
            UpstreamError { .. } => "upstream_error",
            Internal(_) => "internal_error",
        })
    }

    /// OpenAI `error.param`: the request field at fault, when there is one.
    pub fn param(&self) -> Option<String> {
        match self {
            GatewayError::Invalid(error) => error.param(),
            GatewayError::BadBody { param, .. } => param.clone(),
            GatewayError::UnsupportedEncoding { .. } => Some("Content-Encoding".to_owned()),
            GatewayError::Rejected(rejection) => rejection.param().map(str::to_owned),
            _ => None,
        }
    }

    /// How long the client should wait before retrying, when retrying can help.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            GatewayError::Rejected(rejection) => rejection.retry_after(),
            GatewayError::Overloaded
            | GatewayError::IntakeFull(_)
            | GatewayError::ShuttingDown
            | GatewayError::EngineUnavailable(_)
            | GatewayError::UpstreamUnavailable { .. } => Some(TRANSIENT_RETRY_AFTER),
            _ => None,
        }
    }

    /// The OpenAI error body.
    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                // Messages that quote the client's values are kept short (see `concise`).
                message: match self {
                    GatewayError::Invalid(_) | GatewayError::UnsupportedEncoding { .. } => {
                        concise(self.to_string())
                    }
                    _ => self.to_string(),
                },
                error_type: self.error_type().to_owned(),
                param: self.param(),
                code: self.code().map(str::to_owned),
            },
        }
    }

    /// `retry-after` (whole seconds, rounded up), `retry-after-ms` and `x-should-retry`, plus the
    /// rate-limit headers a rejection carries.
    pub fn apply_headers(&self, headers: &mut HeaderMap) {
        if let GatewayError::Rejected(rejection) = self {
            // Admission owns the exact header set for its rejections.
            rejection.apply_headers(headers);
            return;
        }
        if let Some(after) = self.retry_after() {
            apply_retry_after(headers, after);
        }
        // Tell openai-python not to retry client mistakes it would otherwise retry (408).
        // A broken chat template fails every request the same way until the operator fixes it.
        let broken_template = matches!(
            self,
            GatewayError::Invalid(ValidationError::BrokenTemplate(_))
        );
        let retry =
            self.retry_after().is_some() || (self.status().is_server_error() && !broken_template);
        let value = if retry { "true" } else { "false" };
        headers.insert("x-should-retry", HeaderValue::from_static(value));
    }

    /// The same error as an SSE event, for failures after the stream's headers were sent:
    /// `data: {"error":{...}}`, as OpenAI streams it.
    pub fn sse_event(&self) -> Event {
        Event::default().data(self.sse_data())
    }

    /// The JSON carried by [`GatewayError::sse_event`].
    pub fn sse_data(&self) -> String {
        serde_json::to_string(&self.body()).unwrap_or_else(|_| {
            r#"{"error":{"message":"error","type":"server_error","param":null,"code":null}}"#
                .to_owned()
        })
    }

    /// What the log gets beyond the client's message: the text of an internal, engine or
    /// upstream failure. Logged, never sent (it can name files, addresses or internals).
    pub fn detail(&self) -> Option<&str> {
        match self {
            GatewayError::Internal(detail)
            | GatewayError::Generation(detail)
            | GatewayError::UpstreamUnavailable { detail, .. } => Some(detail),
            _ => None,
        }
    }

    /// How loudly [`Self::log`] reports this error, answered with `status`. Only a real
    /// server fault (500: a bug, a failed generation) is an ERROR. The answers the gateway
    /// gives on purpose when it or an engine is at its limit (load shedding, queue timeouts,
    /// draining, an unavailable or failing upstream: 502/503/504) are a WARN, and the 429s of
    /// an overloaded queue or intake an INFO; client mistakes and readiness probes are DEBUG.
    pub fn log_level(&self, status: StatusCode) -> tracing::Level {
        use tracing::Level;
        match self {
            // A failing readiness probe is the answer asked for (every probe period while the
            // server drains), not a failure to report.
            GatewayError::NotReady(_) => Level::DEBUG,
            GatewayError::Internal(_) | GatewayError::Generation(_) => Level::ERROR,
            _ if status == StatusCode::INTERNAL_SERVER_ERROR => Level::ERROR,
            _ if status.is_server_error() => Level::WARN,
            GatewayError::IntakeFull(_) => Level::INFO,
            GatewayError::Rejected(Rejection::QueueFull { .. } | Rejection::KvSaturated { .. }) => {
                Level::INFO
            }
            _ => Level::DEBUG,
        }
    }

    /// Logs the error with its detail (in the request's span, which names its id), once: the
    /// stack does not log failed responses again (`stack.rs`).
    pub fn log(&self, status: StatusCode) {
        use tracing::Level;
        let detail = self.detail().unwrap_or("");
        let code = status.as_u16();
        crate::request_log::in_request_span(|| match self.log_level(status) {
            Level::ERROR => tracing::error!(status = code, error = %self, detail, "request failed"),
            Level::WARN => tracing::warn!(status = code, error = %self, detail, "request shed"),
            Level::INFO => tracing::info!(status = code, error = %self, detail, "request shed"),
            _ if matches!(self, GatewayError::NotReady(_)) => {
                tracing::debug!(status = code, error = %self, "not ready")
            }
            _ => tracing::debug!(status = code, error = %self, detail, "request refused"),
        });
    }
}

/// Writes `retry-after` in whole seconds (rounded up, at least 1) and `retry-after-ms`.
pub fn apply_retry_after(headers: &mut HeaderMap, after: Duration) {
    let millis = u64::try_from(after.as_millis()).unwrap_or(u64::MAX).max(1);
    headers.insert("retry-after", HeaderValue::from(millis.div_ceil(1000)));
    headers.insert("retry-after-ms", HeaderValue::from(millis));
}

impl IntoResponse for GatewayError {
    fn into_response(self) -> Response {
        let status = self.status();
        self.log(status);
        let mut response = (status, Json(self.body())).into_response();
        self.apply_headers(response.headers_mut());
        response
    }
}

/// Longest error message kvgate builds from client input, in characters.
const MAX_MESSAGE_CHARS: usize = 500;
/// Longest run of digits echoed as written; longer numbers are printed as `1e308`.
const MAX_NUMBER_CHARS: usize = 20;

/// Keeps an error message built from client input short: numbers longer than
/// [`MAX_NUMBER_CHARS`] (serde prints `1e308` with all 309 digits) in scientific notation, and
/// the whole message cut at [`MAX_MESSAGE_CHARS`] (a rejected string is echoed in full).
pub(crate) fn concise(message: String) -> String {
    let mut out = String::with_capacity(message.len().min(MAX_MESSAGE_CHARS + 4));
    let mut rest = message.as_str();
    while let Some(start) = rest.find(|c: char| c.is_ascii_digit()) {
        out.push_str(&rest[..start]);
        let run = &rest[start..];
        let len = run
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(run.len());
        let number = &run[..len];
        match number.parse::<f64>() {
            Ok(value) if number.len() > MAX_NUMBER_CHARS => out.push_str(&format!("{value:e}")),
            _ => out.push_str(number),
        }
        rest = &run[len..];
    }
    out.push_str(rest);
    match out.char_indices().nth(MAX_MESSAGE_CHARS) {
        Some((cut, _)) => {
            out.truncate(cut);
            out.push('…');
            out
        }
        None => out,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn body_json(response: Response) -> serde_json::Value {
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test]
    async fn every_error_is_openai_json_with_all_four_fields() {
        let errors = [
            GatewayError::BadBody {
                message: "bad".into(),
                param: Some("messages".into()),
            },
            GatewayError::PayloadTooLarge { limit_bytes: 10 },
            GatewayError::NotFound {
                method: "GET".into(),
                path: "/x".into(),
            },
            GatewayError::Internal("boom".into()),
            GatewayError::Auth(AuthError::MissingKey),
        ];
        for error in errors {
            let response = error.into_response();
            let json = body_json(response).await;
            let detail = json["error"].as_object().unwrap();
            for field in ["message", "type", "param", "code"] {
                assert!(detail.contains_key(field), "{field} missing in {json}");
            }
        }
    }

    #[test]
    fn a_broken_chat_template_is_a_logged_server_error_not_worth_retrying() {
        let error = GatewayError::Invalid(ValidationError::BrokenTemplate(
            "chat template ran past its budget".into(),
        ));
        let status = error.status();
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(error.error_type(), "server_error");
        assert_eq!(error.code(), Some("chat_template_error"));
        assert_eq!(error.param(), None);
        assert_eq!(error.log_level(status), tracing::Level::ERROR);
        let mut headers = HeaderMap::new();
        error.apply_headers(&mut headers);
        assert_eq!(headers["x-should-retry"], "false");
    }

    #[test]
    fn concise_shortens_long_numbers_and_long_messages() {
        let digits = format!("got {}.0 here", "1".to_owned() + &"0".repeat(308));
        assert_eq!(concise(digits), "got 1e308 here");
        assert_eq!(
            concise("between 0 and 2 (got 3.5)".into()),
            "between 0 and 2 (got 3.5)"
        );
        let long = concise("x".repeat(10_000));
        assert_eq!(long.chars().count(), MAX_MESSAGE_CHARS + 1);
        assert!(long.ends_with('…'));
    }

    #[test]
    fn only_real_server_faults_are_errors_and_load_shedding_is_a_warning() {
        use crate::ratelimit::RateLimitHeaders;
        use tracing::Level;
        let second = Duration::from_secs(1);
        let cases = [
            (GatewayError::Internal("bug".into()), Level::ERROR),
            (GatewayError::Generation("engine".into()), Level::ERROR),
            (GatewayError::Overloaded, Level::WARN),
            (GatewayError::ShuttingDown, Level::WARN),
            (
                GatewayError::EngineUnavailable("queue full".into()),
                Level::WARN,
            ),
            (GatewayError::RequestTimeout { after: second }, Level::WARN),
            (
                GatewayError::Rejected(Rejection::QueueTimeout {
                    tenant: "a".into(),
                    waited: second,
                    retry_after: second,
                    headers: RateLimitHeaders::default(),
                }),
                Level::WARN,
            ),
            (
                GatewayError::Rejected(Rejection::StoreUnavailable { tenant: "a".into() }),
                Level::WARN,
            ),
            (GatewayError::Rejected(Rejection::Unavailable), Level::WARN),
            (
                GatewayError::UpstreamUnavailable {
                    upstream: "remote".into(),
                    reason: "down".into(),
                    detail: "refused".into(),
                },
                Level::WARN,
            ),
            (
                GatewayError::UpstreamError {
                    upstream: "remote".into(),
                    status: StatusCode::SERVICE_UNAVAILABLE,
                },
                Level::WARN,
            ),
            (
                GatewayError::Rejected(Rejection::KvSaturated {
                    tenant: "a".into(),
                    needed_blocks: 1,
                    estimated_wait: second,
                    retry_after: second,
                    headers: RateLimitHeaders::default(),
                }),
                Level::INFO,
            ),
            (
                GatewayError::IntakeFull(IntakeFull {
                    tenant: "a".into(),
                    limit: 4,
                }),
                Level::INFO,
            ),
            (GatewayError::NotReady("draining".into()), Level::DEBUG),
            (
                GatewayError::Invalid(ValidationError::EmptyMessages),
                Level::DEBUG,
            ),
            (GatewayError::Auth(AuthError::InvalidKey), Level::DEBUG),
        ];
        for (error, level) in cases {
            assert_eq!(error.log_level(error.status()), level, "{error:?}");
        }
    }

    #[tokio::test]
    async fn statuses_follow_the_conventions() {
        let cases = [
            (
                GatewayError::Invalid(ValidationError::ModelNotFound("x".into())),
                404,
            ),
            (GatewayError::Invalid(ValidationError::EmptyMessages), 400),
            (GatewayError::Auth(AuthError::InvalidKey), 401),
            (GatewayError::PayloadTooLarge { limit_bytes: 1 }, 413),
            (
                GatewayError::BodyTimeout {
                    idle: Duration::from_secs(1),
                },
                408,
            ),
            (
                GatewayError::MethodNotAllowed {
                    method: "GET".into(),
                    path: "/".into(),
                },
                405,
            ),
            (GatewayError::Overloaded, 503),
            (GatewayError::Generation("x".into()), 500),
            (
                GatewayError::UpstreamUnavailable {
                    upstream: "remote".into(),
                    reason: "it could not be reached".into(),
                    detail: "connection refused".into(),
                },
                502,
            ),
            (
                GatewayError::IntakeFull(IntakeFull {
                    tenant: "a".into(),
                    limit: 4,
                }),
                429,
            ),
        ];
        for (error, status) in cases {
            assert_eq!(error.status().as_u16(), status, "{error:?}");
        }
    }

    #[tokio::test]
    async fn context_length_errors_carry_code_and_param() {
        let error = GatewayError::from(ValidationError::ContextLengthExceeded {
            prompt_tokens: 10,
            max_tokens: 5,
            limit: 12,
            limit_name: "model's maximum context length",
            what: "messages",
        });
        let json = body_json(error.into_response()).await;
        assert_eq!(json["error"]["code"], "context_length_exceeded");
        assert_eq!(json["error"]["param"], "messages");
        assert_eq!(json["error"]["type"], "invalid_request_error");
    }

    #[test]
    fn transient_503s_carry_retry_after_in_both_units() {
        let response = GatewayError::Overloaded.into_response();
        assert_eq!(response.headers()["retry-after"], "1");
        assert_eq!(response.headers()["retry-after-ms"], "1000");
        assert_eq!(response.headers()["x-should-retry"], "true");
        let response = GatewayError::Invalid(ValidationError::EmptyMessages).into_response();
        assert!(response.headers().get("retry-after").is_none());
        assert_eq!(response.headers()["x-should-retry"], "false");
    }

    #[tokio::test]
    async fn internal_engine_and_transport_details_are_logged_not_sent() {
        let secret = "/srv/models/secret.gguf: 10.0.0.5:8000 connection refused";
        let errors = [
            GatewayError::Internal(format!("validation task failed: {secret}")),
            GatewayError::Generation(format!("backend error: {secret}")),
            GatewayError::UpstreamUnavailable {
                upstream: "remote".into(),
                reason: "it could not be reached".into(),
                detail: secret.into(),
            },
        ];
        for error in errors {
            assert_eq!(error.detail().map(|d| d.contains(secret)), Some(true));
            let sse = error.sse_data();
            let json = body_json(error.into_response()).await;
            let text = json.to_string();
            assert!(
                !text.contains("10.0.0.5") && !text.contains("/srv"),
                "{text}"
            );
            assert!(!sse.contains("10.0.0.5") && !sse.contains("/srv"), "{sse}");
            assert!(!json["error"]["message"].as_str().unwrap().is_empty());
        }
    }

    #[test]
    fn sse_error_event_is_the_same_body() {
        let error = GatewayError::Generation("engine stopped".into());
        let sent: ErrorBody = serde_json::from_str(&error.sse_data()).unwrap();
        assert_eq!(sent, error.body());
        assert_eq!(sent.error.code.as_deref(), Some("generation_failed"));
    }

    #[test]
    fn rejected_values_are_quoted_briefly() {
        let body = GatewayError::Invalid(ValidationError::Temperature(1e308)).body();
        assert_eq!(
            body.error.message,
            "`temperature` must be between 0 and 2 (got 1e308)"
        );
        let body = GatewayError::UnsupportedEncoding {
            encoding: "gzip".into(),
        }
        .body();
        assert_eq!(
            body.error.code.as_deref(),
            Some("unsupported_content_encoding")
        );
        assert!(
            body.error
                .message
                .starts_with("Content-Encoding `gzip` is not supported")
        );
    }
}
