//! A minimal, fast OpenAI-compatible upstream for the proxy benchmark
//! (`scripts/bench-proxy-vs-nginx.sh`): every `POST /v1/chat/completions` or
//! `POST /v1/completions` is answered at once with one small fixed completion (its request body
//! read, not parsed), `GET /health` and anything else with 200 `ok`. It does no work per
//! request beyond HTTP, so whatever a proxy in front of it adds is the proxy's.
//!
//! ```sh
//! cargo run --example stub_upstream -- 127.0.0.1:9100 [WORKER_THREADS]
//! ```

use std::convert::Infallible;
use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;

const CHAT: &str = r#"{"id":"chatcmpl-stub","object":"chat.completion","created":0,"model":"stub","choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant","content":"ok"}}],"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}"#;
const COMPLETION: &str = r#"{"id":"cmpl-stub","object":"text_completion","created":0,"model":"stub","choices":[{"index":0,"finish_reason":"stop","text":"ok"}],"usage":{"prompt_tokens":8,"completion_tokens":1,"total_tokens":9}}"#;

#[path = "support/bench_cli.rs"]
mod bench_cli;

const CLI: bench_cli::BenchCli = bench_cli::BenchCli {
    program: "stub_upstream",
    usage: "stub_upstream ADDR [WORKER_THREADS]   (e.g. 127.0.0.1:9100 1)",
};

fn main() {
    let mut args = std::env::args().skip(1);
    let addr = CLI.addr(args.next(), "ADDR");
    CLI.run(args.next(), Some(1), addr, serve(addr));
}

async fn serve(addr: SocketAddr) -> std::io::Result<()> {
    CLI.accept_each(addr, |stream| async move {
        // A client that drops its connection mid-request is no error of the stub's.
        let _ = http1::Builder::new()
            .serve_connection(TokioIo::new(stream), service_fn(answer))
            .await;
    })
    .await
}

async fn answer(request: Request<Incoming>) -> Result<Response<Full<Bytes>>, Infallible> {
    let (content_type, body) = match request.uri().path() {
        "/v1/chat/completions" => ("application/json", CHAT),
        "/v1/completions" => ("application/json", COMPLETION),
        _ => ("text/plain", "ok"),
    };
    // Read the request to its end, as an engine would, so the connection stays reusable.
    let _ = request.into_body().collect().await;
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(content_type),
    );
    Ok(response)
}
