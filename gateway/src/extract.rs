//! Request extractors whose every failure is a [`GatewayError`]: [`OpenAiJson`] (the body),
//! [`OpenAiBody`] (the body, keeping its bytes for the upstream proxy), [`Tenant`] (the API
//! key) and [`TenantIntake`] (the key, plus the tenant's limits that apply before the body).
//!
//! axum's own `Json` answers malformed input with plain-text bodies and 415/422 statuses; these
//! answer with OpenAI's JSON error and 400, naming the offending field (`messages[0].role`)
//! through `serde_path_to_error`. The body is read frame by frame under the body size cap and an
//! idle timeout, so a client that stops sending mid-body gets 408 instead of holding a task.

use std::error::Error as StdError;
use std::sync::Arc;

use axum::extract::{FromRequest, FromRequestParts, Request};
use bytes::{Bytes, BytesMut};
use http::request::Parts;
use http_body_util::{BodyExt, LengthLimitError};
use serde::de::DeserializeOwned;

use crate::auth::authenticate;
use crate::error::GatewayError;
use crate::intake::IntakePermit;
use crate::metrics::{RejectReason, record_rejection, record_request};
use crate::policy::TenantPolicy;
use crate::ratelimit::RequestCell;
use crate::state::AppState;

/// A JSON body parsed into `T`, or a 400/408/413 OpenAI error.
#[derive(Debug)]
pub struct OpenAiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for OpenAiJson<T> {
    type Rejection = GatewayError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let limits = state.body_limits();
        let bytes = read_body(req, limits.max_bytes, limits.idle_timeout).await?;
        parse_json(&bytes).map(OpenAiJson)
    }
}

/// Like [`OpenAiJson`], also keeping the body's bytes (no copy): a request for an upstream model
/// is forwarded as the client wrote it, not re-serialized from `T`, which drops the fields
/// kvgate does not model.
#[derive(Debug)]
pub struct OpenAiBody<T> {
    pub request: T,
    pub raw: Bytes,
}

impl<T: DeserializeOwned> FromRequest<AppState> for OpenAiBody<T> {
    type Rejection = GatewayError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let limits = state.body_limits();
        let raw = read_body(req, limits.max_bytes, limits.idle_timeout)
            .await?
            .freeze();
        let request = parse_json(&raw)?;
        Ok(OpenAiBody { request, raw })
    }
}

/// Reads the whole body, at most `max_bytes`, failing if no frame arrives within `idle`.
async fn read_body(
    req: Request,
    max_bytes: usize,
    idle: std::time::Duration,
) -> Result<BytesMut, GatewayError> {
    let too_large = GatewayError::PayloadTooLarge {
        limit_bytes: max_bytes,
    };
    // Refuse an announced oversize body before reading a byte of it.
    let announced = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > max_bytes as u64) {
        return Err(too_large);
    }
    let mut body = req.into_body();
    let mut buffer = BytesMut::new();
    loop {
        let frame = match tokio::time::timeout(idle, body.frame()).await {
            Err(_) => return Err(GatewayError::BodyTimeout { idle }),
            Ok(None) => return Ok(buffer),
            Ok(Some(Err(error))) if is_length_limit(&error) => return Err(too_large),
            Ok(Some(Err(error))) => {
                return Err(GatewayError::BadBody {
                    message: format!("The request body could not be read: {error}"),
                    param: None,
                });
            }
            Ok(Some(Ok(frame))) => frame,
        };
        if let Ok(data) = frame.into_data() {
            if buffer.len() + data.len() > max_bytes {
                return Err(too_large);
            }
            buffer.extend_from_slice(&data);
        }
    }
}

/// True if a body error was caused by a body-limit layer's cap.
fn is_length_limit(error: &axum::Error) -> bool {
    let mut source: Option<&(dyn StdError + 'static)> = Some(error);
    while let Some(current) = source {
        if current.is::<LengthLimitError>() {
            return true;
        }
        source = current.source();
    }
    false
}

/// Parses JSON, naming the field at fault in `param` when the shape (not the syntax) is wrong.
/// A body that parses takes plain serde_json, once; only a failing one is parsed again with the
/// path tracking that names the field (it costs a few microseconds on every request).
pub fn parse_json<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, GatewayError> {
    match serde_json::from_slice(bytes) {
        Ok(value) => Ok(value),
        Err(_) => parse_json_tracked(bytes),
    }
}

/// [`parse_json`]'s error path: the same parse, tracking where it failed.
fn parse_json_tracked<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, GatewayError> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
        let path = error.path().to_string();
        let inner = error.into_inner();
        if inner.is_data() && path != "." {
            GatewayError::BadBody {
                message: format!("Invalid value for `{path}`: {inner}"),
                param: Some(path),
            }
        } else {
            GatewayError::BadBody {
                message: format!("We could not parse the JSON body of your request: {inner}"),
                param: None,
            }
        }
    })?;
    // Trailing bytes after the JSON value are a malformed body too.
    deserializer.end().map_err(|inner| GatewayError::BadBody {
        message: format!("We could not parse the JSON body of your request: {inner}"),
        param: None,
    })?;
    Ok(value)
}

/// The tenant the request's API key belongs to (401 otherwise). Runs before the body is read,
/// so unauthenticated callers cost no parsing or tokenization.
#[derive(Debug, Clone)]
pub struct Tenant(pub Arc<TenantPolicy>);

impl FromRequestParts<AppState> for Tenant {
    type Rejection = GatewayError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let policy = state.policy_store().current();
        authenticate(&policy, &parts.headers)
            .map(Tenant)
            .map_err(|error| {
                // No tenant is known for a refused key; the label says so.
                record_rejection("unauthenticated", RejectReason::Auth);
                GatewayError::from(error)
            })
    }
}

/// The tenant of a generation request, let into intake: its key is valid, one request of its
/// request rate is taken, and it has fewer than `max_validating` requests being read or
/// validated. All three are decided from the headers, before the body is read, so a tenant over
/// its limits costs no upload, parsing or tokenization (and cannot hold those resources from
/// other tenants); taking the request (not only checking the bucket) means a concurrent burst
/// cannot all pass. The permit must be kept until validation ends (`Intake::validate` takes
/// it); the request cell goes to admission with the request (or returns to the bucket when it
/// drops: a request refused before it ran costs nothing).
#[derive(Debug)]
pub struct TenantIntake {
    pub tenant: Arc<TenantPolicy>,
    pub permit: IntakePermit,
    pub request: RequestCell,
}

impl FromRequestParts<AppState> for TenantIntake {
    type Rejection = GatewayError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let Tenant(tenant) = Tenant::from_request_parts(parts, state).await?;
        // A refusal here is the request's outcome: counted as the handler counts its own.
        let refused = |reason: Option<RejectReason>| {
            record_request(&tenant.name, route_name(parts.uri.path()), false);
            if let Some(reason) = reason {
                record_rejection(&tenant.name, reason);
            }
        };
        // Admission counts its rate refusals under their reason itself.
        let request = match state.admission().reserve_request(&tenant) {
            Ok(request) => request,
            Err(rejection) => {
                refused(None);
                return Err(rejection.into());
            }
        };
        // Refused here, the request cell drops and returns to the bucket.
        let permit = state.intake().enter(&tenant).map_err(|full| {
            // The tenant's own bound on requests waiting for service, as its queue's is.
            refused(Some(RejectReason::QueueFull));
            GatewayError::IntakeFull(full)
        })?;
        Ok(TenantIntake {
            tenant,
            permit,
            request,
        })
    }
}

/// The `route` label of `kvgate_requests_total` for a generation path (as `generate.rs` names
/// its endpoints).
fn route_name(path: &str) -> &'static str {
    match path {
        "/v1/completions" => "completions",
        _ => "chat",
    }
}

/// The request's `x-request-id` (set by the stack's first layer; empty if somehow absent).
#[derive(Debug, Clone)]
pub struct RequestId(pub String);

impl<S: Send + Sync> FromRequestParts<S> for RequestId {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let id = parts
            .headers
            .get(crate::stack::REQUEST_ID_HEADER)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        Ok(RequestId(id.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::ChatCompletionRequest;

    fn bad_body(bytes: &[u8]) -> (String, Option<String>) {
        match parse_json::<ChatCompletionRequest>(bytes) {
            Err(GatewayError::BadBody { message, param }) => (message, param),
            other => panic!("expected BadBody, got {other:?}"),
        }
    }

    #[test]
    fn wrong_types_name_the_field() {
        let body =
            br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"temperature":"hot"}"#;
        let (_, param) = bad_body(body);
        assert_eq!(param.as_deref(), Some("temperature"));
        let body = br#"{"model":"m","messages":[{"role":"robot","content":"hi"}]}"#;
        let (message, param) = bad_body(body);
        assert_eq!(param.as_deref(), Some("messages[0].role"));
        assert!(message.contains("robot"), "{message}");
    }

    #[test]
    fn syntax_errors_trailing_garbage_and_bad_utf8_are_plain_400s() {
        for body in [
            &b"{"[..],
            b"",
            b"{\"model\":\"m\",\"messages\":[]} x",
            b"{\"model\":\"\xff\"}",
        ] {
            let (message, _) = bad_body(body);
            assert!(
                message.starts_with("We could not parse") || message.starts_with("Invalid"),
                "{message}"
            );
        }
    }

    #[test]
    fn a_missing_required_field_is_reported() {
        let (message, _) = bad_body(br#"{"messages":[]}"#);
        assert!(message.contains("model"), "{message}");
    }
}
