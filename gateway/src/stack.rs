//! The middleware stack around the router, in a fixed order. The first layer listed is the
//! outermost: it sees the request first and the response last (tower's `ServiceBuilder` rule).
//!
//! The stack wraps the *whole* router once (not each route, as `Router::layer` would). Load
//! shedding sits on the API routes only ([`api_limit`], one semaphore shared by all of them). Auth is not here: it is the `Tenant` extractor,
//! because it needs the live policy and must run before the body is read but after routing
//! (health probes and 404s need no key). Admission (per-tenant concurrency, queues, KV) is not
//! here either: its guard must live in the response body, which a tower layer cannot do.
//! (The rate-limit header layer looks the key up again, but only to pick whose limits a
//! response reports; it never refuses anything.)

use std::any::Any;
use std::convert::Infallible;
use std::future::{Future, Ready, ready};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::error_handling::HandleErrorLayer;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use futures::future::Either;
use http::header::AUTHORIZATION;
use http::{HeaderMap, HeaderName, HeaderValue};
use hyper::body::Incoming;
use pin_project_lite::pin_project;
use rand::Rng;
use tokio::sync::Semaphore;
use tower::layer::util::{Identity, Stack};
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::load_shed::LoadShedLayer;
use tower::load_shed::error::Overloaded;
use tower::timeout::TimeoutLayer;
use tower::timeout::error::Elapsed;
use tower::util::BoxCloneSyncService;
use tower::{BoxError, Layer, Service, ServiceBuilder};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::request_id::{
    MakeRequestId, PropagateRequestIdLayer, RequestId, SetRequestIdLayer,
};

use crate::admission::Admission;
use crate::error::GatewayError;
use crate::ratelimit::RateLimitHeaders;
use crate::request_log;

/// Every response carries this header; a client-supplied value is kept if it is usable (see
/// [`is_usable_request_id`]), otherwise replaced by a fresh one.
pub const REQUEST_ID_HEADER: &str = "x-request-id";

/// Longest client-supplied request id kept (UUIDs, W3C trace ids and OpenAI-style ids fit).
pub const MAX_REQUEST_ID_LEN: usize = 128;

/// The service hyper runs for every connection.
pub type GatewayService = BoxCloneSyncService<Request<Incoming>, Response, Infallible>;

/// Settings of the outer layers.
#[derive(Debug, Clone, Copy)]
pub struct StackConfig {
    /// Time until the response *headers*; a stream may run longer.
    pub request_timeout: Duration,
    pub body_limit_bytes: usize,
}

/// Wraps `router` (already given its state, and [`api_limit`] on its API routes) in the stack.
/// `admission` answers the `x-ratelimit-*` headers of responses no handler gave them.
pub fn build(router: Router, config: StackConfig, admission: Admission) -> GatewayService {
    let request_id = HeaderName::from_static(REQUEST_ID_HEADER);
    let timeout = config.request_timeout;
    let service = ServiceBuilder::new()
        // 1. One body type in and out, so the layers below compose with hyper.
        .map_request(|request: Request<Incoming>| request.map(Body::new))
        .map_response(|response: Response<_>| response.map(Body::new))
        // 1b. The size of the head as the client sent it, before a layer adds a header
        //     ([`RequestLimitsLayer`] below must not count the request id made for it).
        .map_request(record_head_bytes)
        // 2. Request id first, so every log line and every response below can carry it. A
        //    client's id goes into logs, responses and upstream requests: one that is too long
        //    or carries odd characters is dropped here and a fresh one made instead.
        .map_request(drop_unusable_request_id)
        .layer(SetRequestIdLayer::new(request_id.clone(), RandomRequestId))
        // 3. Copy it onto the response, including responses made by the rescue and panic layers.
        .layer(PropagateRequestIdLayer::new(request_id))
        // 4. The request's log context, inside the id so it can name it: every line logged
        //    while the request is handled reads `request{method path id}: ...`, the span made
        //    only for lines that are logged (`request_log.rs`). Failures are not logged here:
        //    `GatewayError::log` logs each error response once, at the level its kind
        //    deserves (load shedding is no ERROR).
        .layer(request_log::ScopeLayer)
        // 5. Rate-limit headers on every response, including those of the layers below (413,
        //    504, panics, load shedding) and of the router (401, 404, 405, probes).
        .layer(RateLimitHeadersLayer { admission })
        // 6. A panic anywhere below becomes a 500 JSON error, never a dropped connection.
        .layer(CatchPanicLayer::custom(panic_response))
        // 7. Rescue: the timeout's error becomes OpenAI JSON here.
        .layer(HandleErrorLayer::new(move |error: BoxError| async move {
            rescue(error, timeout)
        }))
        // 8. Timeout: bounds body upload, validation, queueing and non-streamed generation
        //    (dropping the handler cancels its sequence); a stream's body may run longer.
        .layer(TimeoutLayer::new(timeout))
        // 9. Head limits: header fields and URI far below hyper's own (whose refusals are a
        //    bare status line), so an oversized cookie or query gets OpenAI JSON like the rest;
        //    then the body limit: by Content-Length at once, and as a cap on chunked bodies.
        .layer(RequestLimitsLayer {
            body_limit_bytes: config.body_limit_bytes,
        })
        // 10. Routing; the API routes carry the load-shedding limit below ([`api_limit`]).
        .service(router);
    BoxCloneSyncService::new(service)
}

/// The layer stack [`api_limit`] returns.
pub type ApiLimit = ServiceBuilder<
    Stack<
        GlobalConcurrencyLimitLayer,
        Stack<LoadShedLayer, Stack<HandleErrorLayer<ShedRescue, ()>, Identity>>,
    >,
>;

/// The rescue function of [`api_limit`].
pub type ShedRescue = fn(BoxError) -> Ready<GatewayError>;

/// Load shedding for the API routes only (`Router::route_layer`), around one semaphore shared
/// by all of them. At `max_in_flight` it answers 503 + Retry-After at once instead of queueing
/// in front of admission, which has its own fair, bounded queues. Health probes and `/metrics`
/// are never shed: a liveness probe failing under load would get a busy server restarted.
/// The permit is held until response headers (tower's rule): it bounds request handling, not
/// streams, whose capacity the admission guard in the body accounts for.
pub fn api_limit(max_in_flight: usize) -> ApiLimit {
    let in_flight = Arc::new(Semaphore::new(max_in_flight.max(1)));
    let rescue: ShedRescue = |error| ready(rescue(error, Duration::ZERO));
    ServiceBuilder::new()
        .layer(HandleErrorLayer::new(rescue))
        .layer(LoadShedLayer::new())
        .layer(GlobalConcurrencyLimitLayer::with_semaphore(in_flight))
}

/// Turns the errors of the load-shed and timeout layers into responses.
fn rescue(error: BoxError, timeout: Duration) -> GatewayError {
    if error.is::<Overloaded>() {
        GatewayError::Overloaded
    } else if error.is::<Elapsed>() {
        GatewayError::RequestTimeout { after: timeout }
    } else {
        GatewayError::Internal(error.to_string())
    }
}

fn panic_response(panic: Box<dyn Any + Send + 'static>) -> Response {
    let detail = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("unknown panic");
    // Logged once, with the panic's message as the detail, by the error's own log line.
    GatewayError::Internal(format!("the request handler panicked: {detail}")).into_response()
}

/// Adds the `x-ratelimit-*` headers to a response that does not carry them. Handlers that
/// debited a bucket (or were refused by one) set them from that moment's state; everything
/// else gets [`Admission::rate_headers_for_request`]: the live state of the caller's tenant,
/// or the `[defaults]` limits untouched when the key maps to no tenant.
///
/// This layer and [`RequestLimitsLayer`] are plain tower layers rather than axum's `from_fn`
/// middleware: their futures are named types, so a request costs neither a boxed clone of the
/// inner service nor a boxed future per layer (BENCHMARKS.md, "Where a relayed request's CPU
/// goes").
#[derive(Clone)]
pub struct RateLimitHeadersLayer {
    admission: Admission,
}

impl<S> Layer<S> for RateLimitHeadersLayer {
    type Service = RateLimitHeadersService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RateLimitHeadersService {
            inner,
            admission: self.admission.clone(),
        }
    }
}

/// The service [`RateLimitHeadersLayer`] makes.
#[derive(Clone)]
pub struct RateLimitHeadersService<S> {
    inner: S,
    admission: Admission,
}

impl<S, B> Service<Request> for RateLimitHeadersService<S>
where
    S: Service<Request, Response = http::Response<B>>,
{
    type Response = http::Response<B>;
    type Error = S::Error;
    type Future = WithRateLimitHeaders<S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // Only the credentials are needed afterwards; the request itself moves on. (A header
        // value's clone shares its bytes.)
        let credentials = request.headers().get(AUTHORIZATION).cloned();
        WithRateLimitHeaders {
            inner: self.inner.call(request),
            admission: self.admission.clone(),
            credentials,
        }
    }
}

pin_project! {
    /// The future of [`RateLimitHeadersService`].
    pub struct WithRateLimitHeaders<F> {
        #[pin]
        inner: F,
        admission: Admission,
        credentials: Option<HeaderValue>,
    }
}

impl<F, B, E> Future for WithRateLimitHeaders<F>
where
    F: Future<Output = Result<http::Response<B>, E>>,
{
    type Output = Result<http::Response<B>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let mut response = ready!(this.inner.poll(cx))?;
        if !RateLimitHeaders::present_in(response.headers()) {
            let mut credentials = HeaderMap::new();
            if let Some(value) = this.credentials.take() {
                credentials.insert(AUTHORIZATION, value);
            }
            this.admission
                .rate_headers_for_request(&credentials)
                .apply(response.headers_mut());
        }
        Poll::Ready(Ok(response))
    }
}

/// Most bytes of header fields a request may carry (each counted as `name: value` and its line
/// end), as Node's default and above what browsers and OpenAI clients send. hyper's own limit
/// (about 400 KB, and 100 fields) stays behind it for what is beyond any client's reason.
pub const MAX_HEADER_BYTES: usize = 16 * 1024;

/// Longest request URI (path and query), as nginx's default request line.
pub const MAX_URI_BYTES: usize = 8 * 1024;

/// Refuses a request whose header fields or URI are over [`MAX_HEADER_BYTES`] /
/// [`MAX_URI_BYTES`] with 431 / 414, or whose announced body is over the body limit with 413,
/// each with an OpenAI-style body; caps the body it lets through at the limit (a chunked body
/// that runs over fails as it is read).
#[derive(Debug, Clone, Copy)]
pub struct RequestLimitsLayer {
    body_limit_bytes: usize,
}

impl<S> Layer<S> for RequestLimitsLayer {
    type Service = RequestLimits<S>;

    fn layer(&self, inner: S) -> Self::Service {
        RequestLimits {
            inner,
            body_limit_bytes: self.body_limit_bytes,
        }
    }
}

/// The service [`RequestLimitsLayer`] makes.
#[derive(Debug, Clone)]
pub struct RequestLimits<S> {
    inner: S,
    body_limit_bytes: usize,
}

impl<S> Service<Request> for RequestLimits<S>
where
    S: Service<Request, Response = Response>,
{
    type Response = Response;
    type Error = S::Error;
    type Future = Either<Ready<Result<Response, S::Error>>, S::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let limit = self.body_limit_bytes;
        if let Some(refusal) = over_limits(&request, limit) {
            return Either::Left(ready(Ok(refusal.into_response())));
        }
        let request = request.map(|body| Body::new(http_body_util::Limited::new(body, limit)));
        Either::Right(self.inner.call(request))
    }
}

/// Why `request` is refused before anything reads it, if it is.
fn over_limits(request: &Request, body_limit_bytes: usize) -> Option<GatewayError> {
    let uri = request.uri();
    let length = uri.path_and_query().map_or(0, |pq| pq.as_str().len())
        + uri.authority().map_or(0, |a| a.as_str().len())
        + uri.scheme_str().map_or(0, str::len);
    if length > MAX_URI_BYTES {
        let limit_bytes = MAX_URI_BYTES;
        return Some(GatewayError::UriTooLong {
            length,
            limit_bytes,
        });
    }
    let bytes = match request.extensions().get::<SentHeaderBytes>() {
        Some(sent) => sent.0,
        None => header_bytes(request.headers()),
    };
    if bytes > MAX_HEADER_BYTES {
        let limit_bytes = MAX_HEADER_BYTES;
        return Some(GatewayError::HeadersTooLarge { bytes, limit_bytes });
    }
    if announced_body_bytes(request.headers()).is_some_and(|n| n > body_limit_bytes as u64) {
        return Some(GatewayError::PayloadTooLarge {
            limit_bytes: body_limit_bytes,
        });
    }
    None
}

/// The body size a request's `Content-Length` announces, when it is a number: what both body
/// limits (this layer's and the body reader's, `extract.rs`) refuse before reading a byte.
pub(crate) fn announced_body_bytes(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
}

/// Bytes of the header fields the client sent ([`header_bytes`]), recorded before any layer
/// adds one.
#[derive(Debug, Clone, Copy)]
struct SentHeaderBytes(usize);

fn record_head_bytes(mut request: Request) -> Request {
    let sent = SentHeaderBytes(header_bytes(request.headers()));
    request.extensions_mut().insert(sent);
    request
}

/// Bytes of `headers` as sent: `name: value` and CRLF per field.
fn header_bytes(headers: &HeaderMap) -> usize {
    headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len() + 4)
        .sum()
}

/// Removes the client's `x-request-id` unless it is exactly one usable value.
fn drop_unusable_request_id(mut request: Request) -> Request {
    let mut values = request.headers().get_all(REQUEST_ID_HEADER).iter();
    let usable = match (values.next(), values.next()) {
        (None, _) => return request,
        (Some(value), None) => is_usable_request_id(value.as_bytes()),
        (Some(_), Some(_)) => false,
    };
    if !usable {
        // The value itself is not logged: it is what was unfit for a log line.
        tracing::debug!("replacing a client x-request-id that is not 1-128 of [A-Za-z0-9._:-]");
        request.headers_mut().remove(REQUEST_ID_HEADER);
    }
    request
}

/// 1 to [`MAX_REQUEST_ID_LEN`] bytes of ASCII letters, digits and `-_.:`: safe in log lines,
/// JSON, headers sent upstream, and every log query language.
pub fn is_usable_request_id(id: &[u8]) -> bool {
    !id.is_empty()
        && id.len() <= MAX_REQUEST_ID_LEN
        && id
            .iter()
            .all(|&b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// `req_` + 24 random alphanumerics, like OpenAI's ids.
#[derive(Debug, Clone, Copy)]
struct RandomRequestId;

impl MakeRequestId for RandomRequestId {
    fn make_request_id<B>(&mut self, _request: &http::Request<B>) -> Option<RequestId> {
        HeaderValue::from_bytes(&random_request_id(&mut rand::rng()))
            .ok()
            .map(RequestId::new)
    }
}

const ALPHANUMERIC: &[u8; 62] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";

/// `req_` and 24 alphanumerics: three random 64-bit words, eight base-62 digits from each
/// (62^8 < 2^64, so each digit is uniform to within one part in 10^5), made on the stack. One
/// draw per word rather than one per character, and no string built only to be copied.
fn random_request_id(rng: &mut impl Rng) -> [u8; 28] {
    let mut id = *b"req_000000000000000000000000";
    for digits in id[4..].chunks_exact_mut(8) {
        let mut word: u64 = rng.random();
        for digit in digits {
            *digit = ALPHANUMERIC[(word % 62) as usize];
            word /= 62;
        }
    }
    id
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    async fn error_json(response: Response) -> serde_json::Value {
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        serde_json::from_slice(&bytes).unwrap()
    }

    #[tokio::test]
    async fn a_panic_becomes_a_500_openai_error() {
        let response = panic_response(Box::new("index out of bounds"));
        assert_eq!(response.status(), 500);
        let json = error_json(response).await;
        assert_eq!(json["error"]["code"], "internal_error");
        assert_eq!(json["error"]["type"], "server_error");
    }

    #[test]
    fn shed_and_timeout_errors_are_rescued_with_their_own_codes() {
        let shed = rescue(Box::new(Overloaded::new()), Duration::ZERO);
        assert_eq!(
            (shed.status().as_u16(), shed.code()),
            (503, Some("overloaded"))
        );
        assert!(shed.retry_after().is_some());
        let late = rescue(Box::new(Elapsed::new()), Duration::from_secs(3));
        assert_eq!(
            (late.status().as_u16(), late.code()),
            (504, Some("timeout"))
        );
    }

    #[test]
    fn client_request_ids_are_kept_only_when_short_and_plain() {
        let with = |values: &[&[u8]]| {
            let mut request = Request::new(Body::empty());
            for value in values {
                request.headers_mut().append(
                    REQUEST_ID_HEADER,
                    HeaderValue::from_bytes(value).expect("valid header bytes"),
                );
            }
            drop_unusable_request_id(request)
                .headers()
                .get_all(REQUEST_ID_HEADER)
                .iter()
                .map(|v| v.as_bytes().to_vec())
                .collect::<Vec<_>>()
        };
        let uuid = b"0b6e1f0c-5d3a-4b8e-9c1d-2f3a4b5c6d7e";
        assert_eq!(with(&[uuid]), vec![uuid.to_vec()]);
        assert_eq!(with(&[b"req_abc.def:1"]), vec![b"req_abc.def:1".to_vec()]);
        let longest = vec![b'a'; MAX_REQUEST_ID_LEN];
        assert_eq!(with(&[&longest]), vec![longest.clone()]);
        let too_long = [b'a'; MAX_REQUEST_ID_LEN + 1];
        for bad in [
            &too_long[..],
            b"has space",
            b"quote\"",
            b"new%0Aline",
            b"\xff\xfe",
            b"{\"json\":1}",
        ] {
            assert!(
                with(&[bad]).is_empty(),
                "{:?}",
                String::from_utf8_lossy(bad)
            );
        }
        // Two ids: which one would the logs use? Neither.
        assert!(with(&[b"one", b"two"]).is_empty());
        assert!(with(&[]).is_empty());
    }

    #[test]
    fn request_ids_look_like_openai_ones() {
        let request = http::Request::new(());
        let id = RandomRequestId.make_request_id(&request).unwrap();
        let text = id.header_value().to_str().unwrap();
        assert!(text.starts_with("req_") && text.len() == 28, "{text}");
        assert!(is_usable_request_id(text.as_bytes()), "{text}");
    }

    #[test]
    fn request_ids_use_every_alphanumeric_evenly_and_do_not_repeat() {
        use rand::SeedableRng;
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut seen = std::collections::HashSet::new();
        let mut counts = [0u32; 256];
        for _ in 0..10_000 {
            let id = random_request_id(&mut rng);
            assert_eq!(&id[..4], b"req_");
            for &c in &id[4..] {
                counts[usize::from(c)] += 1;
            }
            assert!(
                seen.insert(id),
                "repeated {:?}",
                String::from_utf8_lossy(&id)
            );
        }
        // 240,000 digits over 62 symbols: 3,871 of each expected, with a standard deviation
        // of about 61; each count is within 4.5 of those of it.
        for &c in ALPHANUMERIC {
            let n = counts[usize::from(c)];
            assert!(
                (3_600..=4_150).contains(&n),
                "{} appeared {n} times",
                c as char
            );
        }
        let others: u32 = (0..=255u8)
            .filter(|c| !ALPHANUMERIC.contains(c))
            .map(|c| counts[usize::from(c)])
            .sum();
        assert_eq!(others, 0);
    }
}
