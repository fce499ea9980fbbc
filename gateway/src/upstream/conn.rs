//! One replica's HTTP/1.1 connections: hyper's client connection driven directly
//! (`hyper::client::conn::http1`), with a small LIFO list of idle keep-alive connections.
//!
//! hyper-util's pooled client did the same job with one more task per request: an HTTP/1
//! connection is busy until its response body has been read, so that client spawned a task
//! per request to wait for the connection to become free and put it back. Here the response
//! body ([`UpstreamBody`]) hands its connection back itself when it yields its last frame;
//! only a connection that is not free yet at that moment (rare: its connection task has not
//! caught up) gets such a task, and a body dropped before its end closes its connection
//! (hyper's rule: a half-read HTTP/1 response cannot be followed by another request).
//!
//! * Idle connections are kept at most [`MAX_IDLE`] per replica and [`POOL_IDLE_TIMEOUT`]
//!   long; a closed one is dropped when found.
//! * A request that could not be written on a reused connection (closed by the upstream in
//!   the meantime) is sent again on a fresh one, as hyper-util's client did; any other error
//!   is the caller's (a breaker failure, maybe a retry on another replica).
//! * `TCP_NODELAY` is set, and opening a connection is bounded by [`CONNECT_TIMEOUT`].

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http::header::HOST;
use http::{HeaderValue, Request, Response, Uri};
use http_body::{Frame, SizeHint};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;

use super::{CONNECT_TIMEOUT, POOL_IDLE_TIMEOUT};

/// Most idle keep-alive connections kept per replica (more are closed when they free up).
pub const MAX_IDLE: usize = 128;

type Sender = SendRequest<Full<Bytes>>;

/// A replica's connections. Cheap to clone (clones share the idle list).
#[derive(Clone)]
pub(crate) struct ConnPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    /// `host:port`, where connections go.
    address: String,
    /// The `Host` header of every request.
    host: HeaderValue,
    /// Free connections, the most recently used last.
    idle: Mutex<Vec<(Sender, Instant)>>,
}

/// Why a request got no response.
#[derive(Debug)]
pub(crate) enum SendError {
    /// No TCP connection within [`CONNECT_TIMEOUT`], or the connect failed.
    Connect(String),
    /// The connection failed after the request was (maybe) written.
    Request(hyper::Error),
}

impl std::fmt::Display for SendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SendError::Connect(detail) => write!(f, "connect error: {detail}"),
            SendError::Request(error) => {
                write!(f, "{error}")?;
                let mut source = std::error::Error::source(error);
                while let Some(cause) = source {
                    write!(f, ": {cause}")?;
                    source = cause.source();
                }
                Ok(())
            }
        }
    }
}

impl ConnPool {
    /// Connections to `base_url` (`http://host[:port][/prefix]`, as `UpstreamSpec` checked it).
    pub(crate) fn new(base_url: &str) -> ConnPool {
        let authority = base_url
            .parse::<Uri>()
            .ok()
            .and_then(|uri| uri.authority().cloned());
        let (address, host) = match authority {
            Some(authority) => {
                let port = authority.port_u16().unwrap_or(80);
                (
                    format!("{}:{port}", authority.host()),
                    HeaderValue::from_str(authority.as_str())
                        .unwrap_or_else(|_| HeaderValue::from_static("localhost")),
                )
            }
            // Not reachable through `UpstreamSpec` (it checks the URL); every connect fails.
            None => (String::new(), HeaderValue::from_static("localhost")),
        };
        ConnPool {
            inner: Arc::new(PoolInner {
                address,
                host,
                idle: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Sends `request` (origin-form URI; the `Host` header is set here) and waits for the
    /// response headers. The caller bounds the wait; dropping this future closes the
    /// connection the request went out on.
    pub(crate) async fn send(
        &self,
        mut request: Request<Full<Bytes>>,
    ) -> Result<Response<UpstreamBody>, SendError> {
        request.headers_mut().insert(HOST, self.inner.host.clone());
        while let Some(mut sender) = self.checkout() {
            match sender.try_send_request(request).await {
                Ok(response) => return Ok(self.wrap(response, sender)),
                Err(mut error) => match error.take_message() {
                    // Never written: the connection was closed under it; try the next one.
                    Some(unsent) => request = unsent,
                    None => return Err(SendError::Request(error.into_error())),
                },
            }
        }
        let mut sender = self.connect().await?;
        let response = sender
            .send_request(request)
            .await
            .map_err(SendError::Request)?;
        Ok(self.wrap(response, sender))
    }

    /// Idle connections now.
    #[cfg(test)]
    pub(crate) fn idle_count(&self) -> usize {
        self.inner.idle.lock().len()
    }

    fn wrap(&self, response: Response<Incoming>, sender: Sender) -> Response<UpstreamBody> {
        response.map(|body| UpstreamBody {
            inner: body,
            conn: Some(Checkout {
                sender: Some(sender),
                pool: self.clone(),
            }),
        })
    }

    /// The most recently freed connection that is ready for a request; stale ones are closed.
    fn checkout(&self) -> Option<Sender> {
        let mut idle = self.inner.idle.lock();
        while let Some((sender, since)) = idle.pop() {
            if sender.is_ready() && since.elapsed() < POOL_IDLE_TIMEOUT {
                return Some(sender);
            }
        }
        None
    }

    /// Keeps a free connection (LIFO), closing the oldest beyond [`MAX_IDLE`].
    fn check_in(&self, sender: Sender) {
        let mut idle = self.inner.idle.lock();
        if idle.len() >= MAX_IDLE {
            idle.remove(0);
        }
        idle.push((sender, Instant::now()));
    }

    async fn connect(&self) -> Result<Sender, SendError> {
        let address = self.inner.address.as_str();
        let stream =
            match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(address))
                .await
            {
                Ok(Ok(stream)) => stream,
                Ok(Err(error)) => return Err(SendError::Connect(format!("{address}: {error}"))),
                Err(_) => {
                    return Err(SendError::Connect(format!(
                        "{address}: no connection within {}s",
                        CONNECT_TIMEOUT.as_secs()
                    )));
                }
            };
        stream
            .set_nodelay(true)
            .map_err(|error| SendError::Connect(format!("{address}: {error}")))?;
        let (sender, connection) = http1::handshake(TokioIo::new(stream))
            .await
            .map_err(SendError::Request)?;
        // The connection's own task: reads and writes the socket until either side closes.
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%error, "upstream connection ended");
            }
        });
        Ok(sender)
    }
}

/// A connection lent to one response: back to the pool once free, closed otherwise.
struct Checkout {
    sender: Option<Sender>,
    pool: ConnPool,
}

impl Checkout {
    /// The response was read to its end: the connection is free (or about to be).
    fn release(&mut self) {
        let Some(mut sender) = self.sender.take() else {
            return;
        };
        if sender.is_ready() {
            self.pool.check_in(sender);
        } else if !sender.is_closed()
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            // Its connection task has not yet taken in the end of the response.
            let pool = self.pool.clone();
            runtime.spawn(async move {
                if sender.ready().await.is_ok() {
                    pool.check_in(sender);
                }
            });
        }
    }
}

/// A response body from an upstream connection. Read to its end, it returns its connection
/// to the pool; dropped before, it closes it.
pub struct UpstreamBody {
    inner: Incoming,
    conn: Option<Checkout>,
}

impl std::fmt::Debug for UpstreamBody {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamBody")
            .field("inner", &self.inner)
            .field("holds_connection", &self.conn.is_some())
            .finish()
    }
}

impl http_body::Body for UpstreamBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(None) => {
                if let Some(mut conn) = self.conn.take() {
                    conn.release();
                }
            }
            Poll::Ready(Some(Err(_))) => self.conn = None,
            Poll::Ready(Some(Ok(_))) if self.inner.is_end_stream() => {
                if let Some(mut conn) = self.conn.take() {
                    conn.release();
                }
            }
            _ => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt;
    use hyper::server::conn::http1 as server;
    use hyper::service::service_fn;

    use super::*;

    /// A server on loopback answering `/big` with 1 MiB and anything else with its path and
    /// the `Host` header it got; returns its address and its count of accepted connections.
    async fn server() -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let accepted = Arc::new(AtomicUsize::new(0));
        let counter = Arc::clone(&accepted);
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let service = service_fn(|request: Request<Incoming>| async move {
                        let text = if request.uri().path() == "/big" {
                            vec![b'x'; 1 << 20]
                        } else {
                            let host = request.headers().get(HOST).cloned();
                            let host = host.as_ref().and_then(|h| h.to_str().ok()).unwrap_or("");
                            format!("{} {host}", request.uri()).into_bytes()
                        };
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(text))))
                    });
                    let _ = server::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        (address, accepted)
    }

    fn get(path: &str) -> Request<Full<Bytes>> {
        Request::get(path).body(Full::new(Bytes::new())).unwrap()
    }

    async fn text(response: Response<UpstreamBody>) -> String {
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[tokio::test]
    async fn a_connection_read_to_its_end_serves_the_next_request() {
        let (address, accepted) = server().await;
        let pool = ConnPool::new(&format!("http://{address}/prefix"));
        for _ in 0..5 {
            let response = pool.send(get("/v1/models")).await.unwrap();
            assert_eq!(text(response).await, format!("/v1/models {address}"));
        }
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "one kept-alive connection"
        );
        // Freed either at once or by the connection's own task: wait for it without a clock.
        while pool.idle_count() != 1 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test]
    async fn a_body_dropped_before_its_end_closes_its_connection() {
        let (address, accepted) = server().await;
        let pool = ConnPool::new(&format!("http://{address}"));
        let mut response = pool.send(get("/big")).await.unwrap();
        let first = response.body_mut().frame().await.unwrap().unwrap();
        assert!(first.is_data());
        drop(response);
        assert_eq!(
            pool.idle_count(),
            0,
            "a half-read connection is never lent again"
        );
        let response = pool.send(get("/again")).await.unwrap();
        assert_eq!(text(response).await, format!("/again {address}"));
        assert_eq!(accepted.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn concurrent_requests_get_their_own_connections_and_idle_ones_are_bounded() {
        let (address, accepted) = server().await;
        let pool = ConnPool::new(&format!("http://{address}"));
        let held: Vec<_> = futures::future::join_all((0..3).map(|_| pool.send(get("/x"))))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        assert_eq!(accepted.load(Ordering::SeqCst), 3);
        for response in held {
            assert_eq!(text(response).await, format!("/x {address}"));
        }
        while pool.idle_count() != 3 {
            tokio::task::yield_now().await;
        }
        const { assert!(MAX_IDLE >= 3) };
    }

    #[tokio::test]
    async fn nobody_listening_is_a_connect_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        drop(listener);
        let pool = ConnPool::new(&format!("http://{address}"));
        let error = pool.send(get("/")).await.unwrap_err();
        assert!(matches!(error, SendError::Connect(_)), "{error}");
        assert!(error.to_string().starts_with("connect error: "), "{error}");
    }
}
