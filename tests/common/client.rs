//! A minimal HTTP client for the end-to-end tests: JSON requests, SSE streams, and raw TCP for
//! tests that must misbehave (slow headers, truncated bodies, disconnects).

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderMap};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::Client as HyperClient;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

#[derive(Clone)]
pub struct Client {
    addr: SocketAddr,
    inner: HyperClient<HttpConnector, Full<Bytes>>,
}

/// A complete response.
#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    /// `error.code` of an OpenAI error body.
    pub fn error_code(&self) -> String {
        self.json()["error"]["code"]
            .as_str()
            .unwrap_or_default()
            .to_owned()
    }
}

/// A streaming response whose SSE `data:` payloads are read one at a time.
pub struct SseReply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    body: Incoming,
    buffer: String,
}

impl SseReply {
    /// The next `data:` payload, `None` at the end of the body.
    pub async fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(end) = self.buffer.find("\n\n") {
                let event: String = self.buffer.drain(..end + 2).collect();
                let data: Vec<&str> = event
                    .lines()
                    .filter_map(|l| l.strip_prefix("data: "))
                    .collect();
                if data.is_empty() {
                    continue; // a keep-alive comment
                }
                return Some(data.join("\n"));
            }
            let frame = self.body.frame().await?.ok()?;
            if let Ok(bytes) = frame.into_data() {
                self.buffer.push_str(&String::from_utf8_lossy(&bytes));
            }
        }
    }

    /// Every remaining payload.
    pub async fn collect_data(mut self) -> Vec<String> {
        let mut all = Vec::new();
        while let Some(data) = self.next_data().await {
            all.push(data);
        }
        all
    }
}

impl Client {
    pub fn new(addr: SocketAddr) -> Client {
        let inner = HyperClient::builder(TokioExecutor::new()).build_http();
        Client { addr, inner }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    fn request(
        &self,
        method: Method,
        path: &str,
        key: Option<&str>,
        body: Bytes,
    ) -> Request<Full<Bytes>> {
        let mut builder = Request::builder()
            .method(method)
            .uri(format!("http://{}{path}", self.addr))
            .header(CONTENT_TYPE, "application/json");
        if let Some(key) = key {
            builder = builder.header(AUTHORIZATION, format!("Bearer {key}"));
        }
        builder.body(Full::new(body)).expect("valid request")
    }

    async fn send(&self, request: Request<Full<Bytes>>) -> Reply {
        let response = self.inner.request(request).await.expect("server answers");
        let (parts, body) = response.into_parts();
        let body = body.collect().await.expect("body arrives").to_bytes();
        Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        }
    }

    pub async fn post(&self, path: &str, key: Option<&str>, body: &Value) -> Reply {
        let bytes = Bytes::from(serde_json::to_vec(body).expect("json"));
        self.send(self.request(Method::POST, path, key, bytes))
            .await
    }

    pub async fn post_bytes(&self, path: &str, key: Option<&str>, body: impl Into<Bytes>) -> Reply {
        self.send(self.request(Method::POST, path, key, body.into()))
            .await
    }

    pub async fn get(&self, path: &str, key: Option<&str>) -> Reply {
        self.send(self.request(Method::GET, path, key, Bytes::new()))
            .await
    }

    pub async fn send_method(&self, method: Method, path: &str, key: Option<&str>) -> Reply {
        self.send(self.request(method, path, key, Bytes::new()))
            .await
    }

    /// Starts a request and returns as soon as the headers arrive.
    pub async fn stream(&self, path: &str, key: Option<&str>, body: &Value) -> SseReply {
        let bytes = Bytes::from(serde_json::to_vec(body).expect("json"));
        let response = self
            .inner
            .request(self.request(Method::POST, path, key, bytes))
            .await
            .expect("server answers");
        let (parts, body) = response.into_parts();
        SseReply {
            status: parts.status,
            headers: parts.headers,
            body,
            buffer: String::new(),
        }
    }
}

/// Writes `request` on a fresh connection and returns the connection for the test to drive.
pub async fn raw_connect(addr: SocketAddr, request: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.expect("connect");
    stream.write_all(request).await.expect("write");
    stream
}

/// Reads until the server closes the connection.
pub async fn read_to_close(stream: &mut TcpStream) -> String {
    let mut out = Vec::new();
    let _ = stream.read_to_end(&mut out).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// A raw HTTP/1.1 POST of a JSON body.
pub fn raw_post(path: &str, key: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}
