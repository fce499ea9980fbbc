//! Forwarding one admitted request to its upstream and relaying the answer.
//!
//! * [`forwarded_body`]: the client's JSON as sent (unknown fields included, so options kvgate
//!   ignores still reach an engine that honours them), with `model` set to the upstream's id,
//!   the completion budget validation settled on made explicit, and the messages
//!   `truncate_oldest` dropped removed. Only the top-level keys are parsed; every other value
//!   is copied as the client wrote it (of a shortened conversation, all but `messages`).
//! * [`Replica::send`]: POST to the same OpenAI path under the replica's URL, on one of the
//!   replica's keep-alive connections (`conn.rs`), with the replica's own key (`api_key_env`) if it has one: the client's
//!   `Authorization` is never forwarded. No connection, or no response headers within the
//!   replica's `timeout`, is a 502 `upstream_unavailable` (and a breaker failure; the caller
//!   may retry on another replica, since nothing reached the client yet).
//! * [`relay`]: the upstream's status, headers (less hop-by-hop ones and the ones kvgate sets
//!   itself) and body, with `model` renamed to the name the client asked for (`rename.rs`),
//!   frame by frame: an SSE stream is forwarded chunk by chunk as it arrives,
//!   with no buffering beyond the frame in flight (hyper stops reading the upstream when the
//!   client stops reading). The body owns the admission guard, which goes back when the body
//!   ends; if the client leaves, hyper drops the body, which drops the upstream response and
//!   closes that connection, so the upstream sees the disconnect and stops generating.
//!   Once an SSE stream has started, a failing upstream (a body error, or no frame within the
//!   upstream's `timeout`) is sent as one OpenAI error event (`upstream_unavailable`) that ends
//!   the stream cleanly and counts as a failure of that replica's breaker, as embedded-engine failures are ([`crate::stream`]). A JSON body that
//!   fails midway cannot be amended (its status and length are out), so that connection is
//!   aborted.

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http::header::{CONTENT_LENGTH, CONTENT_TYPE, HeaderName};
use http::{HeaderMap, Request};
use http_body::{Frame, SizeHint};
use http_body_util::{BodyExt, Full, Limited};
use serde_json::Value;
use serde_json::value::RawValue;
use tower::BoxError;

use super::Replica;
use super::conn::UpstreamBody;
use super::rename::{Framing, RenameModel, UsageCell};
use crate::error::GatewayError;
use crate::ratelimit::HEADER_NAMES as RATE_LIMIT_HEADERS;
use crate::request_log::{RequestContext, in_span_of};
use crate::shutdown::GraceOver;
use crate::stack::REQUEST_ID_HEADER;
use crate::telemetry::GenerationTelemetry;
use crate::validate::{Endpoint, ValidRequest};

/// Connection-level headers that describe one hop, never forwarded (RFC 9110 §7.6.1).
const HOP_BY_HOP: [HeaderName; 8] = [
    http::header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    http::header::PROXY_AUTHENTICATE,
    http::header::PROXY_AUTHORIZATION,
    http::header::TE,
    http::header::TRAILER,
    http::header::TRANSFER_ENCODING,
];

/// Headers of an upstream's answer that are the gateway's to set: its request id, and
/// `server`, which names the engine and its version (what nginx hides by default too).
const GATEWAY_OWN: [HeaderName; 2] = [
    HeaderName::from_static(REQUEST_ID_HEADER),
    http::header::SERVER,
];

/// The body to send upstream for a request validated as `valid`; `raw` is the client's body
/// (already parsed once by validation, so it is a JSON object).
pub(crate) fn forwarded_body(
    raw: &[u8],
    valid: &ValidRequest,
    upstream_model: &str,
) -> Result<Bytes, GatewayError> {
    // Only the top level is read: every other value (the messages, a long prompt) is copied as
    // the client wrote it, not parsed into a tree and written again.
    let body: BTreeMap<String, &RawValue> = serde_json::from_slice(raw).map_err(re_reading)?;
    let mut members: BTreeMap<&str, &str> = body
        .iter()
        .map(|(key, value)| (key.as_str(), value.get()))
        .collect();
    let model = serde_json::to_string(upstream_model).map_err(writing)?;
    members.insert("model", &model);
    let budget = valid.max_tokens.to_string();
    match valid.endpoint {
        // Validation read `max_completion_tokens` when both were given: send that one alone.
        Endpoint::Chat if members.contains_key("max_completion_tokens") => {
            members.remove("max_tokens");
            members.insert("max_completion_tokens", &budget);
        }
        Endpoint::Chat | Endpoint::Completion => {
            members.insert("max_tokens", &budget);
        }
    }
    // A conversation `truncate_oldest` shortened: only its messages are parsed and rewritten.
    let shortened;
    if valid.dropped_messages > 0
        && let Some(messages) = body.get("messages")
        && let Ok(mut messages) = serde_json::from_str::<Vec<Value>>(messages.get())
    {
        drop_oldest_turns(&mut messages, valid.dropped_messages);
        shortened = serde_json::to_string(&messages).map_err(writing)?;
        members.insert("messages", &shortened);
    }
    // In key order, as a serde_json map writes them.
    let mut out = Vec::with_capacity(raw.len() + upstream_model.len() + 32);
    out.push(b'{');
    for (i, (key, value)) in members.into_iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        serde_json::to_writer(&mut out, key).map_err(writing)?;
        out.push(b':');
        out.extend_from_slice(value.as_bytes());
    }
    out.push(b'}');
    Ok(Bytes::from(out))
}

fn re_reading(error: serde_json::Error) -> GatewayError {
    GatewayError::Internal(format!("re-reading a valid body: {error}"))
}

fn writing(error: serde_json::Error) -> GatewayError {
    GatewayError::Internal(format!("writing the upstream body: {error}"))
}

/// Removes the `dropped` oldest non-system messages, as `truncate_oldest` did when it counted
/// (system and developer messages are always kept).
fn drop_oldest_turns(messages: &mut Vec<Value>, dropped: usize) {
    let mut left = dropped;
    messages.retain(|message| {
        let role = message.get("role").and_then(Value::as_str);
        if left == 0 || matches!(role, Some("system" | "developer")) {
            return true;
        }
        left -= 1;
        false
    });
}

impl Replica {
    /// The upstream path of an endpoint: the same OpenAI path under the replica's URL prefix.
    fn path(&self, endpoint: Endpoint) -> String {
        let path = match endpoint {
            Endpoint::Chat => "/v1/chat/completions",
            Endpoint::Completion => "/v1/completions",
        };
        format!("{}{path}", self.spec().path_prefix())
    }

    /// POSTs `body` and waits for the response headers, at most the upstream's `timeout`.
    pub(crate) async fn send(
        &self,
        endpoint: Endpoint,
        body: Bytes,
        request_id: &str,
    ) -> Result<http::Response<UpstreamBody>, GatewayError> {
        let unavailable = |reason: &str, detail: String| GatewayError::UpstreamUnavailable {
            upstream: self.spec().name.clone(),
            reason: reason.to_owned(),
            detail,
        };
        let mut request = Request::post(self.path(endpoint))
            .header(CONTENT_TYPE, "application/json")
            .body(Full::new(body))
            .map_err(|error| {
                unavailable(
                    "the request could not be sent",
                    format!("cannot build the request: {error}"),
                )
            })?;
        if let Ok(id) = http::HeaderValue::from_str(request_id)
            && !request_id.is_empty()
        {
            request.headers_mut().insert(REQUEST_ID_HEADER, id);
        }
        if let Some(key) = &self.spec().api_key {
            let value =
                http::HeaderValue::from_str(&format!("Bearer {}", key.0)).map_err(|_| {
                    unavailable(
                        "its API key is not a valid header value",
                        "the replica's api_key has characters a header cannot carry".to_owned(),
                    )
                })?;
            request
                .headers_mut()
                .insert(http::header::AUTHORIZATION, value);
        }
        let timeout = self.spec().timeout;
        match tokio::time::timeout(timeout, self.conns().send(request)).await {
            Ok(Ok(response)) => Ok(response),
            // The transport error names the upstream's address: logged, not sent.
            Ok(Err(error)) => Err(unavailable("it could not be reached", error.to_string())),
            Err(_) => {
                let waited = format!("no response within {}s", timeout.as_secs_f64());
                Err(unavailable(&waited, waited.clone()))
            }
        }
    }
}

/// The error and its causes on one line ("client error (Connect): tcp connect error: ...").
fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

/// The upstream's answer as kvgate's: status, headers and body as received, except hop-by-hop
/// headers and the ones kvgate writes itself (`x-request-id`, `x-ratelimit-*`: the client's
/// limits are this gateway's). `Retry-After` and the rest pass through. `guard` (the
/// admission guard) lives until the body ends or is dropped. The body is watched for breaks
/// and stalls, and its end tells `from`'s breaker that the request succeeded: see
/// [`GuardedBody::watching`]. A server error (5xx) is not relayed as written: see
/// [`server_error`]. `telemetry`, for a request the upstream runs, times the answer and counts
/// its tokens under the tenant (see `rename.rs`).
pub(crate) fn relay<G: Send + Unpin + 'static>(
    upstream: http::Response<UpstreamBody>,
    guard: G,
    from: &Arc<Replica>,
    usage: UsageCell,
    telemetry: Option<GenerationTelemetry>,
    grace: GraceOver,
) -> Response {
    let (mut parts, body) = upstream.into_parts();
    if parts.status.is_server_error() {
        // Nothing runs upstream any more: its capacity comes back now.
        drop(guard);
        return server_error(parts, body, from);
    }
    strip_own_headers(&mut parts.headers);
    let content_type = parts
        .headers
        .get(CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .map(|value| value.trim_start().to_ascii_lowercase())
        .unwrap_or_default();
    let sse = content_type.starts_with("text/event-stream");
    let framing = if sse {
        Framing::Sse
    } else if content_type.starts_with("application/json") {
        Framing::Json
    } else {
        Framing::Verbatim
    };
    if framing != Framing::Verbatim {
        // The renamed body's length is not the upstream's.
        parts.headers.remove(CONTENT_LENGTH);
    }
    let mut body = RenameModel::new(body, from.spec().name.clone(), framing).reporting_usage(usage);
    if let Some(telemetry) = telemetry {
        body = body.recording(telemetry);
    }
    // Every relayed body is watched (see `GuardedBody::watching`): its end, break or stall
    // is what the replica's breaker hears about, not its headers.
    let body = GuardedBody::new(body, guard)
        .watching(from.spec().name.clone(), from.spec().timeout, sse)
        .blaming(Arc::clone(from))
        .ending_at(grace);
    Response::from_parts(parts, Body::new(body))
}

/// Most bytes of an upstream's 5xx body that are read into the log.
const LOGGED_ERROR_BYTES: usize = 8 * 1024;

/// An upstream's 5xx, answered as kvgate's own `upstream_error` with the same status and retry
/// headers. Its body (a stack trace, file paths, internal addresses: the upstream's internals)
/// is read into the log, at most [`LOGGED_ERROR_BYTES`] and the upstream's timeout, by a task
/// of its own, not sent. A 4xx is about the client's request and is relayed as written.
fn server_error(parts: http::response::Parts, body: UpstreamBody, from: &Replica) -> Response {
    let (upstream, status, timeout) = (from.spec().name.clone(), parts.status, from.spec().timeout);
    let logged = upstream.clone();
    // The task outlives the handler: it takes the request's log context along.
    let request = RequestContext::current();
    tokio::spawn(async move {
        let read = tokio::time::timeout(timeout, Limited::new(body, LOGGED_ERROR_BYTES).collect());
        let text = match read.await {
            Ok(Ok(collected)) => String::from_utf8_lossy(&collected.to_bytes()).into_owned(),
            Ok(Err(error)) => format!("(body not read: {error})"),
            Err(_) => "(no body within the upstream's timeout)".to_owned(),
        };
        in_span_of(request.as_ref(), || {
            tracing::warn!(
                upstream = %logged,
                status = status.as_u16(),
                body = %text,
                "upstream answered with a server error"
            )
        });
    });
    let mut response = axum::response::IntoResponse::into_response(GatewayError::UpstreamError {
        upstream,
        status,
    });
    for name in ["retry-after", "retry-after-ms"] {
        if let Some(value) = parts.headers.get(name) {
            response.headers_mut().insert(name, value.clone());
        }
    }
    response
}

fn strip_own_headers(headers: &mut HeaderMap) {
    // Headers the upstream's `Connection` names are hop-by-hop too.
    let named: Vec<HeaderName> = headers
        .get_all(http::header::CONNECTION)
        .iter()
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .filter_map(|name| HeaderName::try_from(name.trim()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP
        .iter()
        .chain(&RATE_LIMIT_HEADERS)
        .chain(&GATEWAY_OWN)
    {
        headers.remove(name);
    }
}

/// A body that holds `guard` until it has yielded its last frame (or failed, or is dropped).
pub(crate) struct GuardedBody<B, G> {
    /// `None` once the body has ended (dropping it closes the upstream connection).
    inner: Option<B>,
    guard: Option<G>,
    /// Set for a relayed body: failures and stalls end it (see [`GuardedBody::watching`]).
    watch: Option<Watch>,
}

/// How a relayed body is watched: the upstream's name, and the longest wait for a frame.
struct Watch {
    upstream: String,
    timeout: Duration,
    /// An SSE stream: a failure is sent as an error event. Any other body has sent its
    /// status already and can only be cut short.
    sse: bool,
    /// The replica whose breaker hears how the body ended.
    blame: Option<Arc<Replica>>,
    /// Armed on the first poll (a timer needs the runtime), re-armed after each frame.
    stall: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Resolves when shutdown's grace period is over: an SSE stream then sends a
    /// `shutting_down` error event and ends; any other body is cut (its status is sent).
    grace: Option<Pin<Box<dyn Future<Output = ()> + Send>>>,
    /// The request's log context: the body is polled after its handler returned, outside it.
    request: Option<RequestContext>,
}

impl<B, G> GuardedBody<B, G> {
    pub(crate) fn new(inner: B, guard: G) -> GuardedBody<B, G> {
        GuardedBody {
            inner: Some(inner),
            guard: Some(guard),
            watch: None,
        }
    }

    /// Makes this a relay from `upstream` that never waits more than `timeout` for a frame.
    /// For an SSE stream (`sse`), a body error or a stall is sent as one OpenAI
    /// `upstream_unavailable` error event, then the stream ends cleanly. Any other body (a
    /// JSON answer, whose 200 is already sent) ends with an error instead, so the client's
    /// connection is cut rather than left waiting or handed a short body as if complete.
    /// Both are logged.
    pub(crate) fn watching(
        mut self,
        upstream: String,
        timeout: Duration,
        sse: bool,
    ) -> GuardedBody<B, G> {
        self.watch = Some(Watch {
            upstream,
            timeout,
            sse,
            blame: None,
            stall: None,
            grace: None,
            request: RequestContext::current(),
        });
        self
    }

    /// The relay ends when shutdown's grace period is over (`grace`), as a failure the
    /// upstream is not blamed for: see [`Watch::grace`].
    pub(crate) fn ending_at(mut self, mut grace: GraceOver) -> GuardedBody<B, G> {
        if let Some(watch) = self.watch.as_mut() {
            watch.grace = Some(Box::pin(async move { grace.wait().await }));
        }
        self
    }

    /// The body's end counts as a success of `replica` (its breaker), a break or stall as a
    /// failure: a replica whose streams always break is ejected like one that refuses
    /// connections, although its headers arrive.
    pub(crate) fn blaming(mut self, replica: Arc<Replica>) -> GuardedBody<B, G> {
        if let Some(watch) = self.watch.as_mut() {
            watch.blame = Some(replica);
        }
        self
    }

    /// The body ended as it should: the replica's breaker hears of a success.
    fn succeed(&mut self) {
        if let Some(replica) = self.watch.as_ref().and_then(|watch| watch.blame.as_ref()) {
            replica.succeeded();
        }
        self.finish();
    }

    /// Ends the body: drops the upstream body (closing its connection) and the guard.
    fn finish(&mut self) {
        self.inner = None;
        drop(self.guard.take());
    }
}

/// How a watched body that broke or stalled ends: for an SSE stream the error event, for any
/// other body an error (the client's connection is cut). Logged either way.
fn failed_frame(watch: &Watch, reason: &str, detail: String) -> Result<Frame<Bytes>, BoxError> {
    let upstream = watch.upstream.as_str();
    if let Some(replica) = &watch.blame {
        replica.failed(reason);
    }
    in_span_of(watch.request.as_ref(), || {
        tracing::warn!(upstream, detail = %detail, sse = watch.sse,
                       "upstream answer failed after it started")
    });
    if !watch.sse {
        return Err(format!("upstream {upstream}: {reason}: {detail}").into());
    }
    let error = GatewayError::UpstreamUnavailable {
        upstream: upstream.to_owned(),
        reason: reason.to_owned(),
        detail,
    };
    Ok(Frame::data(Bytes::from(format!(
        "data: {}\n\n",
        error.sse_data()
    ))))
}

impl<B, G> http_body::Body for GuardedBody<B, G>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError> + std::error::Error + 'static,
    G: Unpin,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        if let Some(watch) = this.watch.as_mut()
            && let Some(grace) = watch.grace.as_mut()
            && grace.as_mut().poll(cx).is_ready()
        {
            let sse = watch.sse;
            in_span_of(watch.request.as_ref(), || {
                tracing::warn!(upstream = %watch.upstream, sse,
                               "grace period over: ending a relayed answer")
            });
            this.finish();
            let error = GatewayError::ShuttingDown;
            return Poll::Ready(Some(if sse {
                Ok(Frame::data(Bytes::from(format!(
                    "data: {}\n\n",
                    error.sse_data()
                ))))
            } else {
                Err(error.to_string().into())
            }));
        }
        let polled = Pin::new(inner).poll_frame(cx);
        let Some(watch) = this.watch.as_mut() else {
            if matches!(polled, Poll::Ready(None | Some(Err(_)))) {
                this.finish();
            }
            return polled.map(|frame| frame.map(|frame| frame.map_err(Into::into)));
        };
        match polled {
            Poll::Ready(Some(Ok(frame))) => {
                // (Past the clock's range the timer stays where `sleep` put it: far away.)
                if let (Some(stall), Some(at)) = (
                    watch.stall.as_mut(),
                    tokio::time::Instant::now().checked_add(watch.timeout),
                ) {
                    stall.as_mut().reset(at);
                }
                // A body that knows it has ended (a length, or the last chunk) is not polled
                // again by hyper: its end is seen here.
                if this.inner.as_ref().is_some_and(B::is_end_stream) {
                    this.succeed();
                }
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(None) => {
                this.succeed();
                Poll::Ready(None)
            }
            Poll::Ready(Some(Err(error))) => {
                let failed = failed_frame(watch, "its stream broke", describe(&error));
                this.finish();
                Poll::Ready(Some(failed))
            }
            Poll::Pending => {
                let timeout = watch.timeout;
                let stall = watch
                    .stall
                    .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
                if stall.as_mut().poll(cx).is_pending() {
                    return Poll::Pending;
                }
                let stalled = format!("no data within {}s", timeout.as_secs_f64());
                let failed = failed_frame(watch, &stalled, stalled.clone());
                this.finish();
                Poll::Ready(Some(failed))
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(B::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        match &self.inner {
            // A watched body may add an error event: its length is not known in advance.
            Some(inner) if self.watch.is_none() => inner.size_hint(),
            Some(_) => SizeHint::default(),
            None => SizeHint::with_exact(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    use http_body_util::BodyExt;
    use http_body_util::StreamBody;
    use serde_json::json;

    use super::*;
    use crate::validate::Endpoint;

    fn valid(endpoint: Endpoint, max_tokens: u32, dropped_messages: usize) -> ValidRequest {
        ValidRequest {
            endpoint,
            prompt_ids: vec![1, 2, 3],
            max_tokens,
            temperature: 1.0,
            top_p: 1.0,
            seed: None,
            stop: Vec::new(),
            stream: false,
            include_usage: false,
            user: None,
            dropped_messages,
        }
    }

    fn forwarded(raw: Value, valid: &ValidRequest) -> Value {
        let bytes = forwarded_body(&serde_json::to_vec(&raw).unwrap(), valid, "up-model").unwrap();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[test]
    fn the_body_names_the_upstream_model_and_an_explicit_budget() {
        let raw = json!({
            "model": "remote",
            "messages": [{"role": "user", "content": "hi"}],
            "stream": true,
            "frequency_penalty": 0.5,
        });
        let sent = forwarded(raw, &valid(Endpoint::Chat, 77, 0));
        assert_eq!(sent["model"], "up-model");
        assert_eq!(sent["max_tokens"], 77);
        assert_eq!(sent["stream"], true);
        assert_eq!(sent["frequency_penalty"], 0.5, "unknown fields are kept");
        assert_eq!(sent["messages"][0]["content"], "hi");

        let raw = json!({"model": "remote", "messages": [], "max_tokens": 9,
                         "max_completion_tokens": 20});
        let sent = forwarded(raw, &valid(Endpoint::Chat, 20, 0));
        assert_eq!(sent["max_completion_tokens"], 20);
        assert!(sent.get("max_tokens").is_none(), "{sent}");

        let raw = json!({"model": "remote", "prompt": "Once"});
        let sent = forwarded(raw, &valid(Endpoint::Completion, 16, 0));
        assert_eq!(sent["max_tokens"], 16);
    }

    /// What `forwarded_body` sent before it copied values as written: the whole body as a
    /// `serde_json` tree, edited and written again. The reference its output must equal.
    fn forwarded_body_as_a_tree(raw: &[u8], valid: &ValidRequest, upstream_model: &str) -> Value {
        let mut body: serde_json::Map<String, Value> = serde_json::from_slice(raw).unwrap();
        body.insert("model".to_owned(), Value::from(upstream_model));
        let budget = Value::from(valid.max_tokens);
        match valid.endpoint {
            Endpoint::Chat if body.contains_key("max_completion_tokens") => {
                body.remove("max_tokens");
                body.insert("max_completion_tokens".to_owned(), budget);
            }
            Endpoint::Chat | Endpoint::Completion => {
                body.insert("max_tokens".to_owned(), budget);
            }
        }
        if valid.dropped_messages > 0
            && let Some(Value::Array(messages)) = body.get_mut("messages")
        {
            drop_oldest_turns(messages, valid.dropped_messages);
        }
        Value::Object(body)
    }

    #[test]
    fn the_top_level_path_sends_what_the_tree_path_sends_and_copies_values_as_written() {
        let bodies = [
            r#"{"model":"remote","messages":[{"role":"user","content":"hi"}],"stream":true}"#,
            r#" { "messages" : [ {"role":"user", "content":"caf\u00e9 \"q\" \n"} ] ,
                 "model":"m", "temperature": 1.0e0, "extra": {"nested": [1, null, false]} } "#,
            r#"{"model":"m","messages":[],"max_tokens":9,"max_completion_tokens":20}"#,
            r#"{"model":"m","messages":[],"max_tokens":9}"#,
            r#"{"model":"m","prompt":"Once","max_tokens":3,"\u006dodel":"dup"}"#,
            r#"{"model":"m","prompt":"x","n":1,"n":2,"logit_bias":{"50256":-100}}"#,
        ];
        for raw in bodies {
            for endpoint in [Endpoint::Chat, Endpoint::Completion] {
                // 1: a shortened conversation, whose messages are rewritten.
                for dropped in [0, 1] {
                    let valid = valid(endpoint, 20, dropped);
                    let fast = forwarded_body(raw.as_bytes(), &valid, "up \"model\"").unwrap();
                    let tree = forwarded_body_as_a_tree(raw.as_bytes(), &valid, "up \"model\"");
                    let fast_value: Value = serde_json::from_slice(&fast).unwrap();
                    assert_eq!(fast_value, tree, "{raw}");
                    assert_eq!(fast_value["model"], "up \"model\"", "{raw}");
                }
            }
        }
        // Values are the client's text, not re-written numbers or escapes.
        let raw = r#"{"model":"m","temperature":1.0e0,"messages":[{"content":"caf\u00e9"}]}"#;
        let sent = forwarded_body(raw.as_bytes(), &valid(Endpoint::Chat, 5, 0), "u").unwrap();
        let sent = std::str::from_utf8(&sent).unwrap();
        assert_eq!(
            sent,
            r#"{"max_tokens":5,"messages":[{"content":"caf\u00e9"}],"model":"u","temperature":1.0e0}"#
        );
    }

    #[test]
    fn truncated_turns_are_removed_from_the_forwarded_conversation() {
        let raw = json!({"model": "remote", "messages": [
            {"role": "system", "content": "s"},
            {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"},
            {"role": "developer", "content": "d"},
            {"role": "user", "content": "u2"},
        ]});
        let sent = forwarded(raw, &valid(Endpoint::Chat, 8, 2));
        let contents: Vec<&str> = sent["messages"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["content"].as_str().unwrap())
            .collect();
        assert_eq!(contents, ["s", "d", "u2"]);
    }

    #[test]
    fn own_and_hop_by_hop_headers_are_not_relayed() {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("connection", "keep-alive, x-hop"),
            ("x-hop", "1"),
            ("transfer-encoding", "chunked"),
            ("x-request-id", "upstream-id"),
            ("x-ratelimit-remaining-tokens", "5"),
            ("server", "BaseHTTP/0.6 Python/3.11.7"),
            ("retry-after", "7"),
            ("content-type", "text/event-stream"),
        ] {
            headers.insert(name, value.parse().unwrap());
        }
        strip_own_headers(&mut headers);
        let mut left: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        left.sort_unstable();
        assert_eq!(left, ["content-type", "retry-after"]);
    }

    /// Sets its flag when dropped.
    struct Flag(Arc<AtomicBool>);

    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn the_guard_lives_until_the_last_frame() {
        let released = Arc::new(AtomicBool::new(false));
        let frames = futures::stream::iter(
            ["data: a\n\n", "data: [DONE]\n\n"]
                .map(|chunk| Ok::<_, std::convert::Infallible>(Frame::data(Bytes::from(chunk)))),
        );
        let mut body = GuardedBody::new(StreamBody::new(frames), Flag(Arc::clone(&released)));
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "data: a\n\n");
        assert!(!released.load(Ordering::SeqCst), "held while frames remain");
        body.frame().await.unwrap().unwrap();
        assert!(!released.load(Ordering::SeqCst));
        assert!(body.frame().await.is_none());
        assert!(released.load(Ordering::SeqCst), "released at the end");

        // A client that leaves early drops the body, and the guard with it.
        let released = Arc::new(AtomicBool::new(false));
        let body = GuardedBody::new(Full::new(Bytes::from("{}")), Flag(Arc::clone(&released)));
        drop(body);
        assert!(released.load(Ordering::SeqCst));
    }

    /// An upstream body: `frames`, then `end` — `Ok(())` ends it, `Err(())` breaks it (a
    /// transport error), and `None` stalls it forever.
    fn upstream_body(
        frames: &[&'static str],
        end: Option<Result<(), ()>>,
    ) -> impl http_body::Body<Data = Bytes, Error = std::io::Error> + Unpin {
        let head = frames
            .iter()
            .map(|text| Ok(Frame::data(Bytes::from_static(text.as_bytes()))));
        let tail = match end {
            Some(Err(())) => vec![Err(std::io::Error::other("connection reset"))],
            _ => Vec::new(),
        };
        type Item = Result<Frame<Bytes>, std::io::Error>;
        let rest: Pin<Box<dyn futures::Stream<Item = Item> + Send>> = match end {
            None => Box::pin(futures::stream::pending()),
            Some(_) => Box::pin(futures::stream::empty()),
        };
        let stream = futures::StreamExt::chain(
            futures::stream::iter(head.chain(tail).collect::<Vec<_>>()),
            rest,
        );
        StreamBody::new(Box::pin(stream))
    }

    #[tokio::test(start_paused = true)]
    async fn the_end_of_the_grace_period_ends_a_relayed_stream_with_an_error_event() {
        let pool = crate::upstream::pool::test_pool(&[1000]);
        let replica = Arc::clone(&pool.replicas()[0]);
        let released = Arc::new(AtomicBool::new(false));
        let (over, grace) = tokio::sync::watch::channel(false);
        // The upstream keeps streaming (never ends, never stalls past its timeout here).
        let mut body = GuardedBody::new(
            upstream_body(&["data: a\n\n"], None),
            Flag(Arc::clone(&released)),
        )
        .watching("m".to_owned(), Duration::from_secs(3), true)
        .blaming(Arc::clone(&replica))
        .ending_at(GraceOver::new(grace));
        let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
        assert_eq!(first, "data: a\n\n");
        over.send_replace(true);
        let last = body.frame().await.unwrap().unwrap().into_data().unwrap();
        let text = std::str::from_utf8(&last).unwrap();
        let json: Value = serde_json::from_str(text.strip_prefix("data: ").unwrap().trim())
            .unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert_eq!(json["error"]["code"], "shutting_down", "{json}");
        assert!(
            body.frame().await.is_none(),
            "nothing after the error event"
        );
        assert!(
            released.load(Ordering::SeqCst),
            "its admission guard is released"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_json_answer_that_stalls_or_breaks_is_cut_within_the_timeout_and_blamed() {
        let pool = crate::upstream::pool::test_pool(&[1000]);
        let replica = Arc::clone(&pool.replicas()[0]);
        let timeout = Duration::from_secs(3);
        for end in [None, Some(Err(()))] {
            let released = Arc::new(AtomicBool::new(false));
            let mut body = GuardedBody::new(
                upstream_body(&["{\"id\":"], end),
                Flag(Arc::clone(&released)),
            )
            .watching("m".to_owned(), timeout, false)
            .blaming(Arc::clone(&replica));
            let first = body.frame().await.unwrap().unwrap().into_data().unwrap();
            assert_eq!(first, "{\"id\":");
            let started = tokio::time::Instant::now();
            let error = body.frame().await.expect("a frame").expect_err("cut short");
            let text = error.to_string();
            match end {
                None => {
                    assert_eq!(started.elapsed(), timeout, "cut at the timeout, not later");
                    assert!(text.contains("no data within 3s"), "{text}");
                }
                _ => assert!(text.contains("its stream broke"), "{text}"),
            }
            assert!(
                released.load(Ordering::SeqCst),
                "its admission guard is released"
            );
            assert!(body.frame().await.is_none(), "nothing after the error");
        }
        assert!(!replica.is_ejected(), "two failures: not yet");
    }

    #[tokio::test(start_paused = true)]
    async fn streams_that_break_after_their_headers_eject_the_replica_and_clean_ends_reset_it() {
        let pool = crate::upstream::pool::test_pool(&[1000]);
        let replica = Arc::clone(&pool.replicas()[0]);
        let relay = |end: Option<Result<(), ()>>, sse: bool| {
            GuardedBody::new(upstream_body(&["data: a\n\n"], end), ())
                .watching("m".to_owned(), Duration::from_secs(3), sse)
                .blaming(Arc::clone(&replica))
        };
        // What the client got: the frames, or the error that cut the body.
        let run = |end, sse| {
            let body = relay(end, sse);
            async move { body.collect().await.map(|all| all.to_bytes()) }
        };
        // Breaks one short of the threshold, then a stream that ends cleanly: reset.
        let threshold = super::super::breaker::FAILURE_THRESHOLD;
        for _ in 1..threshold {
            let sent = run(Some(Err(())), true)
                .await
                .expect("an SSE break ends cleanly");
            let text = String::from_utf8_lossy(&sent).into_owned();
            assert!(
                text.contains("upstream_unavailable"),
                "an error event: {text}"
            );
        }
        run(Some(Ok(())), true).await.expect("a clean stream");
        for _ in 1..threshold {
            run(Some(Err(())), true)
                .await
                .expect("an SSE break ends cleanly");
        }
        assert!(
            !replica.is_ejected(),
            "a clean end in between resets the count"
        );
        // The threshold-th break in a row ejects it, although every answer's headers came.
        run(None, false)
            .await
            .expect_err("a JSON answer that stalls is cut");
        assert!(replica.is_ejected(), "{:?}", replica.breaker_state());
    }
}
