//! Hardening through the real server: per-tenant limits decided before a request's body is
//! read, the operator address (`metrics_listen`) and what the public probes may show, and
//! client-supplied request ids.

mod common;

use std::net::SocketAddr;
use std::time::Duration;

use common::client::raw_connect;
use common::{Client, Options, TenantSpec, TestServer, chat, policy};
use hyper::StatusCode;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const CHAT: &str = "/v1/chat/completions";
const WAIT: Duration = Duration::from_secs(60);

/// The headers of a chat POST announcing a `length`-byte body, none of which is sent.
fn headers_only(key: &str, length: usize) -> Vec<u8> {
    format!(
        "POST {CHAT} HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    )
    .into_bytes()
}

/// Reads a response's status line and headers (and whatever body came with them).
async fn response_head(stream: &mut TcpStream) -> String {
    let mut head = Vec::new();
    let mut buffer = [0u8; 4096];
    let read = tokio::time::timeout(WAIT, async {
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            match stream.read(&mut buffer).await {
                Ok(0) | Err(_) => break,
                Ok(n) => head.extend_from_slice(&buffer[..n]),
            }
        }
    })
    .await;
    assert!(read.is_ok(), "no response head within {WAIT:?}");
    String::from_utf8_lossy(&head).into_owned()
}

fn status_of(head: &str) -> u16 {
    head.split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("not an HTTP response: {head:?}"))
}

fn header_of<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().find_map(|line| {
        let (key, value) = line.split_once(':')?;
        key.eq_ignore_ascii_case(name).then(|| value.trim())
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_request_rate_is_refused_before_its_body_is_read() {
    let tenants = [
        TenantSpec {
            name: "slow",
            key: "sk-slow",
            extra: "requests_per_minute = 1",
        },
        TenantSpec {
            name: "other",
            key: "sk-other",
            extra: "requests_per_minute = 1",
        },
    ];
    let server = TestServer::start(&policy(&tenants, "")).await;
    let client = server.client();
    let first = client.post(CHAT, Some("sk-slow"), &chat("Hi.", 1)).await;
    assert_eq!(first.status, StatusCode::OK);

    // The second request announces a body and never sends it. Were the body read first, the
    // answer would be 408 after the idle timeout; it is the rate's 429, from the headers.
    let mut stream = raw_connect(server.addr, &headers_only("sk-slow", 100_000)).await;
    let head = response_head(&mut stream).await;
    assert_eq!(status_of(&head), 429, "{head}");
    assert!(head.contains("rate_limit_exceeded"), "{head}");
    assert_eq!(
        header_of(&head, "x-ratelimit-remaining-requests"),
        Some("0")
    );
    let retry: u64 = header_of(&head, "retry-after")
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("retry-after: {head}"));
    assert!((1..=60).contains(&retry), "{head}");

    // The other tenant's own bucket is untouched.
    let other = client.post(CHAT, Some("sk-other"), &chat("Hi.", 1)).await;
    assert_eq!(other.status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_validation_cap_is_refused_before_its_body_is_read() {
    let tenants = [
        TenantSpec {
            name: "uploader",
            key: "sk-up",
            extra: "max_validating = 2",
        },
        TenantSpec {
            name: "other",
            key: "sk-other",
            extra: "max_validating = 1",
        },
    ];
    // The uploads below stall mid-body on purpose: give them longer than the test needs
    // before the body read times out (which would free their places early).
    let mut options = Options::default();
    options.serve.idle_timeout = Duration::from_secs(300);
    let server = TestServer::start_with(&policy(&tenants, ""), options).await;
    let client = server.client();

    // Two slow uploads: headers and the first bytes of a body that never completes.
    let mut uploads = Vec::new();
    for _ in 0..2 {
        uploads.push(slow_upload(server.addr, "sk-up").await);
    }
    // Until both uploads hold their places, a probe may still get in (a malformed body: 400),
    // and a probe holding a place may get an upload refused: that upload is sent again.
    let refused = probe_until_refused(&client, "sk-up", server.addr, &mut uploads).await;
    assert!(refused.contains("intake_full"), "{refused}");
    assert!(refused.contains("max_validating"), "{refused}");

    // A third request of the uploader, headers only: refused at once, body never read.
    let mut third = raw_connect(server.addr, &headers_only("sk-up", 4096)).await;
    let head = response_head(&mut third).await;
    assert_eq!(status_of(&head), 429, "{head}");
    assert_eq!(header_of(&head, "retry-after"), Some("1"), "{head}");

    // Another tenant is unaffected, at its own cap of one.
    let other = client.post(CHAT, Some("sk-other"), &chat("Hi.", 1)).await;
    assert_eq!(other.status, StatusCode::OK);

    // The uploads end (the clients leave): the uploader's places come back.
    drop(uploads);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let reply = client.post(CHAT, Some("sk-up"), &chat("Hi.", 1)).await;
        if reply.status == StatusCode::OK {
            break;
        }
        assert_eq!(reply.status, StatusCode::TOO_MANY_REQUESTS);
        assert!(tokio::time::Instant::now() < deadline, "places never freed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Headers of a 4 KiB chat upload for `key` and the first bytes of its body, the rest never sent.
async fn slow_upload(addr: SocketAddr, key: &str) -> TcpStream {
    let mut stream = raw_connect(addr, &headers_only(key, 4096)).await;
    stream.write_all(b"{\"model\":").await.expect("write");
    stream
}

/// Sends malformed bodies for `key` until one is refused by intake; returns that answer.
/// A probe is itself one of `key`'s places while it is read, so an upload that arrives then is
/// refused (answered at once): every upload that got an answer or was closed is sent again.
async fn probe_until_refused(
    client: &Client,
    key: &str,
    addr: SocketAddr,
    uploads: &mut [TcpStream],
) -> String {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let reply = client.post_bytes(CHAT, Some(key), "{").await;
        match reply.status.as_u16() {
            429 => return String::from_utf8_lossy(&reply.body).into_owned(),
            400 => {}
            other => panic!("unexpected {other}: {:?}", reply.body),
        }
        for upload in uploads.iter_mut() {
            let mut byte = [0u8; 1];
            let answered = match upload.try_read(&mut byte) {
                Ok(_) => true,
                Err(error) => error.kind() != std::io::ErrorKind::WouldBlock,
            };
            if answered {
                *upload = slow_upload(addr, key).await;
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "never refused");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn with_metrics_address() -> Options {
    let mut options = Options::default();
    options.serve.metrics_listen = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
    options
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_probe_detail_move_to_the_metrics_address() {
    let tenants = [TenantSpec {
        name: "secret-tenant-name",
        key: "sk-m",
        extra: "",
    }];
    let server = TestServer::start_with(&policy(&tenants, ""), with_metrics_address()).await;
    let operator = Client::new(server.metrics_addr.expect("a metrics address"));
    let public = server.client();
    assert_ne!(operator.addr(), public.addr());
    // Traffic, so the tenant appears in the metrics.
    let reply = public.post(CHAT, Some("sk-m"), &chat("Hi.", 1)).await;
    assert_eq!(reply.status, StatusCode::OK);

    let metrics = operator.get("/metrics", None).await;
    assert_eq!(metrics.status, StatusCode::OK);
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(text.contains("kvgate_kv_blocks"), "{text}");
    assert!(
        text.contains("secret-tenant-name"),
        "per-tenant series are there"
    );
    let detail = operator.get("/readyz", None).await;
    assert_eq!(detail.status, StatusCode::OK);
    let policy_path = server.policy_path.display().to_string();
    assert_eq!(detail.json()["policy"], policy_path.as_str());
    assert_eq!(detail.json()["tenants"], 1);
    assert_eq!(operator.get("/healthz", None).await.status, StatusCode::OK);
    // /admin/kv is there too (it asks for an admin key, which this policy has none of).
    assert_eq!(
        operator.get("/admin/kv", None).await.status,
        StatusCode::UNAUTHORIZED
    );

    // The public address has none of it.
    for path in ["/metrics", "/admin/kv"] {
        let reply = public.get(path, None).await;
        assert_eq!(reply.status, StatusCode::NOT_FOUND, "{path}");
    }
    assert_public_probes_are_bare(&public, &policy_path).await;
    // The metrics address serves no API route.
    let reply = operator.post(CHAT, Some("sk-m"), &chat("Hi.", 1)).await;
    assert_eq!(reply.status, StatusCode::NOT_FOUND);
    server.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn public_probes_never_show_the_policy_or_its_tenants() {
    let tenants = [TenantSpec {
        name: "secret-tenant-name",
        key: "sk-p",
        extra: "",
    }];
    // Without a metrics address, /metrics stays on the API address (as before) ...
    let server = TestServer::start(&policy(&tenants, "")).await;
    let public = server.client();
    assert_eq!(public.get("/metrics", None).await.status, StatusCode::OK);
    // ... but the probes are bare all the same.
    let policy_path = server.policy_path.display().to_string();
    assert_public_probes_are_bare(&public, &policy_path).await;
}

async fn assert_public_probes_are_bare(public: &Client, policy_path: &str) {
    for path in ["/readyz", "/healthz"] {
        let reply = public.get(path, None).await;
        assert_eq!(reply.status, StatusCode::OK, "{path}");
        let body = String::from_utf8_lossy(&reply.body).into_owned();
        let json: Value = serde_json::from_str(&body).expect("JSON probe");
        assert_eq!(json.as_object().map(|o| o.len()), Some(1), "{path}: {body}");
        assert!(json["status"].is_string(), "{path}: {body}");
        assert!(!body.contains(policy_path), "{path}: {body}");
        assert!(!body.contains("secret-tenant-name"), "{path}: {body}");
    }
}

/// The `x-request-id` a GET /healthz answered with, sending `sent` (raw header bytes) if any.
async fn answered_request_id(addr: SocketAddr, sent: Option<&[u8]>) -> String {
    let mut request = b"GET /healthz HTTP/1.1\r\nHost: test\r\nConnection: close\r\n".to_vec();
    if let Some(value) = sent {
        request.extend_from_slice(b"x-request-id: ");
        request.extend_from_slice(value);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"\r\n");
    let mut stream = raw_connect(addr, &request).await;
    let head = response_head(&mut stream).await;
    assert_eq!(status_of(&head), 200, "{head}");
    header_of(&head, "x-request-id")
        .unwrap_or_else(|| panic!("no x-request-id: {head}"))
        .to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_request_ids_are_kept_only_when_bounded_and_plain() {
    let tenants = [TenantSpec {
        name: "ids",
        key: "sk-ids",
        extra: "",
    }];
    let server = TestServer::start(&policy(&tenants, "")).await;
    let kept = "0b6e1f0c-5d3a-4b8e-9c1d-2f3a4b5c6d7e";
    assert_eq!(
        answered_request_id(server.addr, Some(kept.as_bytes())).await,
        kept
    );
    let generated = |id: &str| id.starts_with("req_") && id.len() == 28;
    let too_long = "a".repeat(129);
    for bad in [
        too_long.as_bytes(),
        b"two words",
        b"<script>alert(1)</script>",
        b"id\"with\"quotes",
        "caf\u{e9}".as_bytes(),
    ] {
        let answered = answered_request_id(server.addr, Some(bad)).await;
        assert!(
            generated(&answered),
            "{:?} was answered with {answered:?}",
            String::from_utf8_lossy(bad)
        );
    }
    assert!(generated(&answered_request_id(server.addr, None).await));
}

/// Status, head and JSON body of a raw GET /healthz with `extra` header lines and `path`.
async fn raw_get(addr: SocketAddr, path: &str, extra: &str) -> (u16, String, Value) {
    let request = format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n{extra}\r\n");
    let mut stream = raw_connect(addr, request.as_bytes()).await;
    let answer = tokio::time::timeout(WAIT, common::client::read_to_close(&mut stream))
        .await
        .expect("the server answers and closes");
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let json = serde_json::from_str(body).unwrap_or(Value::Null);
    (status_of(head), head.to_owned(), json)
}

/// An oversized cookie or query string gets 431 / 414 with an OpenAI-style body, the request
/// id and the rate-limit headers, like every other refusal; it used to be hyper's bare status
/// line. Requests just within the limits are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_headers_and_uris_get_openai_style_431_and_414() {
    let tenants = [TenantSpec {
        name: "head",
        key: "sk-head",
        extra: "",
    }];
    let server = TestServer::start(&policy(&tenants, "")).await;
    let cookie = |bytes: usize| format!("Cookie: {}\r\n", "c".repeat(bytes));

    let (status, head, json) = raw_get(server.addr, "/healthz", &cookie(20_000)).await;
    assert_eq!(status, 431, "{head}");
    assert_eq!(
        json["error"]["code"], "request_header_fields_too_large",
        "{json}"
    );
    assert_eq!(json["error"]["type"], "invalid_request_error");
    let message = json["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("16384-byte limit"), "{message}");
    assert!(header_of(&head, "x-request-id").is_some(), "{head}");
    assert!(
        header_of(&head, "x-ratelimit-limit-requests").is_some(),
        "{head}"
    );

    let long_query = format!("/healthz?q={}", "q".repeat(9_000));
    let (status, head, json) = raw_get(server.addr, &long_query, "").await;
    assert_eq!(status, 414, "{head}");
    assert_eq!(json["error"]["code"], "uri_too_long", "{json}");

    // Exactly at the limit: Host (12 bytes with its line end), Connection (19) and the cookie
    // line (10 + value) make 16,384. The request id the server makes is not counted (QA: it
    // took 44 bytes of the client's budget).
    let (status, head, _) = raw_get(server.addr, "/healthz", &cookie(16_343)).await;
    assert_eq!(status, 200, "at the limit: {head}");
    let (status, head, _) = raw_get(server.addr, "/healthz", &cookie(16_344)).await;
    assert_eq!(status, 431, "one byte over: {head}");
    let within = format!("/healthz?q={}", "q".repeat(7_000));
    let (status, head, _) = raw_get(server.addr, &within, "").await;
    assert_eq!(status, 200, "within the limit: {head}");
}
