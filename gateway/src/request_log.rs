//! Each request's place in the log: the `request{method path id}` span that prefixes every
//! line logged while it is handled — made only when such a line is logged.
//!
//! Why not one span per request, made up front (tower-http's `TraceLayer`, as before): with
//! the `info` filter `serve` runs under, that span is enabled, so every request paid for it
//! whether it logged anything or not — its fields formatted into a string, a slot in the
//! subscriber's registry, and an enter and exit on every poll of the handler and of the
//! response body — and almost no request logs a line. In front of a fast upstream that was
//! about 4 µs of the ~83 µs of CPU a relayed request costs the gateway at one connection
//! (BENCHMARKS.md, "Proxy overhead": a few percent, within the spread of single runs). So
//! [`ScopeLayer`] keeps only what the span would name (cheap clones of the method, the URI and
//! the request id) in a task-local, and [`in_request_span`] builds the span around the one line
//! that needs it: the line reads as before.
//!
//! When any directive enables `debug` (`RUST_LOG=debug`, or `kvgate_gateway::upstream=debug`),
//! the span is made up front again: debug lines are many and come from everywhere, and whoever
//! asked for them asked for the cost. Lines logged while a response *body* is polled (after
//! the handler returned, outside the task-local) take the context with them:
//! [`RequestContext::current`] when the body is made, [`RequestContext::in_scope`] when it
//! logs.

use std::task::{Context, Poll};

use axum::extract::Request;
use http::{HeaderValue, Method, Uri};
use tokio::task::futures::TaskLocalFuture;
use tower::{Layer, Service};
use tower_http::request_id::RequestId;
use tracing::Instrument;
use tracing::instrument::Instrumented;
use tracing::level_filters::LevelFilter;

tokio::task_local! {
    static CURRENT: RequestContext;
}

/// What a request's span names. Cloning it allocates nothing: the method is a small value, the
/// URI and the id share the bytes the request was parsed from.
#[derive(Debug, Clone)]
pub struct RequestContext {
    method: Method,
    uri: Uri,
    id: Option<HeaderValue>,
}

impl RequestContext {
    /// The context of `request`; its id is the one the stack's request-id layer (which runs
    /// before [`ScopeLayer`]) kept or made.
    pub fn of(request: &Request) -> RequestContext {
        RequestContext {
            method: request.method().clone(),
            uri: request.uri().clone(),
            id: request
                .extensions()
                .get::<RequestId>()
                .map(|id| id.header_value().clone()),
        }
    }

    /// The context of the request this task is handling, if any (inside [`ScopeLayer`]).
    pub fn current() -> Option<RequestContext> {
        CURRENT.try_with(RequestContext::clone).ok()
    }

    /// The span, made now. The id is the header as validated by the request-id layer (ASCII);
    /// the path never carries the query, which may hold secrets.
    fn span(&self) -> tracing::Span {
        let id = self
            .id
            .as_ref()
            .and_then(|id| id.to_str().ok())
            .unwrap_or("");
        tracing::info_span!("request", method = %self.method, path = %self.uri.path(), id)
    }

    /// Runs `log` (code that logs a line) inside this request's span, unless a span is
    /// current already (the up-front span of debug logging).
    pub fn in_scope<T>(&self, log: impl FnOnce() -> T) -> T {
        if tracing::Span::current().is_none() {
            self.span().in_scope(log)
        } else {
            log()
        }
    }
}

/// Runs `log` inside the span of the request this task is handling; outside any request (a
/// background task, a test), just runs it.
pub fn in_request_span<T>(log: impl FnOnce() -> T) -> T {
    in_span_of(RequestContext::current().as_ref(), log)
}

/// Runs `log` inside `request`'s span, or just runs it when there is no request.
pub fn in_span_of<T>(request: Option<&RequestContext>, log: impl FnOnce() -> T) -> T {
    match request {
        Some(request) => request.in_scope(log),
        None => log(),
    }
}

/// The layer ([`crate::stack`]): each request is handled with its context in the task-local,
/// and inside its span from the start when debug lines may be logged. A plain tower layer
/// rather than `axum::middleware::from_fn`: its future is a named type, so a request costs no
/// boxed clone of the inner service and no boxed future (BENCHMARKS.md, "Where a relayed
/// request's CPU goes").
#[derive(Debug, Clone, Copy, Default)]
pub struct ScopeLayer;

impl<S> Layer<S> for ScopeLayer {
    type Service = Scope<S>;

    fn layer(&self, inner: S) -> Scope<S> {
        Scope { inner }
    }
}

/// The service [`ScopeLayer`] makes.
#[derive(Debug, Clone)]
pub struct Scope<S> {
    inner: S,
}

impl<S> Service<Request> for Scope<S>
where
    S: Service<Request>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = TaskLocalFuture<RequestContext, Instrumented<S::Future>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let context = RequestContext::of(&request);
        let span = if LevelFilter::current() >= LevelFilter::DEBUG {
            context.span()
        } else {
            tracing::Span::none()
        };
        CURRENT.scope(context, self.inner.call(request).instrument(span))
    }
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::sync::{Arc, Mutex};

    use axum::response::Response;
    use tracing_subscriber::fmt::MakeWriter;

    use super::*;

    /// A writer that keeps what the subscriber writes.
    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);

    impl Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    impl<'a> MakeWriter<'a> for Captured {
        type Writer = Captured;
        fn make_writer(&'a self) -> Captured {
            self.clone()
        }
    }

    impl Captured {
        fn text(&self) -> String {
            String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
        }
    }

    fn context() -> RequestContext {
        let mut request = Request::builder()
            .method(Method::POST)
            .uri("/v1/chat/completions?secret=1")
            .body(axum::body::Body::empty())
            .unwrap();
        request
            .extensions_mut()
            .insert(RequestId::new(HeaderValue::from_static("req_abc")));
        RequestContext::of(&request)
    }

    fn subscriber(level: LevelFilter, out: &Captured) -> impl tracing::Subscriber + use<> {
        tracing_subscriber::fmt()
            .with_max_level(level)
            .with_ansi(false)
            .with_writer(out.clone())
            .finish()
    }

    #[tokio::test]
    async fn a_line_logged_while_a_request_is_handled_names_the_request() {
        let out = Captured::default();
        let _default = tracing::subscriber::set_default(subscriber(LevelFilter::INFO, &out));
        CURRENT
            .scope(context(), async {
                in_request_span(|| tracing::info!(status = 429, "request shed"));
            })
            .await;
        in_request_span(|| tracing::info!("outside any request"));
        let text = out.text();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert!(
            lines[0].contains("request{method=POST path=/v1/chat/completions id=\"req_abc\"}: ")
                && lines[0].contains("request shed status=429"),
            "{text}"
        );
        assert!(
            !lines[0].contains("secret"),
            "the query is never logged: {text}"
        );
        assert!(!lines[1].contains("request{"), "{text}");
    }

    #[tokio::test]
    async fn a_context_taken_along_logs_in_its_span_after_the_handler_returned() {
        let out = Captured::default();
        let _default = tracing::subscriber::set_default(subscriber(LevelFilter::INFO, &out));
        let taken = CURRENT
            .scope(context(), async { RequestContext::current() })
            .await;
        assert!(RequestContext::current().is_none());
        let taken = taken.expect("the context is current inside the scope");
        taken.in_scope(|| tracing::warn!("upstream answer failed after it started"));
        assert!(
            out.text()
                .contains("request{method=POST path=/v1/chat/completions id=\"req_abc\"}: "),
            "{}",
            out.text()
        );
    }

    #[tokio::test]
    async fn an_up_front_span_is_not_doubled() {
        let out = Captured::default();
        let _default = tracing::subscriber::set_default(subscriber(LevelFilter::DEBUG, &out));
        let context = context();
        let span = context.span();
        CURRENT
            .scope(
                context,
                async { in_request_span(|| tracing::debug!("inside")) }.instrument(span),
            )
            .await;
        let text = out.text();
        assert_eq!(text.matches("request{").count(), 1, "{text}");
    }

    #[tokio::test]
    async fn the_layer_makes_the_context_current_for_the_inner_service() {
        use tower::ServiceExt;
        let inner = tower::service_fn(|_request: Request| async {
            let id = RequestContext::current()
                .and_then(|context| context.id)
                .unwrap_or(HeaderValue::from_static("none"));
            Ok::<_, std::convert::Infallible>(Response::new(axum::body::Body::from(
                id.as_bytes().to_vec(),
            )))
        });
        let mut request = Request::new(axum::body::Body::empty());
        request
            .extensions_mut()
            .insert(RequestId::new(HeaderValue::from_static("req_xyz")));
        let response = ScopeLayer.layer(inner).oneshot(request).await.unwrap();
        let body = axum::body::to_bytes(response.into_body(), 64)
            .await
            .unwrap();
        assert_eq!(&body[..], b"req_xyz");
        assert!(
            RequestContext::current().is_none(),
            "only inside the request"
        );
    }
}
