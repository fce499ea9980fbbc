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

use crate::auth::{Credential, credential, tenant_for};
use crate::error::GatewayError;
use crate::error::concise;
use crate::intake::IntakePermit;
use crate::metrics::{RejectReason, RequestOutcome, record_rejection, record_request};
use crate::policy::TenantPolicy;
use crate::ratelimit::RequestCell;
use crate::shutdown::GraceOver;
use crate::state::{AppState, BodyLimits};

/// A JSON body parsed into `T`, or a 400/408/413 OpenAI error.
#[derive(Debug)]
pub struct OpenAiJson<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for OpenAiJson<T> {
    type Rejection = GatewayError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, Self::Rejection> {
        let limits = state.body_limits();
        let bytes = read_body(req, limits, state.grace_over()).await?;
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
        let raw = read_body(req, limits, state.grace_over()).await?.freeze();
        let request = parse_json(&raw)?;
        Ok(OpenAiBody { request, raw })
    }
}

/// Reads the whole body, at most `limits.max_bytes`, failing if no frame arrives within
/// `limits.idle_timeout`, or with 503 `shutting_down` if shutdown's grace period ends first (a
/// client still uploading then gets an answer in the flush window, not a cut connection).
async fn read_body(
    req: Request,
    limits: BodyLimits,
    mut grace: GraceOver,
) -> Result<BytesMut, GatewayError> {
    let (max_bytes, idle) = (limits.max_bytes, limits.idle_timeout);
    let too_large = GatewayError::PayloadTooLarge {
        limit_bytes: max_bytes,
    };
    // Refuse an announced oversize body before reading a byte of it.
    if crate::stack::announced_body_bytes(req.headers()).is_some_and(|n| n > max_bytes as u64) {
        return Err(too_large);
    }
    // A compressed body would fail as "not JSON" after being read; refuse it up front instead.
    if let Some(encoding) = unsupported_encoding(req.headers()) {
        return Err(GatewayError::UnsupportedEncoding { encoding });
    }
    let mut body = req.into_body();
    let mut buffer = BytesMut::new();
    loop {
        let next = tokio::select! {
            next = tokio::time::timeout(idle, body.frame()) => next,
            () = grace.wait() => return Err(GatewayError::ShuttingDown),
        };
        let frame = match next {
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

/// The request's `Content-Encoding`, unless it is absent or only `identity` (all the codings
/// listed, comma-separated, over every such header; case-insensitive).
fn unsupported_encoding(headers: &http::HeaderMap) -> Option<String> {
    let mut values = headers.get_all(http::header::CONTENT_ENCODING).iter();
    let is_identity = |value: &http::HeaderValue| {
        value.to_str().is_ok_and(|v| {
            v.split(',')
                .map(str::trim)
                .all(|coding| coding.is_empty() || coding.eq_ignore_ascii_case("identity"))
        })
    };
    if values.all(is_identity) {
        return None;
    }
    let named: Vec<String> = headers
        .get_all(http::header::CONTENT_ENCODING)
        .iter()
        .map(|value| String::from_utf8_lossy(value.as_bytes()).trim().to_owned())
        .collect();
    Some(named.join(", "))
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
    let value = serde_path_to_error::deserialize(&mut deserializer)
        .map_err(|error| shape_error(bytes, error))?;
    // Trailing bytes after the JSON value are a malformed body too.
    deserializer.end().map_err(|inner| syntax_error(&inner))?;
    Ok(value)
}

/// A body that is not JSON at all: no field to name.
fn syntax_error(inner: &serde_json::Error) -> GatewayError {
    GatewayError::BadBody {
        message: concise(format!(
            "We could not parse the JSON body of your request: {inner}"
        )),
        param: None,
    }
}

/// Turns a failed tracked parse into a 400 naming the field at fault (`param`) whenever the
/// body is valid JSON of the wrong shape; only a body that is not JSON gets the generic
/// "could not parse" message.
fn shape_error(bytes: &[u8], error: serde_path_to_error::Error<serde_json::Error>) -> GatewayError {
    let path = error.path().clone();
    let inner = error.into_inner();
    let at = |field: Option<&str>| -> Option<String> {
        let mut param = if path.iter().next().is_none() {
            String::new()
        } else {
            path.to_string()
        };
        if let Some(field) = field {
            if !param.is_empty() {
                param.push('.');
            }
            param.push_str(field);
        }
        (!param.is_empty()).then_some(param)
    };
    if inner.is_data() {
        // serde's wording for an absent field; the field belongs to the path's object.
        let message = inner.to_string();
        let missing = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split_once('`'))
            .map(|(field, _)| field);
        if let Some(param) = missing.and_then(|field| at(Some(field))) {
            return GatewayError::BadBody {
                message: concise(format!("Missing required parameter: `{param}`.")),
                param: Some(param),
            };
        }
        return match at(None) {
            Some(param) => GatewayError::BadBody {
                message: concise(format!("Invalid value for `{param}`: {inner}")),
                param: Some(param),
            },
            None => syntax_error(&inner),
        };
    }
    // serde_json reports some type mismatches (a `null` or a number where an enum's string
    // belongs) as syntax errors. If the body is valid JSON, the fault is the value at the path.
    let document: serde_json::Value = match serde_json::from_slice(bytes) {
        Ok(document) => document,
        Err(_) => return syntax_error(&inner),
    };
    let Some(param) = at(None) else {
        return syntax_error(&inner);
    };
    let found = value_at(&document, &path).map(describe);
    let message = match found {
        Some("null") => format!("Missing or null value for `{param}`: a value is required."),
        Some(kind) => format!("Invalid value for `{param}`: {kind} is not accepted here."),
        None => format!("Invalid value for `{param}`."),
    };
    GatewayError::BadBody {
        message: concise(message),
        param: Some(param),
    }
}

/// The value `path` leads to in `document`, if it is there.
fn value_at<'a>(
    document: &'a serde_json::Value,
    path: &serde_path_to_error::Path,
) -> Option<&'a serde_json::Value> {
    use serde_path_to_error::Segment;
    path.iter()
        .try_fold(document, |value, segment| match segment {
            Segment::Seq { index } => value.get(*index),
            Segment::Map { key } => value.get(key.as_str()),
            Segment::Enum { .. } | Segment::Unknown => Some(value),
        })
}

/// What kind of JSON value `value` is, for an error message (never the value itself).
fn describe(value: &serde_json::Value) -> &'static str {
    match value {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
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
        authenticated(parts, state).map(|(tenant, _)| Tenant(tenant))
    }
}

/// The request's tenant under the current policy, and the credential that chose it.
fn authenticated(
    parts: &Parts,
    state: &AppState,
) -> Result<(Arc<TenantPolicy>, Credential), GatewayError> {
    let policy = state.policy_store().current();
    credential(&parts.headers)
        .and_then(|credential| Ok((tenant_for(&policy, &credential)?, credential)))
        .map_err(|error| {
            // No tenant is known for a refused key; the label says so.
            record_rejection("unauthenticated", RejectReason::Auth);
            GatewayError::from(error)
        })
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
    /// What chose the tenant: a reload checks it again while the request is queued.
    pub credential: Credential,
    pub permit: IntakePermit,
    pub request: RequestCell,
}

impl FromRequestParts<AppState> for TenantIntake {
    type Rejection = GatewayError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let (tenant, credential) = authenticated(parts, state)?;
        // A refusal here is the request's outcome: counted as the handler counts its own.
        let refused = |reason: Option<RejectReason>| {
            record_request(
                &tenant.name,
                route_name(parts.uri.path()),
                RequestOutcome::Rejected,
            );
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
            credential,
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
    fn a_huge_number_in_a_bad_body_is_echoed_short() {
        let (message, param) = bad_body(br#"{"model":"m","messages":[],"max_tokens":1e308}"#);
        assert_eq!(param.as_deref(), Some("max_tokens"));
        assert!(
            message.contains("1e") && !message.contains("0000") && message.len() < 200,
            "{message}"
        );
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

    #[test]
    fn valid_json_of_the_wrong_shape_names_the_field() {
        // serde_json reports a null or a number where an enum's string belongs as a syntax
        // error ("expected value"); the body is valid JSON, so the role is named.
        for role in ["null", "5", "[]"] {
            let body = format!(r#"{{"model":"m","messages":[{{"role":{role},"content":"hi"}}]}}"#);
            let (message, param) = bad_body(body.as_bytes());
            assert_eq!(param.as_deref(), Some("messages[0].role"), "{role}");
            assert!(
                message.contains("`messages[0].role`") && !message.contains("could not parse"),
                "{role}: {message}"
            );
        }
        let (message, _) = bad_body(br#"{"model":"m","messages":[{"role":null}]}"#);
        assert!(message.starts_with("Missing or null value"), "{message}");
        // Missing fields are named with their path: at the top level and inside a message.
        let (message, param) = bad_body(br#"{"messages":[]}"#);
        assert_eq!(param.as_deref(), Some("model"));
        assert_eq!(message, "Missing required parameter: `model`.");
        let (_, param) = bad_body(br#"{"model":"m","messages":[{"content":"hi"}]}"#);
        assert_eq!(param.as_deref(), Some("messages[0].role"));
        // Not JSON at all: still the generic message, no param.
        let (message, param) = bad_body(br#"{"model":"m","messages":[{"role":nul}]}"#);
        assert!(message.starts_with("We could not parse"), "{message}");
        assert_eq!(param, None);
    }

    #[test]
    fn only_identity_content_encoding_is_accepted() {
        let headers = |values: &[&str]| {
            let mut map = http::HeaderMap::new();
            for v in values {
                map.append(
                    http::header::CONTENT_ENCODING,
                    http::HeaderValue::from_str(v).expect("header value"),
                );
            }
            map
        };
        for ok in [
            &[][..],
            &["identity"],
            &["Identity"],
            &["identity, identity"],
        ] {
            assert_eq!(unsupported_encoding(&headers(ok)), None, "{ok:?}");
        }
        for (values, named) in [
            (&["gzip"][..], "gzip"),
            (&["identity, br"], "identity, br"),
            (&["identity", "deflate"], "identity, deflate"),
        ] {
            assert_eq!(
                unsupported_encoding(&headers(values)).as_deref(),
                Some(named)
            );
        }
    }
}
