//! The floor of a reverse proxy built on the stack kvgate serves with (tokio + hyper), for the
//! proxy benchmark (`scripts/bench-proxy-vs-nginx.sh`, target `hyper`): each client
//! connection gets its own keep-alive HTTP/1.1 connection to one upstream, and every request is
//! forwarded on it as it came (method, path, headers less `host`, the body read whole) and the
//! answer relayed as it came. No routing, no parsing of bodies, no limits, no metrics, no pool
//! shared between connections: whatever kvgate adds beyond this is kvgate's own work, and what
//! this adds beyond nginx is the cost of the runtime and the HTTP library.
//!
//! ```sh
//! cargo run --release --example bare_proxy -- 127.0.0.1:9102 127.0.0.1:9100 [WORKER_THREADS]
//! ```
//!
//! `BARE_PROXY_SPIN_US=IN:OUT` makes it busy-wait IN µs before forwarding each request and OUT
//! µs after its answer's head arrives: the floor made to spend a given CPU time per request,
//! to see how a proxy's latency tail grows with its work (`scripts/bench-proxy-tail.sh`).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::client::conn::http1::SendRequest;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::sync::Mutex;

type ProxyBody = BoxBody<Bytes, hyper::Error>;

#[path = "support/bench_cli.rs"]
mod bench_cli;

const CLI: bench_cli::BenchCli = bench_cli::BenchCli {
    program: "bare_proxy",
    usage: "bare_proxy LISTEN UPSTREAM [WORKER_THREADS]   (e.g. 127.0.0.1:9102 127.0.0.1:9100)",
};

/// Busy-wait before forwarding and after the answer's head ([`spin_from_env`]).
#[derive(Debug, Clone, Copy, Default)]
struct Spin {
    before: Duration,
    after: Duration,
}

/// Set once in `main`.
static SPIN: OnceLock<Spin> = OnceLock::new();

/// `BARE_PROXY_SPIN_US=IN:OUT`, or no spin.
fn spin_from_env() -> Spin {
    let Ok(text) = std::env::var("BARE_PROXY_SPIN_US") else {
        return Spin::default();
    };
    let parsed = text
        .split_once(':')
        .and_then(|(a, b)| Some((a.parse().ok()?, b.parse().ok()?)));
    match parsed {
        Some((before, after)) => Spin {
            before: Duration::from_micros(before),
            after: Duration::from_micros(after),
        },
        None => {
            eprintln!("bare_proxy: BARE_PROXY_SPIN_US must be IN:OUT in microseconds, e.g. 20:20");
            std::process::exit(2);
        }
    }
}

/// Spends `time` on this thread's CPU (a stand-in for a gateway's own work per request).
fn busy_wait(time: Duration) {
    let start = Instant::now();
    while start.elapsed() < time {
        std::hint::spin_loop();
    }
}

fn main() {
    SPIN.get_or_init(spin_from_env);
    let mut args = std::env::args().skip(1);
    let listen = CLI.addr(args.next(), "LISTEN");
    let upstream = CLI.addr(args.next(), "UPSTREAM");
    // The runtime's default, as kvgate's: one worker per core.
    CLI.run(args.next(), None, listen, serve(listen, upstream));
}

async fn serve(listen: SocketAddr, upstream: SocketAddr) -> std::io::Result<()> {
    CLI.accept_each(listen, move |stream| async move {
        // This connection's own upstream connection, opened at its first request.
        let sender: Arc<Mutex<Option<SendRequest<Full<Bytes>>>>> = Arc::default();
        let service = service_fn(move |request| forward(request, upstream, Arc::clone(&sender)));
        // A client that drops its connection mid-request is no error of the proxy's.
        let _ = http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service)
            .await;
    })
    .await
}

async fn forward(
    request: Request<Incoming>,
    upstream: SocketAddr,
    sender: Arc<Mutex<Option<SendRequest<Full<Bytes>>>>>,
) -> Result<Response<ProxyBody>, Infallible> {
    match relay(request, upstream, &sender).await {
        Ok(response) => Ok(response),
        Err(error) => {
            *sender.lock().await = None;
            let mut response = Response::new(
                Full::new(Bytes::from(format!("bare_proxy: {error}\n")))
                    .map_err(|never| match never {})
                    .boxed(),
            );
            *response.status_mut() = StatusCode::BAD_GATEWAY;
            Ok(response)
        }
    }
}

async fn relay(
    request: Request<Incoming>,
    upstream: SocketAddr,
    sender: &Mutex<Option<SendRequest<Full<Bytes>>>>,
) -> Result<Response<ProxyBody>, Box<dyn std::error::Error + Send + Sync>> {
    let (mut parts, body) = request.into_parts();
    let body = body.collect().await?.to_bytes();
    parts.headers.remove(hyper::header::HOST);
    let spin = SPIN.get().copied().unwrap_or_default();
    busy_wait(spin.before);
    let mut slot = sender.lock().await;
    if slot.as_ref().is_none_or(|open| open.is_closed()) {
        let stream = TcpStream::connect(upstream).await?;
        stream.set_nodelay(true)?;
        let (open, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await?;
        tokio::spawn(connection);
        *slot = Some(open);
    }
    let Some(open) = slot.as_mut() else {
        return Err("no upstream connection".into());
    };
    open.ready().await?;
    let response = open
        .send_request(Request::from_parts(parts, Full::new(body)))
        .await?;
    busy_wait(spin.after);
    Ok(response.map(BodyExt::boxed))
}
